"""Megatron process groups for a ParallelLayout, and where this rank sits in them."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from mrl.layout import ParallelLayout


@dataclass(frozen=True)
class RankCoords:
    """This rank's coordinates in the dense and the expert grids."""

    rank: int
    tp: int
    pp: int
    dp: int  # among the data-parallel replicas (Megatron's DP group, without CP)
    ep: int
    etp: int
    edp: int
    cp: int = 0


# Third-party warnings that fire on every rank and carry no information for an mrl user; mrl
# reports the Transformer Engine fallback itself (mrl.megatron.model.resolve_transformer_impl).
_KNOWN_NOISE = (
    (UserWarning, r"(Transformer Engine|Apex) (and Apex )?(is|are) not installed"),
    (UserWarning, r"full scope is deprecated"),
    (UserWarning, r"When using sequence parallelism it is recommended to set"),
    (FutureWarning, r"`torch.distributed.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"),
)


def quiet_known_warnings() -> None:
    for category, message in _KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)


def initialize_layout(layout: ParallelLayout, seed: int = 1234) -> RankCoords:
    """Create Megatron's process groups for `layout` on the already-initialised default group."""
    quiet_known_warnings()
    import megatron_patches

    megatron_patches.apply()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    layout.check_world_size(dist.get_world_size())
    ps.initialize_model_parallel(**layout.megatron_sizes())
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return rank_coords()


def rank_coords() -> RankCoords:
    from megatron.core import parallel_state as ps

    return RankCoords(
        rank=dist.get_rank(),
        tp=ps.get_tensor_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_rank(),
        dp=ps.get_data_parallel_rank(),
        ep=ps.get_expert_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_rank(),
        edp=ps.get_expert_data_parallel_rank(),
        cp=ps.get_context_parallel_rank(),
    )


def destroy_layout() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def from_last_stage(value: Any) -> Any:
    """The last pipeline stage's `value` on every rank of this rank's pipeline group (a pickled
    broadcast: for metrics and small results that exist only there). A no-op without PP."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
    return box[0]


def data_parallel_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size()


def is_reporter() -> bool:
    """Whether this rank reports its data-parallel slice's results: the last pipeline stage's TP
    rank 0 and CP rank 0 (CP ranks gather per-token results, so they hold the same)."""
    from megatron.core import parallel_state as ps

    return (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0)
