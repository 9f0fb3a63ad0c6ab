"""Trainer side of the sync: the bridge's export, bucket by bucket, packed and sent to the engine."""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mrl.sync.channel import IDENTITY_KEY, Channel, SyncEndpoint, channel_count
from mrl.sync.wire import Bucket, SyncError, describe, describe_failure, dtype_named, error_key, nbytes, pack

TRANSPORTS = ("colocated", "broadcast")
SHM_DIR = "/dev/shm"
# TCPStore retries an unreachable port for its timeout, and its last try (plus a back-off) may
# start just before that ends (measured: ~9.5 s with a 3 s timeout): wait 2 × timeout + this.
CONNECT_GRACE_S = 5.0


# --- trainer side ------------------------------------------------------------------------------

@dataclass
class SentReport:
    """What one leader sent: per-tensor checksums in send order, bytes and seconds."""

    checksums: dict[str, tuple[float, float]] = field(default_factory=dict)
    bytes: int = 0
    seconds: float = 0.0
    started_at: float = 0.0  # wall clock (time.time()) when this rank began exporting


class WeightSender:
    """Trainer side of the sync: construct on every rank (collective), then `push` on every rank."""

    def __init__(self, endpoint: SyncEndpoint, built: Any, coords: Any, *, transport: str = "broadcast",
                 bucket_bytes: int, timeout_s: float = 300.0):
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown weight-sync transport {transport!r}; choose one of {TRANSPORTS}")
        self.endpoint, self.built, self.coords = endpoint, built, coords
        self.transport, self.bucket_bytes, self.timeout_s = transport, bucket_bytes, timeout_s
        self.engine_dtype = dtype_named(endpoint.dtype)
        self.group, self.leader, self.stage = self._export_group()

    def _export_group(self) -> tuple[Any, int, int]:
        """Colocated: the whole world exports to rank 0. Broadcast: one group per pipeline stage."""
        if self.transport == "colocated":
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

    @property
    def channels(self) -> int:
        """How many channels the engine must open for this layout."""
        return channel_count(self.transport, self.built.layout.pp)

    def push(self, sync_id: str) -> SentReport | None:
        """Export and send every tensor; returns the leader's report (None on other ranks)."""
        from mrl.bridge.export import export_hf_weights  # trainer side only: engines never load the bridge

        start = time.perf_counter()
        report = SentReport(started_at=time.time())
        is_leader = self.coords.rank == self.leader
        channel, store = self._connect(sync_id) if is_leader else (None, None)
        buckets = export_hf_weights(self.built, self.coords, bucket_bytes=self.bucket_bytes, dst=self.leader,
                                    group=self.group, timeout_s=self.timeout_s)
        failed = False
        for index, bucket in enumerate(buckets):
            # After the engine posted an error, the export still runs to its end (its other ranks
            # are sending shards to this one) but nothing more travels to the engine.
            failed = failed or _engine_failed(store, sync_id, channel.who, index)
            if failed:
                continue
            header, flat = self._pack(bucket, sync_id, index)
            del bucket
            what = f"sending bucket {index} ({describe(header)})"
            channel.send_json(header, what)
            if "shm" not in header:
                channel.send_bytes(flat, what)
            report.checksums.update((e["name"], tuple(e["checksum"])) for e in header["tensors"])
            report.bytes += header["nbytes"]
            del header, flat  # before the next bucket is assembled: one bucket in flight, not two
        if channel is not None:
            channel.send_json({"end": True, "tensors": len(report.checksums)}, "sending the end marker")
            answer = channel.recv_json("waiting for the engine to finish loading")
            if "error" in answer:
                raise SyncError(f"rank {self.coords.rank} (PP stage {self.stage}): {describe_failure(answer)}")
        report.seconds = time.perf_counter() - start
        return report if is_leader else None

    def _connect(self, sync_id: str) -> tuple[Channel, Any]:
        who = f"rank {self.coords.rank} (PP stage {self.stage}) → engine at {self.endpoint.host}:{self.endpoint.port}"
        store = self._open_store(who)
        return Channel(store, f"{sync_id}/channel{self.stage}", 0, self.timeout_s, who), store

    def _open_store(self, who: str) -> Any:
        """The engine's store, after a handshake that has a timeout. TCPStore's own connect waits
        for a reply with none: when an engine dies, its freed port may be reused (even by this
        process's own gloo group), which accepts the connection and never answers."""
        wait_s = 2 * self.timeout_s + CONNECT_GRACE_S
        opened: dict[str, Any] = {}

        def connect() -> None:
            try:
                opened["store"] = dist.TCPStore(self.endpoint.host, self.endpoint.port, is_master=False,
                                                timeout=timedelta(seconds=self.timeout_s))
            except (RuntimeError, OSError) as err:
                opened["error"] = err

        thread = threading.Thread(target=connect, daemon=True)  # left behind if the port never answers
        thread.start()
        thread.join(wait_s)
        if thread.is_alive():
            raise SyncError(f"{who}: the port accepted a connection but no weight-sync store answered within "
                            f"{wait_s:.0f}s: the engine probably died and its port was reused; restart the engine")
        if "error" in opened:
            raise SyncError(f"{who}: cannot reach the engine's weight-sync store: {opened['error']}") from opened["error"]
        store = opened["store"]
        if not self.endpoint.token:  # an endpoint made by hand (tests): nothing to compare
            return store
        token = store.get(IDENTITY_KEY).decode() if store.check([IDENTITY_KEY]) else None
        if token != self.endpoint.token:
            raise SyncError(f"{who}: the store at that address belongs to another engine (token {token!r}, "
                            f"expected {self.endpoint.token!r}): the engine was restarted; ask it for its endpoint again")
        return store

    def _pack(self, bucket: Bucket, sync_id: str, index: int) -> tuple[dict, torch.Tensor]:
        if self.transport != "colocated":
            return pack(bucket, self.engine_dtype)
        # Pack straight into a shared-memory file: one copy on this side, none on the engine's.
        size = sum(nbytes(n, t, self.engine_dtype) for n, t in bucket)
        path = os.path.join(SHM_DIR, f"mrl-sync-{sync_id.replace('/', '_')}-{index}-{uuid.uuid4().hex[:8]}")
        flat = torch.from_file(path, shared=True, size=max(size, 1), dtype=torch.uint8)[:size]
        header, flat = pack(bucket, self.engine_dtype, out=flat)
        header["shm"] = path
        return header, flat


def _engine_failed(store: Any, sync_id: str, who: str, index: int) -> bool:
    """Whether the engine posted an error for this update (a look, not a wait)."""
    try:
        return store.check([error_key(sync_id)])
    except (RuntimeError, OSError) as err:  # the engine's process is gone
        raise SyncError(f"{who}: the engine's store stopped answering before bucket {index}: {err}") from err
