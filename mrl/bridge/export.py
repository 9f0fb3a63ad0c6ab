"""This rank's Megatron shards → a stream of (hf_name, full tensor) on one destination rank.

Every rank runs the same generator. A plan (which global tensor lives on which ranks, in which
order) is gathered once; then, bucket by bucket, the owning ranks send their shards straight to
the destination, which reassembles HF tensors with the mapping table's segments and yields them.
Data-parallel replicas stay idle: only data-parallel rank 0 (expert-data-parallel rank 0 for
experts) sends, its shards of a bucket packed into messages of up to MESSAGE_BYTES. Peak extra
memory on the destination is one bucket (never less than the largest tensor) plus the largest
tensor plus one message per source, provided the consumer drops each bucket before asking for the
next; on a sender, one message.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from mrl.bridge.local_tensors import LocalTensor, local_tensors
from mrl.bridge.mapping import Segment, Split, SplitDims, hf_shapes, segments
from mrl.config.schema import DEFAULT_BUCKET_MB
from mrl.megatron.model import BuiltModel
from mrl.megatron.parallel import RankCoords

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


_ALIGN = 64  # every shard starts at a multiple of this in a message: its bytes view as any dtype
# A source's shards of a bucket travel in messages of about this size (a larger shard alone): the
# destination frees a message once every shard in it is assembled, so the data it holds beyond the
# bucket is one message per source, not that source's whole share.
MESSAGE_BYTES = 4 << 20


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
    _layout: tuple | None = field(default=None, repr=False, compare=False)

    def layout(self, dims: SplitDims) -> tuple[dict[str, tuple[int, ...]], dict[int, list[Segment]]]:
        """The HF tensors' shapes and each shard's segments: computed at the first sync and kept,
        since every sync exports the same plan (pure Python per tensor: the demo has 129)."""
        if self._layout is None:
            shapes = hf_shapes(self.split, self.hf_names, self.global_shape, self.shards, dims)
            self._layout = shapes, {shard: segments(self.split, self.hf_names, self.global_shape, shard,
                                                    self.shards, dims) for _, shard in self.sources}
        return self._layout

    @property
    def nbytes(self) -> int:
        return math.prod(self.global_shape) * self.dtype.itemsize

    @property
    def shard_bytes(self) -> int:
        return math.prod(self.local_shape) * self.dtype.itemsize


def _owns(t: LocalTensor, coords: RankCoords) -> bool:
    """Whether this rank is the one data-parallel replica that sends `t` (CP ranks hold replicas too)."""
    return t.rule.export and (coords.edp == 0 if t.rule.expert else coords.dp == 0 and coords.cp == 0)


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


def bucket_items(plan: list[PlanItem], bucket_bytes: int) -> Iterator[list[PlanItem]]:
    """The plan cut into buckets of at most `bucket_bytes` (a larger tensor alone), in plan order."""
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
    plan: list[PlanItem] | None = None,
    message_bytes: int = MESSAGE_BYTES,
    into: Callable[[int], dict[str, torch.Tensor]] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield buckets of (hf_name, tensor) on rank `dst`; drive the sends on every other rank.

    With `group` (e.g. one pipeline stage's ranks), only that group's tensors are exported, to `dst`
    (a global rank inside the group); every rank of the group must call this. `plan` is
    `build_plan`'s result for the same ranks, when the caller keeps it (it never changes for a
    model; building it is a collective): otherwise it is built here. `message_bytes`: the most a
    source rank sends in one message (a larger shard goes alone). `into(index)`: where `dst`
    assembles bucket `index`'s HF tensors (tensors by HF name, e.g. views of a wire buffer:
    mrl.sync.shared_export.GatheredExport), instead of fresh ones.
    Vocab padding is stripped, tied copies are skipped, experts come one expert at a time.
    """
    tensors = local_tensors(built, coords)
    by_name = {t.name: t for t in tensors}
    device = built.device  # messages and HF tensors live beside the weights (NCCL sends GPU memory)
    dims = SplitDims.of(built.spec)
    timeout = timedelta(seconds=timeout_s)
    plan = build_plan(tensors, coords, group) if plan is None else plan
    for index, bucket in enumerate(bucket_items(plan, bucket_bytes)):
        # A source rank's shards travel packed, in few messages: a model of many small tensors (MoE
        # experts, the tiny demo's 180 shards) spent most of its export on per-message latency.
        shards: dict[int, list[tuple[PlanItem, int]]] = {}
        for item in bucket:
            for source, shard in item.sources:
                shards.setdefault(source, []).append((item, shard))
        if coords.rank == dst:
            received = _receive(shards, by_name, dst, group, timeout, index, message_bytes, device)
            out = into(index) if into is not None else None
            yield [pair for item in bucket for pair in _assemble(item, received, dims, device, out)]
        elif coords.rank in shards:
            _send(shards[coords.rank], by_name, coords.rank, dst, group, timeout, index, message_bytes, device)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _messages(entries: list[tuple[PlanItem, int]], cap: int) -> Iterator[tuple[list, list[int], int]]:
    """One source's shards of a bucket, in plan order, cut into messages of at most `cap` bytes:
    each message's shards, where each starts in it, and its length in bytes."""
    chunk: list[tuple[PlanItem, int]] = []
    offsets: list[int] = []
    size = 0
    for entry in entries:
        nbytes = _aligned(entry[0].shard_bytes)
        if chunk and size + nbytes > cap:
            yield chunk, offsets, size
            chunk, offsets, size = [], [], 0
        chunk.append(entry)
        offsets.append(size)
        size += nbytes
    if chunk:
        yield chunk, offsets, size


