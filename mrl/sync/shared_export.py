"""Exports straight into a bucket's wire layout, in memory reused push after push.

SharedExport (colocated, without a gather): every trainer rank writes its own shards straight
into the shared-memory bucket the engines map; the leader only checksums the bucket and announces
it. GatheredExport (broadcast, a CPU leader): the gather's leader assembles each bucket's HF
tensors straight into a reused wire buffer, which goes on the channel as it is.

The one idea: where each HF tensor lies in a bucket follows from the plan alone, so each rank
computes that layout and writes its part in place, into memory kept mapped from push to push
(SLOTS: the two files or buffers, and why they are kept). mrl.sync.sender.WeightSender chooses
the export; docs/sync.md ("The transports") tells when each is used.
"""

from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from mrl.bridge.export import PlanItem, bucket_items, write_shard
from mrl.bridge.local_tensors import local_tensors
from mrl.bridge.mapping import SplitDims
from mrl.sync.channel import unlink_quietly
from mrl.sync.wire import Packed, SyncError, bucket_checksums, dtype_named, layout, map_file, unpack, wire_dtype

# The two files (bucket k in slot k % 2) are kept from one push to the next: writing into memory that
# is already mapped costs no file to make and no page to fault in (measured: 256 MB into a fresh
# /dev/shm file 0.10 s, into mapped memory 0.017 s). Each file's name goes once the engines have
# loaded its first bucket, as before; every process keeps its mapping instead (the ranks here, the
# engines in mrl.sync.wire.shared_bytes), so a killed trainer leaves no file behind, and the memory
# goes with the last process that maps it. The files are a *generation*, named by a random id that
# the leader announces in each bucket's first barrier; after a push that failed it starts a new one,
# and each process maps the new files and lets the old go.
SLOTS = 2  # files per generation, each reused by every other bucket: at most two buckets alive


def bucket_layout(bucket: list[PlanItem], dims: SplitDims, engine_dtype: torch.dtype) -> tuple[list[dict], int]:
    """Where each HF tensor of the bucket lies in it, as `pack` would lay the assembled tensors out
    (mrl.sync.wire.layout), and the bucket's size in bytes."""
    return layout((name, shape, wire_dtype(name, engine_dtype, item.dtype))
                  for item in bucket for name, shape in item.layout(dims)[0].items())


def _slotted_layouts(plan: list[PlanItem], bucket_bytes: int, dims: SplitDims,
                     engine_dtype: torch.dtype) -> tuple[list[tuple[list[PlanItem], list[dict], int]], list[int]]:
    """Each bucket's items, layout and size, and each slot's size (the largest of its buckets:
    bucket k goes in slot k % SLOTS)."""
    buckets = [(bucket, *bucket_layout(bucket, dims, engine_dtype)) for bucket in bucket_items(plan, bucket_bytes)]
    sizes = [size for _, _, size in buckets]
    return buckets, [max(sizes[slot::SLOTS], default=0) for slot in range(SLOTS)]


class SharedExport:
    """One rank's side of every push of one sender: what never changes between pushes (this rank's
    tensors by name, each bucket's items and layout: the plan is fixed) is worked out once, at the
    first push (measured on the demo's four ranks sharing two cores: 7–10 ms a push, each rank).
    The tensors are the model's parameter objects: an update or offload that swaps their storage
    (`param.data = ...`) is seen; one that replaces a parameter object is not (neither is the
    sender's plan, gathered once).

    The gather path (mrl.bridge.export) sends every shard to the leader, which assembles the HF
    tensors (a GPU leader then packs them into the bucket: two copies of every byte, one after the
    other), a message per source. Here every rank computes the bucket's layout, maps the leader's
    file and writes its segments into it, all ranks at once. Used when every rank sees the
    leader's /dev/shm and the engine takes the bytes as they are (a CPU engine, no FP8):
    mrl.sync.sender.WeightSender decides."""

    def __init__(self, built: Any, coords: Any, plan: list[PlanItem], bucket_bytes: int, engine_dtype: str):
        self.rank, self.device = coords.rank, built.device
        self.tensors = {t.name: t.tensor for t in local_tensors(built, coords)}
        self.dims = SplitDims.of(built.spec)
        dtype = dtype_named(engine_dtype)
        self.buckets, self.slot_bytes = _slotted_layouts(plan, bucket_bytes, self.dims, dtype)
        self.generation = 0  # the files' id (0: none yet): the leader's choice, which the others hear
        self.mapped: dict[str, torch.Tensor] = {}  # this process's mapping of each file of the generation

    def drop(self) -> None:
        """The leader, after a push that failed: the next push makes new files. Their names go now
        (the engines may not have loaded, and so mapped, them)."""
        for path in self.mapped:
            unlink_quietly(path)
        self.generation, self.mapped = 0, {}

    def export(self, *, path: Any, leader: int, group: Any, timeout_s: float, leader_wait_s: float) -> Iterator[Packed]:
        """Every rank: write this rank's shards of each bucket into its slot's file, `path(generation,
        slot)`. On the leader, yield each bucket once every rank has written it; elsewhere yield
        nothing. `leader_wait_s`: how long the ranks wait for the leader to make a file (it may first
        open its channel and wait for the engines to load the bucket before last)."""
        lead, who = self.rank == leader, f"rank {self.rank}"
        # Per bucket, two barriers of the export group: "the leader made the file" and "every rank
        # wrote its shards". The leader asks for bucket k + 1 only once at most one other bucket is
        # alive (its pipeline's slots), and after a failed sync drops each bucket's file as it
        # comes, so at most two files exist at a time, as on the gather path.
        made, written = (_Barrier(group, self.device, wait_s, who) for wait_s in (leader_wait_s, timeout_s))
        if lead and not self.generation:
            self.generation = secrets.randbits(62) + 1
        for index, (bucket, entries, size) in enumerate(self.buckets):
            slot = index % SLOTS
            if lead:
                self._mapping(path(self.generation, slot), slot, who, create=True)
            generation = made.wait(f"the leader (rank {leader}) to make bucket {index}'s file", index,
                                   self.generation * lead)
            if generation != self.generation:  # the leader started new files: the old ones go
                self.generation, self.mapped = generation, {}
            file = path(generation, slot)
            flat = self._mapping(file, slot, who)[:size]
            views = dict(unpack({"tensors": entries}, flat))
            for item in bucket:
                for rank, shard in item.sources:
                    if rank == self.rank:
                        write_shard(item, shard, self.tensors[item.name].detach(), views, self.dims, self.rank)
            written.wait(f"every rank to write its shards of bucket {index}", index)
            if lead:  # checksums of the bytes that travel
                sums = bucket_checksums(entries, flat)
                yield Packed({"tensors": [{**entry, "checksum": c} for entry, c in zip(entries, sums)], "nbytes": size,
                              "shm": file, "shm_bytes": self.slot_bytes[slot], "shm_generation": f"{generation:x}"},
                             flat)
            del views, flat

    def _mapping(self, path: str, slot: int, who: str, create: bool = False) -> torch.Tensor:
        """This process's mapping of a slot's file, made (by the leader, `create`) or mapped at its
        first use in a generation."""
        flat = self.mapped.get(path)
        if flat is None:
            size = max(self.slot_bytes[slot], 1)
            flat = (torch.from_file(path, shared=True, size=size, dtype=torch.uint8) if create
                    else map_file(path, size, who, writable=True))
            self.mapped[path] = flat
        return flat


