"""Colocated export without a gather: every trainer rank writes its own shards straight into the
shared-memory bucket the engines map; the leader only checksums the bucket and announces it.

The gather path (mrl.bridge.export) sends every shard to the leader, which assembles HF tensors
and packs them into the bucket: a message per source and two copies of every byte on the leader,
one after the other. Where each HF tensor lies in a bucket follows from the plan alone, so every
rank computes that layout, maps the leader's file and writes its segments into it, all ranks at
once. Used when every rank sees the leader's /dev/shm and the engine takes the bytes as they are
(a CPU engine, no FP8): mrl.sync.sender.WeightSender decides.

Per bucket, two barriers of the export group: "the leader made the file" and "every rank wrote
its shards". The leader asks for bucket k + 1 only once at most one other bucket is alive (its
pipeline's slots), and after a failed sync drops each bucket's file as it comes, so at most two
files exist at a time, as on the gather path.
"""

from __future__ import annotations

import mmap
import os
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from mrl.bridge.export import PlanItem, bucket_items, write_shard
from mrl.bridge.local_tensors import local_tensors
from mrl.bridge.mapping import SplitDims
from mrl.sync.wire import Packed, SyncError, bucket_checksums, dtype_named, layout, unpack, wire_dtype


def bucket_layout(bucket: list[PlanItem], dims: SplitDims, engine_dtype: torch.dtype) -> tuple[list[dict], int]:
    """Where each HF tensor of the bucket lies in it, as `pack` would lay the assembled tensors out
    (mrl.sync.wire.layout), and the bucket's size in bytes."""
    return layout((name, shape, wire_dtype(name, engine_dtype, item.dtype))
                  for item in bucket for name, shape in item.layout(dims)[0].items())


class SharedExport:
    """One rank's side of every push of one sender: what never changes between pushes (this rank's
    tensors by name, each bucket's items and layout: the plan is fixed) is worked out once, at the
    first push (measured on the demo's four ranks sharing two cores: 7–10 ms a push, each rank)."""

    def __init__(self, built: Any, coords: Any, plan: list[PlanItem], bucket_bytes: int, engine_dtype: str):
        self.rank, self.device = coords.rank, built.device
        self.tensors = {t.name: t.tensor for t in local_tensors(built, coords)}
        self.dims = SplitDims.of(built.spec)
        dtype = dtype_named(engine_dtype)
        self.buckets = [(bucket, *bucket_layout(bucket, self.dims, dtype)) for bucket in bucket_items(plan, bucket_bytes)]

    def export(self, *, path: Any, leader: int, group: Any, timeout_s: float, leader_wait_s: float) -> Iterator[Packed]:
        """Every rank: write this rank's shards of each bucket into its file, `path(index)`. On the
        leader, yield each bucket once every rank has written it; elsewhere yield nothing.
        `leader_wait_s`: how long the ranks wait for the leader to make a file (it may first open its
        channel and wait for the engines to load the bucket before last)."""
        lead, who = self.rank == leader, f"rank {self.rank}"
        made, written = (_Barrier(group, self.device, wait_s, who) for wait_s in (leader_wait_s, timeout_s))
        for index, (bucket, entries, size) in enumerate(self.buckets):
            file = path(index)
            flat = torch.from_file(file, shared=True, size=max(size, 1), dtype=torch.uint8)[:size] if lead else None
            made.wait(f"the leader (rank {leader}) to make bucket {index}'s file")
            flat = _map(file, size, who) if flat is None else flat
            views = dict(unpack({"tensors": entries}, flat))
            for item in bucket:
                for rank, shard in item.sources:
                    if rank == self.rank:
                        write_shard(item, shard, self.tensors[item.name].detach(), views, self.dims, self.rank)
            written.wait(f"every rank to write its shards of bucket {index}")
            if lead:  # checksums of the bytes that travel
                sums = bucket_checksums(entries, flat)
                yield Packed({"tensors": [{**entry, "checksum": c} for entry, c in zip(entries, sums)], "nbytes": size,
                              "shm": file}, flat)
            del views, flat


def _map(path: str, size: int, who: str) -> torch.Tensor:
    """The leader's file, mapped writable. A file that is gone (a leader that failed and cleaned
    up) is an error here, where torch.from_file would create a new one."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError as err:
        raise SyncError(f"{who}: the leader's bucket file {path} is gone (the leader failed and cleaned up?)") from err
    try:
        buffer = mmap.mmap(fd, max(size, 1))
    finally:
        os.close(fd)
    return torch.frombuffer(buffer, dtype=torch.uint8)[:size]


class _Barrier:
    """A barrier of the export group (an all-reduce of one number) that waits at most timeout_s."""

    def __init__(self, group: Any, device: torch.device, timeout_s: float, who: str):
        self.group, self.who, self.timeout_s = group, who, timeout_s
        self.token = torch.zeros(1, device=device)

    def wait(self, what: str) -> None:
        try:
            dist.all_reduce(self.token, group=self.group, async_op=True).wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            raise SyncError(f"{self.who}: waiting for {what} failed or timed out after {self.timeout_s:.0f}s: "
                            f"{err}") from err
