"""This rank's Megatron shards → a stream of (hf_name, full tensor) on one destination rank.

Every rank runs the same generator. A plan (which global tensor lives on which ranks, in which
order) is gathered once; then, bucket by bucket, the owning ranks send their shards straight to
the destination, which reassembles HF tensors with the mapping table's segments and yields them.
Data-parallel replicas stay idle: only data-parallel rank 0 (expert-data-parallel rank 0 for
experts) sends. Peak extra memory on the destination is one bucket (never less than the largest
tensor) plus the largest tensor, provided the consumer drops each bucket before asking for the
next; senders send their parameters in place and allocate nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from mrl.bridge.local_tensors import LocalTensor, local_tensors
from mrl.bridge.mapping import Split, SplitDims, hf_shapes, segments
from mrl.config.schema import DEFAULT_BUCKET_MB
from mrl.megatron.model import BuiltModel
from mrl.megatron.parallel import RankCoords

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


class ExportTimeout(RuntimeError):
    """A shard did not arrive in time; the message names the tensor, its source rank and bucket."""


@dataclass
class PlanItem:
    """One global Megatron tensor: its mapping and the (rank, shard index) pairs that hold it."""

    name: str
    split: Split
    hf_names: tuple[str, ...]
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    shards: int
    sources: list[tuple[int, int]]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.global_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def _owns(t: LocalTensor, coords: RankCoords) -> bool:
    """Whether this rank is the one data-parallel replica that sends `t`."""
    return t.rule.export and (coords.edp == 0 if t.rule.expert else coords.dp == 0)


def _order(name: str) -> tuple[int, str]:
    """Embedding first, then layers in order, then the final norm and the output layer."""
    if m := _LAYER.match(name):
        return (int(m.group(1)), "")
    return (-1, "") if name.startswith("embedding.") else (1 << 30, name)


def build_plan(tensors: list[LocalTensor], coords: RankCoords, group: Any = None) -> list[PlanItem]:
    """Gather every rank's owned tensors into one ordered plan (identical on all ranks of `group`)."""
    mine = coords.rank, [
        (t.name, t.split, t.hf_names, t.global_shape, tuple(t.tensor.shape), t.tensor.dtype, t.shard, t.shards)
        for t in tensors
        if _owns(t, coords)
    ]
    gathered: list[tuple] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(gathered, mine, group=group)
    items: dict[str, PlanItem] = {}
    for rank, entries in gathered:
        for name, split, hf_names, gshape, lshape, dtype, shard, shards in entries:
            item = items.setdefault(name, PlanItem(name, split, hf_names, gshape, lshape, dtype, shards, []))
            if shard not in {s for _, s in item.sources}:
                item.sources.append((rank, shard))
    # Stable sort keeps model order within a layer.
    return sorted(items.values(), key=lambda item: _order(item.name))


def _buckets(plan: list[PlanItem], bucket_bytes: int) -> Iterator[list[PlanItem]]:
    bucket, size = [], 0
    for item in plan:
        if bucket and size + item.nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += item.nbytes
    if bucket:
        yield bucket


def export_hf_weights(
    built: BuiltModel,
    coords: RankCoords,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_MB << 20,
    dst: int = 0,
    group: Any = None,
    timeout_s: float = 300.0,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield buckets of (hf_name, tensor) on rank `dst`; drive the sends on every other rank.

    With `group` (e.g. one pipeline stage's ranks), only that group's tensors are exported, to `dst`
    (a global rank inside the group); every rank of the group must call this.
    Vocab padding is stripped, tied copies are skipped, experts come one expert at a time.
    """
    tensors = local_tensors(built, coords)
    by_name = {t.name: t for t in tensors}
    dims = SplitDims.of(built.spec)
    timeout = timedelta(seconds=timeout_s)
    rank = coords.rank
    for index, bucket in enumerate(_buckets(build_plan(tensors, coords, group), bucket_bytes)):
        received: dict[tuple[str, int], torch.Tensor] = {}
        waits = []
        for item in bucket:
            for source, shard in item.sources:
                if source == rank == dst:
                    received[item.name, shard] = by_name[item.name].tensor.detach()
                elif rank == dst:
                    buffer = torch.empty(item.local_shape, dtype=item.dtype)
                    received[item.name, shard] = buffer
                    waits.append((dist.irecv(buffer, src=source, group=group), item.name, source))
                elif source == rank:
                    waits.append((dist.isend(by_name[item.name].tensor.detach().contiguous(), dst, group=group), item.name, dst))
        for work, name, peer in waits:
            try:
                work.wait(timeout)
            except RuntimeError as err:
                raise ExportTimeout(
                    f"rank {rank}: export bucket {index} timed out after {timeout_s:.0f}s exchanging "
                    f"{name!r} with rank {peer}: {err}"
                ) from err
        waits.clear()  # finished works still reference their buffers: let the shards go
        if rank == dst:
            yield [pair for item in bucket for pair in _assemble(item, received, dims)]


def _assemble(
    item: PlanItem, received: dict[tuple[str, int], torch.Tensor], dims: SplitDims
) -> list[tuple[str, torch.Tensor]]:
    """Write each shard's segments into fresh HF tensors, freeing shards as they are consumed."""
    out = {
        name: torch.empty(shape, dtype=item.dtype)
        for name, shape in hf_shapes(item.split, item.hf_names, item.global_shape, item.shards, dims).items()
    }
    for _, shard in item.sources:
        data = received.pop((item.name, shard))
        offset = 0
        for seg in segments(item.split, item.hf_names, item.global_shape, shard, item.shards, dims):
            if seg.hf is not None:
                rows = data[offset : offset + seg.rows]
                target = out[seg.hf][seg.start : seg.stop]
                if seg.cols is not None:
                    target = target[:, seg.cols[0] : seg.cols[1]]
                target.copy_(rows)
            offset += seg.rows
    return list(out.items())


def iter_hf_weights(built: BuiltModel, coords: RankCoords, **kwargs) -> Iterator[tuple[str, torch.Tensor]]:
    """export_hf_weights flattened to single (hf_name, tensor) pairs."""
    for bucket in export_hf_weights(built, coords, **kwargs):
        yield from bucket
