"""The settings' value ranges, as a table: each row a dotted key, the requirement its valid values
meet, and that requirement in words for the one-line error (mrl/config/validation.py reads it)."""

from __future__ import annotations

from typing import Any, Callable

from mrl.config.schema import RECOMPUTE_MODULES, RunConfig

# (dotted key, requirement that holds for valid values, the requirement in words)
_RANGES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("trainer.total_steps", lambda v: v >= 1, ">= 1"),
    ("trainer.sft_steps", lambda v: v >= 0, ">= 0"),
    ("trainer.ppo_epochs", lambda v: v >= 1, ">= 1"),
    ("trainer.ppo_mini_batch_size", lambda v: v is None or v >= 1, ">= 1 (or null: one step on the whole batch)"),
    ("critic.ppo_epochs", lambda v: v is None or v >= 1, ">= 1 (or null: trainer.ppo_epochs)"),
    ("trainer.sft_lr", lambda v: v is None or v > 0, "> 0 (or null: optim.lr)"),
    ("trainer.sft_pack_tokens", lambda v: v is None or v >= 2, ">= 2 (or null: no packing)"),
    ("trainer.eval_every", lambda v: v >= 0, ">= 0"),
    ("trainer.eval_samples", lambda v: v >= 0, ">= 0"),
    ("rollout.num_engines", lambda v: v >= 1, ">= 1"),
    ("model.recompute_num_layers", lambda v: v >= 1, ">= 1"),
    ("model.recompute_modules", lambda v: v is None or set(v) <= set(RECOMPUTE_MODULES),
     f"a list of {', '.join(RECOMPUTE_MODULES)} (or null: core_attn)"),
    ("rollout.tensor_parallel_size", lambda v: v >= 1, ">= 1"),
    ("rollout.nodes_per_engine", lambda v: v >= 1, ">= 1"),
    ("rollout.max_model_len", lambda v: v >= 2, ">= 2"),
    ("rollout.kv_cache_memory_mb", lambda v: v is None or v >= 1, ">= 1 (or null)"),
    ("rollout.gpu_memory_utilization", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("rollout.temperature", lambda v: v >= 0, ">= 0"),
    ("rollout.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("rollout.top_k", lambda v: v == -1 or v >= 1, "-1 (off) or >= 1"),
    ("rollout.max_new_tokens", lambda v: v >= 1, ">= 1"),
    ("rollout.n_samples_per_prompt", lambda v: v >= 1, ">= 1"),
    ("sync.bucket_mb", lambda v: v >= 1, ">= 1"),
    ("sync.timeout_s", lambda v: v > 0, "> 0"),
    ("rollout.start_timeout_s", lambda v: v > 0, "> 0"),
    ("rollout.engine_restarts", lambda v: v >= 0, ">= 0 (0: a failed engine stops the run)"),
    ("sync.parity_threshold", lambda v: v > 0, "> 0"),
    ("sync.parity_every", lambda v: v >= 0, ">= 0"),
    ("algo.clip_low", lambda v: 0 < v < 1, "in (0, 1)"),
    ("algo.clip_high", lambda v: v > 0, "> 0"),
    ("algo.clip_ratio_c", lambda v: v is None or v > 1, "> 1 (or null to disable dual clip)"),
    ("algo.gamma", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("algo.lam", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("algo.kl_coef", lambda v: v >= 0, ">= 0"),
    ("algo.entropy_coef", lambda v: v >= 0, ">= 0"),
    ("algo.rollout_is_cap", lambda v: v is None or v >= 1,
     ">= 1 (or null: 2.0); a cap below 1 shrinks even on-policy tokens"),
    ("algo.behav_imp_weight_cap", lambda v: v is None or v > 1, "> 1 (or null: no cap)"),
    ("algo.overlong.buffer_length", lambda v: v >= 1, ">= 1"),
    ("algo.overlong.penalty_factor", lambda v: v >= 0, ">= 0"),
    ("optim.lr", lambda v: v > 0, "> 0"),
    ("optim.min_lr", lambda v: v >= 0, ">= 0"),
    ("optim.weight_decay", lambda v: v >= 0, ">= 0"),
    ("optim.betas", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    ("optim.eps", lambda v: v > 0, "> 0"),
    ("optim.total_steps", lambda v: v is None or v >= 1, ">= 1 (or null: trainer.total_steps)"),
    ("optim.clip_grad", lambda v: v > 0, "> 0"),
    ("optim.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("optim.offload_fraction", lambda v: 0 <= v <= 1, "in [0, 1] (0: no optimizer offload)"),
    ("optim.micro_batch_size", lambda v: v >= 1, ">= 1"),
    ("optim.max_tokens_per_micro_batch", lambda v: v is None or v >= 1, ">= 1 (or null)"),
    ("critic.lr", lambda v: v is None or v > 0, "> 0 (or null: optim.lr)"),
    ("critic.cliprange_value", lambda v: v > 0, "> 0"),
    ("reward.timeout_s", lambda v: v > 0, "> 0"),
    ("reward.workers", lambda v: v >= 1, ">= 1"),
    ("reward.max_failing_steps", lambda v: v >= 0, ">= 0 (0: never stop)"),
    ("data.batch_size", lambda v: v >= 1, ">= 1"),
    ("data.arithmetic.heldout_fraction", lambda v: 0 < v < 1, "in (0, 1)"),
    ("data.arithmetic.train_size", lambda v: v >= 1, ">= 1"),
    ("data.arithmetic.heldout_size", lambda v: v >= 1, ">= 1"),
    ("data.arithmetic.teacher_error", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("checkpoint.save_every", lambda v: v >= 0, ">= 0"),
    ("checkpoint.keep_last", lambda v: v >= 1, ">= 1"),
    ("launch.num_nodes", lambda v: v >= 1, ">= 1"),
    ("launch.gpus_per_node", lambda v: v >= 0, ">= 0 (0: CPU)"),
    ("launch.cpus_per_node", lambda v: v >= 1, ">= 1"),
    ("launch.rollout_gpus", lambda v: v >= 0, ">= 0"),
    ("logging.prometheus_port", lambda v: v is None or 0 <= v <= 65535, "in [0, 65535] (or null: off)"),
    ("logging.trace_every", lambda v: v >= 0, ">= 0 (0: no rollout trace)"),
    ("logging.trace_samples", lambda v: v >= 1, ">= 1"),
    ("logging.trace_chars", lambda v: v >= 16, ">= 16"),
]

# (dotted key, value, what to use instead): accepted by the schema, not built yet
_NOT_BUILT: list[tuple[str, Any, str]] = [
    ("sync.transport", "object_store", "use 'colocated', 'broadcast' or 'routed'"),
]




def _get(cfg: RunConfig, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def out_of_range(cfg: RunConfig) -> list[str]:
    """A message for every setting outside its range, or set to a value not built yet."""
    errors = []
    for key, ok, requirement in _RANGES:
        value = _get(cfg, key)
        if not ok(value):
            errors.append(f"{key} must be {requirement}, got {value!r}.")
    for key, value, instead in _NOT_BUILT:
        if _get(cfg, key) == value:
            errors.append(f"{key} {value!r} is not built yet: {instead}.")
    return errors
