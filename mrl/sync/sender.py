"""The trainer ranks' side of the sync: every rank's part of the bridge's export, to every engine.

Every rank constructs a WeightSender (a collective: its export group and plan) and calls `push`
at every sync; the group's leader hands the buckets to a BucketSender (mrl/sync/pipeline.py),
which sends them by the transport's link (mrl/sync/transports.py). The one idea: what never
changes between pushes (the export's groups and plan, shared files and wire buffers, the
channel) is made once, at construction or the first push, and reused. The longer story: docs/sync.md.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch.distributed as dist

from mrl.sync.channel import SHM_DIR, SyncEndpoint, channel_count, slot_path, unlink_quietly
from mrl.sync.link import SentReport, open_limit_s
from mrl.sync.pipeline import BucketSender
from mrl.sync.transports import checked


class WeightSender:
    """Trainer side of the sync: construct on every rank (collective), then `push` on every rank.

    `endpoints` are the engines one export feeds (one, or a list: a fan-out); the first is the hub
    whose store every channel rendezvouses on. With `pipeline`, the leader packs and sends bucket
    k on a thread while the calling thread exports bucket k + 1 (the export's collectives stay on
    the calling thread): at most two buckets, plus the tensor being packed, alive at a time.

    Colocated with an engine that takes the bytes as they are (a CPU engine, no FP8), with every
    rank seeing the leader's /dev/shm, every rank writes its own shards into the shared bucket
    (mrl.sync.shared_export: no gather).
    """

    def __init__(self, endpoints: SyncEndpoint | list[SyncEndpoint], built: Any, coords: Any, *,
                 transport: str = "broadcast", bucket_bytes: int, timeout_s: float = 300.0, pipeline: bool = True):
        endpoints, kind = checked(endpoints, transport)  # refused on every rank before any collective
        self.built, self.coords, self.kind = built, coords, kind
        self.transport, self.bucket_bytes, self.timeout_s = transport, bucket_bytes, timeout_s
        self.group, self.leader, self.stage = self._export_group()
        self.plan = self._export_plan()
        self.writes_shared = self._can_write_shared(endpoints[0])
        self.shared: Any = None  # mrl.sync.shared_export.SharedExport, at the first push that writes shared
        # Broadcast from host memory to engines that take the bytes as they are: the leader
        # assembles each bucket in its wire buffer (mrl.sync.shared_export.GatheredExport).
        self.assembles = (kind.assembles and built.device.type == "cpu"
                          and endpoints[0].quantization is None and coords.rank == self.leader)
        self.gathered: Any = None  # that GatheredExport, made at the first push
        self.buckets = BucketSender(endpoints, transport=transport, timeout_s=timeout_s, pipeline=pipeline,
                                    who=f"rank {coords.rank} (PP stage {self.stage})", stage=self.stage)

    def _export_group(self) -> tuple[Any, int, int]:
        """One leader in all (colocated): the whole world exports to rank 0. Else one group per
        pipeline stage, its leader the stage's lowest rank."""
        if self.kind.one_leader:
            return None, 0, 0
        stages: list[int] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(stages, self.coords.pp)
        mine = None
        for stage in sorted(set(stages)):  # every rank creates every group, in the same order
            ranks = [r for r, s in enumerate(stages) if s == stage]
            group = dist.new_group(ranks)
            if stage == self.coords.pp:
                mine = group, min(ranks), stage
        return mine  # type: ignore[return-value]

    def _export_plan(self) -> list:
        """Which ranks send which shards, in which order: gathered once (a collective), since a
        model's shards never move; every push reuses it."""
        from mrl.bridge.export import build_plan
        from mrl.bridge.local_tensors import local_tensors

        return build_plan(local_tensors(self.built, self.coords), self.coords, self.group)

    def _can_write_shared(self, endpoint: SyncEndpoint) -> bool:
        """Whether every rank can write its shards into the leader's shared-memory bucket: colocated,
        an engine that takes the bytes as they are, and every rank sees the leader's /dev/shm (a
        file the leader makes there: one host name is not enough, containers on one host may
        each have their own). Every rank decides alike (two collectives of all of them, or none)."""
        if not self.kind.shared_files or endpoint.device != "cpu" or endpoint.quantization is not None:
            return False
        world = dist.get_world_size(self.group)
        probe = os.path.join(SHM_DIR, f"mrl-probe-{uuid.uuid4().hex}") if self.coords.rank == self.leader else None
        if probe is not None:
            open(probe, "w").close()
        try:
            paths: list[str | None] = [None] * world
            dist.all_gather_object(paths, probe, group=self.group)
            path = next(p for p in paths if p is not None)
            seen: list[bool] = [False] * world
            dist.all_gather_object(seen, os.path.exists(path), group=self.group)
        finally:
            if probe is not None:
                unlink_quietly(probe)
        return all(seen)

    def _shared_export(self) -> Any:
        """This rank's SharedExport, made at the first push and kept (the plan never changes)."""
        if self.shared is None:
            from mrl.sync.shared_export import SharedExport  # trainer side only: engines never load the bridge

            self.shared = SharedExport(self.built, self.coords, self.plan, self.bucket_bytes,
                                       self.buckets.endpoint.dtype)
        return self.shared

    def _gathered_export(self) -> Any:
        """The leader's GatheredExport when it assembles buckets in place (made at the first push)."""
        if self.assembles and self.gathered is None:
            from mrl.bridge.mapping import SplitDims
            from mrl.sync.shared_export import GatheredExport

            self.gathered = GatheredExport(self.plan, self.bucket_bytes, SplitDims.of(self.built.spec),
                                           self.buckets.endpoint.dtype)
        return self.gathered

    @property
    def channels(self) -> int:
        """How many channels each engine must open for this layout."""
        return channel_count(self.transport, self.built.layout.pp)

    def close(self) -> None:
        """Done with this sender (its engines changed): the names of the shared files it kept from
        push to push go now (the engines keep their mappings); its channel goes with it."""
        if self.shared is not None:
            self.shared.drop()

    def push(self, sync_id: str) -> SentReport | None:
        """Export and send every tensor to every engine; returns the leader's report (None on other ranks)."""
        if self.writes_shared:
            port = self.buckets.endpoint.port
            buckets = self._shared_export().export(
                path=lambda generation, slot: slot_path(port, generation, self.stage, slot),
                leader=self.leader, group=self.group, timeout_s=self.timeout_s,
                leader_wait_s=open_limit_s(self.timeout_s) + self.timeout_s)
        else:
            from mrl.bridge.export import export_hf_weights

            gathered = self._gathered_export()
            buckets = export_hf_weights(self.built, self.coords, bucket_bytes=self.bucket_bytes, dst=self.leader,
                                        group=self.group, timeout_s=self.timeout_s, plan=self.plan,
                                        into=gathered.views if gathered else None)
            if gathered:
                buckets = gathered.packed(buckets)
        if self.coords.rank != self.leader:
            for _ in buckets:  # drives this rank's part: its sends to the leader, or its writes
                pass
            return None
        try:
            return self.buckets.send(sync_id, buckets)
        except BaseException:
            if self.shared is not None:  # the engines may hold half a generation: the next push makes new files
                self.shared.drop()
            raise