def _send(entries: list[tuple[PlanItem, int]], by_name: dict[str, LocalTensor], rank: int, dst: int, group: Any,
          timeout: timedelta, index: int, cap: int, device: torch.device) -> None:
    """Copy this rank's shards of the bucket into messages and send them to `dst`, one at a time."""
    for chunk, offsets, size in _messages(entries, cap):
        message = torch.empty(size, dtype=torch.uint8, device=device)
        for (item, _), offset in zip(chunk, offsets):
            shard = by_name[item.name].tensor.detach().contiguous().view(-1).view(torch.uint8)
            if shard.numel() != item.shard_bytes:  # the destination would read the message wrongly
                raise ValueError(f"rank {rank}: shard of {item.name!r} has {shard.numel()} bytes, the plan says "
                                 f"{item.shard_bytes} (shape {tuple(item.local_shape)}, {item.dtype})")
            message[offset : offset + shard.numel()].copy_(shard)
        _wait(dist.isend(message, dst, group=group), rank, dst, chunk, timeout, index, "sending")


def _receive(shards: dict[int, list[tuple[PlanItem, int]]], by_name: dict[str, LocalTensor], dst: int, group: Any,
             timeout: timedelta, index: int, cap: int, device: torch.device) -> dict[tuple[str, int], torch.Tensor]:
    """Every shard of the bucket on `dst`: its own in place, the others as views of their messages."""
    received: dict[tuple[str, int], torch.Tensor] = {}
    waits = []
    for source, entries in shards.items():
        if source == dst:
            received.update(((item.name, shard), by_name[item.name].tensor.detach()) for item, shard in entries)
            continue
        for chunk, offsets, size in _messages(entries, cap):
            message = torch.empty(size, dtype=torch.uint8, device=device)
            waits.append((dist.irecv(message, src=source, group=group), source, chunk))
            for (item, shard), offset in zip(chunk, offsets):
                view = message[offset : offset + item.shard_bytes].view(item.dtype)
                received[item.name, shard] = view.view(item.local_shape)
    for work, source, chunk in waits:
        _wait(work, dst, source, chunk, timeout, index, "receiving")
    return received


def _wait(work: Any, rank: int, peer: int, entries: list[tuple[PlanItem, int]], timeout: timedelta, index: int,
          doing: str) -> None:
    try:
        work.wait(timeout)
    except RuntimeError as err:
        names = [item.name for item, _ in entries]
        raise ExportTimeout(
            f"rank {rank}: export bucket {index} timed out after {timeout.total_seconds():.0f}s {doing} "
            f"{len(names)} shard(s) ({names[0]!r} first) {'to' if doing == 'sending' else 'from'} rank {peer}: {err}"
        ) from err


def _assemble(
    item: PlanItem, received: dict[tuple[str, int], torch.Tensor], dims: SplitDims, device: torch.device,
    into: dict[str, torch.Tensor] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Write each shard's segments into the HF tensors (`into`'s, else fresh ones), freeing shards
    as they are consumed."""
    shapes = item.layout(dims)[0]
    out = ({name: into[name] for name in shapes} if into is not None
           else {name: torch.empty(shape, dtype=item.dtype, device=device) for name, shape in shapes.items()})
    for _, shard in item.sources:
        write_shard(item, shard, received.pop((item.name, shard)), out, dims)
    return list(out.items())


def write_shard(item: PlanItem, shard: int, data: torch.Tensor, out: dict[str, torch.Tensor], dims: SplitDims,
                rank: int | None = None) -> None:
    """Write shard `shard` of `item` (`data`: that shard, as its rank holds it) into the HF tensors
    `out` at the shard's segments (cast to their dtype). With `rank`, `data` is that rank's own
    tensor, whose size is checked against the plan first."""
    if rank is not None and data.numel() * data.element_size() != item.shard_bytes:
        raise ValueError(f"rank {rank}: shard of {item.name!r} has {data.numel() * data.element_size()} bytes, the "
                         f"plan says {item.shard_bytes} (shape {tuple(item.local_shape)}, {item.dtype})")
    offset = 0
    for seg in item.layout(dims)[1][shard]:
        if seg.hf is not None:
            target = out[seg.hf][seg.start : seg.stop]
            if seg.cols is not None:
                target = target[:, seg.cols[0] : seg.cols[1]]
            target.copy_(data[offset : offset + seg.rows])
        offset += seg.rows


def iter_hf_weights(built: BuiltModel, coords: RankCoords, **kwargs) -> Iterator[tuple[str, torch.Tensor]]:
    """export_hf_weights flattened to single (hf_name, tensor) pairs."""
    for bucket in export_hf_weights(built, coords, **kwargs):
        yield from bucket
