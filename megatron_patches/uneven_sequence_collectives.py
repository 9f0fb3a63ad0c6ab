"""Uneven all-gather and reduce-scatter over gloo, for MoE with expert-tensor parallelism.

Upstream (megatron-core 0.16.1, `tensor_parallel/mappings.py`): with MoE + TP (ETP > 1) the alltoall
dispatcher (EP > 1 with expert TP > 1, e.g. EP2×TP2) gathers tokens over the expert-TP group with
per-rank sizes (`_gather_along_first_dim(..., output_split_sizes)`) and reduce-scatters them back
(`_reduce_scatter_along_first_dim(..., input_split_sizes)`). Those call the list forms of
`all_gather` / `reduce_scatter` with unequal tensors, which gloo rejects ("invalid tensor size")
or does not implement; NCCL accepts them.

Patch: when split sizes are given, gather by padding every rank's rows to the largest size and
slicing after an equal all-gather; reduce-scatter by all-reducing the whole tensor and keeping
this rank's rows. Both return exactly what the NCCL path returns. Equal splits keep upstream's path.

Drop when: gloo supports uneven all_gather/reduce_scatter (not in torch 2.13).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CPU_ONLY = True


def _gather_uneven(input_: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    longest = max(sizes)
    padded = input_.new_zeros((longest, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded.contiguous(), group=group)
    return torch.cat([part[:n] for part, n in zip(gathered, sizes)])


def _reduce_scatter_uneven(input_: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    total = input_.contiguous().clone()
    dist.all_reduce(total, group=group)
    start = sum(sizes[: group.rank()])
    return total[start : start + sizes[group.rank()]].clone()


def apply() -> None:
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim
    if getattr(gather, "_mrl_patched", False):
        return

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        return _gather_uneven(input_, group, [int(s) for s in output_split_sizes])

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        return _reduce_scatter_uneven(input_, group, [int(s) for s in input_split_sizes])

    _gather_along_first_dim._mrl_patched = True
    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim
