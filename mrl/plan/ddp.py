"""Megatron's DDP buffers and distributed-optimizer shards for one rank's parameters.

The rules of megatron-core 0.16.1, as mrl configures it (mrl.megatron.training.make_trainable:
`grad_reduce_in_fp32=True`, no overlap, so no bucket size limit), each beside the function that
applies it: DistributedDataParallel's buffers (`buffers`), _ParamAndGradBuffer's layout with its
padding (`_layout`) and the distributed optimizer's shards (`Buffer.owned`). Without the
distributed optimizer there is no padding and every rank keeps the optimizer state of every
parameter. The rules and the tests that hold them equal to Megatron's own buffers: docs/plan.md.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass

from mrl.layout import ParallelLayout
from mrl.plan.params import ParamTensor, chunk_params
from mrl.plan.shapes import ModelShape, stage_chunks

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
PARAM_START_ALIGN = 64  # elements: 128-byte aligned starts for >= 16-bit parameters
BUCKET_ALIGN = 128  # elements: 256-byte aligned bucket ends
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32 each


@dataclass(frozen=True)
class Buffer:
    """One _ParamAndGradBuffer: its parameters' ranges, its buckets and its data-parallel size."""

    param_dtype: str
    grad_dtype: str
    expert: bool
    dp: int
    ranges: tuple[tuple[int, int], ...]  # per parameter, in buffer order
    buckets: tuple[tuple[int, int], ...]
    distributed: bool

    @property
    def numel(self) -> int:
        """Elements of the grad (and, distributed, the param) buffer, padding included."""
        return self.buckets[-1][1] if self.buckets else 0

    @property
    def param_numel(self) -> int:
        return sum(end - start for start, end in self.ranges)

    def owned(self, dp_rank: int) -> int:
        """Parameter elements whose optimizer state DP rank `dp_rank` keeps.

        DistributedOptimizer._build_model_gbuf_range (optimizer/distrib_optimizer.py) gives DP rank r
        the r-th equal slice of every bucket; it keeps an fp32 main copy of the bf16/fp16 elements of
        its slice (fp32 parameters are their own main copy) and Adam keeps exp_avg and exp_avg_sq
        (fp32) of them. Without it every rank keeps all of that for every parameter (Float16Optimizer).
        """
        if not self.distributed:
            return self.param_numel
        owned = 0
        for start, end in self.buckets:
            shard = (end - start) // self.dp
            owned += self._covered(start + dp_rank * shard, start + (dp_rank + 1) * shard)
        return owned

    @functools.cached_property
    def _index(self) -> tuple[list[int], list[int], list[int]]:
        starts, ends = [s for s, _ in self.ranges], [e for _, e in self.ranges]
        return starts, ends, [0, *itertools.accumulate(e - s for s, e in self.ranges)]

    def _covered(self, lo: int, hi: int) -> int:
        """Parameter elements in [lo, hi): the ranges are sorted and disjoint, so two bisections
        and a prefix sum (a 671B layout with EP1 has 30,000 tensors per buffer)."""
        starts, ends, prefix = self._index
        first = bisect.bisect_right(ends, lo)  # first range ending after lo
        last = bisect.bisect_left(starts, hi)  # ranges [first, last) start before hi
        if first >= last:
            return 0
        inside = prefix[last] - prefix[first]
        return inside - max(0, lo - starts[first]) - max(0, ends[last - 1] - hi)

    def max_owned(self) -> int:
        """The most any DP rank keeps (padding falls to the last ranks, so usually rank 0)."""
        return max(self.owned(r) for r in range(self.dp)) if self.distributed else self.param_numel


def buffers(params: list[ParamTensor], dp: int, expert_dp: int, distributed: bool,
            grad_dtype: str = "fp32") -> list[Buffer]:
    """The buffers DDP makes for one model chunk: dense ones first, then expert ones, each grouped
    by (param dtype, grad dtype) in the order the dtypes first appear.

    DistributedDataParallel (distributed/distributed_data_parallel.py) puts the parameters into one
    buffer per (param dtype, grad dtype), separately for "dense" parameters (reduced over the
    data×context-parallel group) and for expert parameters (`allreduce=False`, reduced over the
    expert-data-parallel group)."""
    result = []
    for expert, group_dp in ((False, dp), (True, expert_dp)):
        groups: dict[str, list[ParamTensor]] = {}
        for p in params:
            if p.expert == expert:
                groups.setdefault(p.dtype, []).append(p)
        result += [_layout(group, dtype, grad_dtype, expert, group_dp, distributed) for dtype, group in groups.items()]
    return result


def _layout(params: list[ParamTensor], dtype: str, grad_dtype: str, expert: bool, dp: int,
            distributed: bool) -> Buffer:
    """_ParamAndGradBuffer.__init__'s index arithmetic (bucket_size None: one bucket, except that
    a shared embedding is a bucket of its own under the distributed optimizer).

    _ParamAndGradBuffer (distributed/param_and_grad_buffer.py) lays the parameters out in reverse
    order. With the distributed optimizer each parameter starts at a multiple of 64 elements, each
    bucket ends at a multiple of lcm(DP, 128), a shared (tied) embedding gets a bucket of its own,
    and the bf16 parameters themselves move into a param buffer of the padded size. Without it there
    is no padding and the parameters stay where they are."""
    bucket_divisor = math.lcm(dp, BUCKET_ALIGN)

    def pad(index: int, divisor: int) -> int:
        return -(-index // divisor) * divisor if distributed else index

    ranges, buckets = [], []
    start = bucket_start = 0
    open_bucket = False
    for p in reversed(params):
        start = pad(start, PARAM_START_ALIGN)
        own_bucket = p.shared_embedding and distributed
        if own_bucket and open_bucket:
            start = pad(start, bucket_divisor)
            buckets.append((bucket_start, start))
            bucket_start = start
        end = start + p.numel
        ranges.append((start, end))
        open_bucket = True
        if own_bucket:
            end = pad(end, bucket_divisor)
            buckets.append((bucket_start, end))
            bucket_start, open_bucket = end, False
        start = end
    if open_bucket:
        buckets.append((bucket_start, pad(start, bucket_divisor)))
    return Buffer(dtype, grad_dtype, expert, dp, tuple(ranges), tuple(buckets), distributed)


@dataclass(frozen=True)
class StaticBytes:
    """One rank's model state in bytes: parameters, gradient buffers, optimizer state on the GPU;
    `host`: the offloaded optimizer part in host memory (optim.offload_fraction)."""

    weights: int
    grads: int
    optimizer: int
    host: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer

    def __add__(self, other: "StaticBytes") -> "StaticBytes":
        return StaticBytes(self.weights + other.weights, self.grads + other.grads, self.optimizer + other.optimizer,
                           self.host + other.host)


def static_bytes(bufs: list[Buffer], dp_rank: int | None = None, expert_dp_rank: int | None = None,
                 optimizer_on_gpu: float = 1.0) -> StaticBytes:
    """Bytes of `bufs` on a rank at the given DP·CP / expert-DP coordinates (None: the rank that keeps
    the most). `optimizer_on_gpu` is the fraction of the optimizer state (main copy and Adam
    moments) kept on the GPU, 1 - optim.offload_fraction: megatron-core's HybridDeviceOptimizer
    offloads that share of the elements, each with an fp32 copy, Adam's two moments and a pinned
    fp32 gradient copy in host memory (HOST_BYTES_PER_OFFLOADED)."""
    weights = grads = optimizer = owned_total = 0
    for b in bufs:
        weights += (b.numel if b.distributed else b.param_numel) * DTYPE_BYTES[b.param_dtype]
        grads += b.numel * DTYPE_BYTES[b.grad_dtype]
        rank = expert_dp_rank if b.expert else dp_rank
        owned = b.max_owned() if rank is None else b.owned(rank)
        optimizer += owned * optimizer_bytes_per_element(b.param_dtype)
        owned_total += owned
    host = round(owned_total * (1 - optimizer_on_gpu)) * HOST_BYTES_PER_OFFLOADED
    return StaticBytes(weights, grads, round(optimizer * optimizer_on_gpu), host)


# An offloaded element in host memory (hybrid_optimizer.py): its fp32 copy (the master weight),
# exp_avg and exp_avg_sq, and the fp32 buffer the gradient is copied into before the CPU step.
HOST_BYTES_PER_OFFLOADED = 4 + ADAM_STATE_BYTES + 4


def optimizer_bytes_per_element(param_dtype: str) -> int:
    """fp32 main copy of a 16-bit parameter (fp32 parameters are their own) + Adam's two moments."""
    return (4 if DTYPE_BYTES[param_dtype] < 4 else 0) + ADAM_STATE_BYTES


def dense_group(layout: ParallelLayout, world: int) -> int:
    """The group dense gradients are reduced over and the distributed optimizer shards them over:
    DP·CP (Megatron's get_data_parallel_group(with_context_parallel=True)), since every CP rank
    holds the same dense weights and computes a share of their gradient. The batch splits over DP
    alone (world / TP·CP·PP)."""
    return world // (layout.tp * layout.pp)


def rank_static(shape: ModelShape, layout: ParallelLayout, world: int, stage: int, dtype: str, distributed: bool,
                dp_rank: int | None = None, expert_dp_rank: int | None = None, value_head: bool = False,
                optimizer_on_gpu: float = 1.0) -> StaticBytes:
    """Weights, gradient buffers and optimizer state of a rank of pipeline stage `stage` at the
    given coordinates in the dense (DP·CP, `dense_group`) and expert-DP sharding groups (None: the
    rank that keeps the most)."""
    dp, expert_dp = dense_group(layout, world), world // (layout.expert_tp * layout.ep * layout.pp)
    bufs = []
    for chunk in stage_chunks(shape.layers, layout, stage):
        bufs += buffers(chunk_params(shape, layout, chunk, dtype, value_head), dp, expert_dp, distributed)
    return static_bytes(bufs, dp_rank, expert_dp_rank, optimizer_on_gpu)