class _Barrier:
    """A barrier of the export group (an all-reduce) that waits at most timeout_s, checks that
    every rank is at the same bucket and passes the leader's word (the generation) to the others.

    A leader that gave up on a push without running its export to the end (a failed send) leaves
    the other ranks waiting at a later bucket's barrier; its next push must not pair with them
    (they would write one bucket's shards into another's file): such a barrier fails instead."""

    def __init__(self, group: Any, device: torch.device, timeout_s: float, who: str):
        self.group, self.who, self.timeout_s = group, who, timeout_s
        self.world = dist.get_world_size(group)
        self.token = torch.zeros(3, dtype=torch.int64, device=device)  # 64 bits: the generation's id

    def wait(self, what: str, index: int, word: int = 0) -> int:
        """Wait for every rank at bucket `index`; the sum of their `word`s (the leader's, the
        others giving 0)."""
        self.token.copy_(torch.tensor([index + 1, (index + 1) ** 2, word]))
        try:
            dist.all_reduce(self.token, group=self.group, async_op=True).wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            raise SyncError(f"{self.who}: waiting for {what} failed or timed out after {self.timeout_s:.0f}s: "
                            f"{err}") from err
        total, squares, word = self.token.tolist()
        if total != self.world * (index + 1) or squares != self.world * (index + 1) ** 2:
            raise SyncError(f"{self.who}: waiting for {what}, the ranks of the export were at different buckets "
                            "(a push abandoned before its export ended left some behind): this push fails, the next "
                            "starts in step")
        return word


class GatheredExport:
    """The gather path's leader (mrl.bridge.export, broadcast transport, host memory): each
    bucket's HF tensors are assembled straight into their places in one of two wire buffers, kept
    from push to push (bucket k in buffer k % 2), instead of into fresh tensors that `pack` then
    copies into a fresh buffer: one copy of every byte instead of two, and no page to fault in.
    Measured on the 0.93 GB Qwen3-MoE (docs/benchmarks.md). Bucket k + 2 is assembled only once
    bucket k has been sent (the sender's pipeline holds two slots), so a buffer is never
    rewritten while it is on the wire. The price: two buckets of host memory held for the run.
    After a send that timed out, gloo may still be reading a buffer that the rest of the export
    (which runs to its end) writes again: only into a sync that has failed already, whose channel
    is never reused."""

    def __init__(self, plan: list[PlanItem], bucket_bytes: int, dims: SplitDims, engine_dtype: str):
        dtype = dtype_named(engine_dtype)
        buckets, slot_bytes = _slotted_layouts(plan, bucket_bytes, dims, dtype)
        self.layouts = [(entries, size) for _, entries, size in buckets]
        self.buffers = [torch.empty(max(size, 1), dtype=torch.uint8) for size in slot_bytes]

    def _flat(self, index: int) -> torch.Tensor:
        return self.buffers[index % SLOTS][: self.layouts[index][1]]

    def views(self, index: int) -> dict[str, torch.Tensor]:
        """Bucket `index`'s HF tensors, as views of its buffer (export_hf_weights' `into`)."""
        return dict(unpack({"tensors": self.layouts[index][0]}, self._flat(index)))

    def packed(self, buckets: Iterator[list]) -> Iterator[Packed]:
        """Each bucket the export assembled into views(index), with its header and checksums."""
        for index, _ in enumerate(buckets):
            entries, size = self.layouts[index]
            flat = self._flat(index)
            sums = bucket_checksums(entries, flat)
            yield Packed({"tensors": [{**entry, "checksum": c} for entry, c in zip(entries, sums)], "nbytes": size},
                         flat)
