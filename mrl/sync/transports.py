"""The ways a leader's buckets reach the engines (sync.transport), one class each behind `Transport`.

Every transport shares the channel (mrl/sync/link.py: headers, the end marker, the answers); a
Transport says how a bucket is packed and where its bytes travel:
- Broadcast: through the channel itself, one leader per pipeline stage;
- Colocated: a /dev/shm file (or CUDA IPC memory) that every engine maps, one leader in all;
- Routed: each engine worker receives only its own slices, point to point (mrl/sync/routing.py).
A sender holds one Transport for all its pushes; its facts (one_leader, shared_files, assembles)
steer the trainer ranks' export (mrl/sync/sender.py). The longer story: docs/sync.md and
docs/sync-routing.md.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch

from mrl.sync.channel import Channel, SyncEndpoint, bucket_path, bucket_prefix, unlink_quietly
from mrl.sync.link import Link, SentReport
from mrl.sync.wire import (Bucket, SyncError, checksums, describe, error_key, pack, packed_layout, payload_bytes,
                           wire_dtype)

if TYPE_CHECKING:
    from mrl.sync.pipeline import BucketSender

QUANTIZATIONS = (None, "fp8")  # what the sender can produce for an engine: as is, or DeepSeek's block FP8


class Transport:
    """How one sender's buckets travel: one per BucketSender, holding what lasts from push to push
    whatever their outcome. Each push opens a Link (`open`), which packs a bucket by `pack` and
    leaves nothing behind after `clean`."""

    name: ClassVar[str]
    one_leader: ClassVar[bool] = False  # global rank 0 exports the whole model (else each PP stage's leader)
    shared_files: ClassVar[bool] = False  # every rank may write its shards into the leader's shared bucket
    assembles: ClassVar[bool] = False  # a leader in host memory may assemble each bucket in its wire buffer

    def __init__(self, sender: BucketSender):
        self.sender = sender

    @classmethod
    def refuse(cls, endpoint: SyncEndpoint) -> None:
        """A one-line error for engines (all alike: `endpoint` is any of them) this one cannot feed."""

    def open(self, sync_id: str, kept: Link | None) -> Link:
        """This push's link; `kept` is the link of the sender's last push that succeeded."""
        return Link(self.sender, sync_id, kept)

    def pack(self, link: Link, bucket: Bucket, index: int) -> tuple[dict, torch.Tensor]:
        """One bucket's header and bytes, where the engines take them from."""
        raise NotImplementedError(f"transport {self.name!r} packs no whole buckets")

    def clean(self, link: Link) -> None:
        """After a push (its end, or a failure): what it left behind goes."""


class Broadcast(Transport):
    """Every byte through the channel (a gloo broadcast to every engine); one leader and channel per
    pipeline stage, so stages export and send in parallel (the engines may sit on other nodes)."""

    name = "broadcast"
    assembles = True

    def __init__(self, sender: BucketSender):
        super().__init__(sender)
        self.staging = Staging()  # the pinned host buffer a GPU's bucket is packed into for the wire

    def pack(self, link: Link, bucket: Bucket, index: int) -> tuple[dict, torch.Tensor]:
        dtype = self.sender.engine_dtype
        size = packed_layout(bucket, dtype)[1]  # as pack lays it out (each tensor aligned to its element size)
        on_gpu = any(t.is_cuda for _, t in bucket)  # the wire (gloo) carries host memory: pinned for a GPU's
        return pack(bucket, dtype, out=self.staging.take(size) if on_gpu else None, consume=True)


class Colocated(Transport):
    """One leader (global rank 0) for the whole model; each bucket is packed once into memory every
    engine maps: a /dev/shm file, or GPU memory through CUDA IPC when the engines see its GPU. The
    link unlinks each file once every engine has loaded it, or at `clean` after a failure."""

    name = "colocated"
    one_leader = True
    shared_files = True

    def pack(self, link: Link, bucket: Bucket, index: int) -> tuple[dict, torch.Tensor]:
        sender = self.sender
        dtype = sender.engine_dtype
        size = packed_layout(bucket, dtype)[1]
        on_gpu = next((t.device for _, t in bucket if t.is_cuda), None)
        if on_gpu is not None and sender.endpoint.device == "cuda" and _seen_by_engines(on_gpu, sender.endpoints):
            # GPU to GPU on one node: pack into GPU memory the engines map (CUDA IPC); no host copy
            from mrl.sync.cuda_ipc import share

            header, flat = pack(bucket, dtype, out=torch.empty(max(size, 1), dtype=torch.uint8, device=on_gpu)[:size],
                                consume=True)
            header["cuda_ipc"] = share(flat, [e.ipc_opens for e in sender.endpoints])
            return header, flat
        # Pack straight into a shared-memory file: one copy on this side, none on the engines'.
        path = bucket_path(sender.endpoint.port, link.sync_id, sender.stage, index)
        flat = torch.from_file(path, shared=True, size=max(size, 1), dtype=torch.uint8)[:size]
        header, flat = pack(bucket, dtype, out=flat, consume=True)
        header["shm"] = path
        return header, flat

    def clean(self, link: Link) -> None:
        """Unlink what is left of this sync's buckets in /dev/shm (after a failure; none after a
        success): the files the leader packed here. The files every rank writes, reused from push
        to push, go by SharedExport.drop."""
        folder, stem = os.path.split(bucket_prefix(self.sender.endpoint.port, link.sync_id, self.sender.stage))
        try:
            names = os.listdir(folder)
        except OSError:  # no /dev/shm: no file was ever made there
            return
        for name in names:
            if name.startswith(stem) and name[len(stem):].isdigit():
                unlink_quietly(os.path.join(folder, name))


class Routed(Transport):
    """As broadcast, but the channel carries only the headers: each engine worker receives just the
    slices of each tensor its in-place plan copies, point to point from its stage's leader over a
    gloo group of the leader and that engine's workers (mrl/sync/routing.py, docs/sync-routing.md)."""

    name = "routed"

    def __init__(self, sender: BucketSender):
        super().__init__(sender)
        # Every engine's routes (per worker), asked for once and kept: an engine's plan never
        # changes, and a restarted engine is a new sender.
        self.routes: list | None = None

    @classmethod
    def refuse(cls, endpoint: SyncEndpoint) -> None:
        if endpoint.quantization is not None:
            raise ValueError("sync.transport routed sends unquantised slices; an engine holding FP8 weights takes "
                             "'broadcast' or 'colocated'")

    def open(self, sync_id: str, kept: Link | None) -> Link:
        return RoutedLink(self.sender, sync_id, kept)


BY_NAME: dict[str, type[Transport]] = {kind.name: kind for kind in (Colocated, Broadcast, Routed)}
TRANSPORTS = tuple(BY_NAME)


def checked(endpoints: SyncEndpoint | list[SyncEndpoint], transport: str) -> tuple[list[SyncEndpoint], type[Transport]]:
    """The engines of one sync as a list, and the transport's class; a one-line error for a
    transport that does not exist or engines it cannot feed."""
    kind = BY_NAME.get(transport)
    if kind is None:
        raise ValueError(f"unknown weight-sync transport {transport!r}; choose one of {TRANSPORTS}")
    endpoints = [endpoints] if isinstance(endpoints, SyncEndpoint) else list(endpoints)
    if not endpoints or len({(e.dtype, e.device, e.quantization) for e in endpoints}) != 1:
        raise ValueError(f"a weight sync feeds one or more engines of one dtype, device and quantization; got {endpoints}")
    kind.refuse(endpoints[0])
    if endpoints[0].quantization not in QUANTIZATIONS:
        raise ValueError(f"the engine holds {endpoints[0].quantization!r}-quantised weights; the weight sync produces "
                         "unquantised or block-FP8 ('fp8') weights only: start the engine from an unquantised or a "
                         "DeepSeek-style FP8 checkpoint")
    return endpoints, kind


class RoutedLink(Link):
    """A routed push: each bucket announced on the channel, then each engine worker's slices sent
    over its engine's group. A failure on this side (a refusal, workers that never come) is posted
    for the engines, which hear it in the end marker instead of waiting out their timeout."""

    def __init__(self, sender: BucketSender, sync_id: str, kept: Link | None):
        super().__init__(sender, sync_id, kept)
        # Kept with the channel from the last push that succeeded: each engine's LeaderGroup (by
        # prefix) and one buffer per distinct route, reused from bucket to bucket and push to push
        # (a failed push gives them up: an abandoned send may still read them).
        last = kept if isinstance(kept, RoutedLink) else None
        self.groups: dict[str, Any] = last.groups if last else {}
        self.buffers: list[Staging] = last.buffers if last else []

    def _send(self, channel: Channel, index: int, bucket: Bucket, report: SentReport) -> int:  # type: ignore[override]
        """Announce a bucket on the channel, then send each engine worker its own slices; the
        workers receive them while loading it."""
        self.waiting = True  # on waits with timeouts of their own: the export's wait for a slot holds off
        try:
            try:
                routes = self._routes(channel)
            except SyncError as err:
                return self._abort(err, bucket)
            if routes is None:  # an engine failed before it published them
                self.failed = True
                return self.drop(bucket)
            header, buffers = self._pack_routed(channel, index, bucket, routes)
            del bucket
            what = f"sending bucket {index} ({describe(header)})"
            channel.send_json(header, what)
            try:
                if not self._send_to_workers(header["routed"], buffers, f"{self.who}: {what} to the engines' workers"):
                    self.failed = True  # an engine failed while its workers were to receive this bucket
                    return 1
            except SyncError as err:
                return self._abort(err)
        finally:
            self.waiting = False
        report.checksums.update((e["name"], tuple(e["checksum"])) for e in header["tensors"])
        report.bytes += payload_bytes(header)
        return 1

    def _pack_routed(self, channel: Channel, index: int, bucket: Bucket,
                     routes: list) -> tuple[dict, list[list[tuple[int, torch.Tensor]]]]:
        """A routed bucket's header and, per engine, each worker's (member, buffer). The header's
        tensors carry the whole tensors' checksums as they travel (cast to the engine's dtype)."""
        from mrl.sync.routing import pack_routed

        dtype = self.sender.engine_dtype
        cast = [t.to(wire_dtype(name, dtype, t.dtype)) for name, t in bucket]  # no copy where it travels as is
        whole = [{"name": name, "shape": list(t.shape), "dtype": str(t.dtype), "checksum": c}
                 for (name, _), t, c in zip(bucket, cast, checksums(cast))]
        del cast
        distinct = {id(route): route for workers in routes for route in workers}  # engines alike share one
        while len(self.buffers) < len(distinct):
            self.buffers.append(Staging(pinned=False))
        packed = {key: pack_routed(bucket, route, dtype, out=buffer.take)
                  for (key, route), buffer in zip(distinct.items(), self.buffers)}
        # One group per engine (with this leader): a group spanning engines deadlocked a fan-out of
        # PP stages, each engine joining the stages' groups in the order their buckets arrived.
        engines = [{"group": f"{channel.prefix}/engine{i}", "members": 1 + len(workers),
                    "workers": [{**packed[id(route)][0], "member": 1 + w} for w, route in enumerate(workers)]}
                   for i, workers in enumerate(routes)]
        buffers = [[(1 + w, packed[id(route)][1]) for w, route in enumerate(workers)] for workers in routes]
        hub = self.sender.endpoint
        header = {"tensors": whole, "nbytes": 0, "routed": engines, "stage": self.sender.stage, "index": index,
                  "hub": [hub.host, hub.port], "timeout_s": self.sender.timeout_s}
        return header, buffers

    def _send_to_workers(self, engines: list[dict], buffers: list, what: str) -> bool:
        """Each engine's group (kept with the channel, else met now: its workers join as they load
        the bucket just announced), then every send posted and waited for. False once an engine
        posted its error."""
        from mrl.sync.routing import LeaderGroup, wait_sends

        works, timeout_s = [], self.sender.timeout_s
        for engine, mine in zip(engines, buffers):
            prefix = engine["group"]
            if prefix not in self.groups:
                channel = prefix.rpartition("/")[0]  # another channel's groups go
                self.groups = {key: g for key, g in self.groups.items() if key.rpartition("/")[0] == channel}
                hub = (self.sender.endpoint.host, self.sender.endpoint.port)
                group = LeaderGroup.make(self.store, hub, prefix, engine["members"], self.sync_id, self.who, timeout_s)
                if group is None:
                    return False
                self.groups[prefix] = group
            works += self.groups[prefix].send(mine)
        return wait_sends(works, self.store, self.sync_id, what, timeout_s)

    def _abort(self, err: SyncError, bucket: Bucket | None = None) -> int:
        """This leader failed the sync: post its error where every engine and leader looks (unless an
        engine's came first), send nothing more, and raise it after the end marker (finish)."""
        self.failed, self.own_error = True, err
        outcome = {"error": str(err), "sender": self.short}
        try:
            self.store.compare_set(error_key(self.sync_id), "", json.dumps(outcome))
        except (RuntimeError, OSError):  # the hub is gone: the engines fail on their own channels
            pass
        return 1 if bucket is None else self.drop(bucket)

    def _routes(self, channel: Channel) -> list | None:
        """Every engine's routes (per worker), asked for once per sender (a header every engine's
        receiver answers by publishing them in the hub's store) and kept on its transport. None if
        an engine failed first."""
        from mrl.sync.routing import read_routes

        transport = cast(Routed, self.transport)
        if transport.routes is None:
            channel.send_json({"routes_wanted": True, "tensors": [], "nbytes": 0}, "asking the engines for their routes")
            interned: dict[str, Any] = {}  # engines with equal routes share one packed buffer per bucket
            routes = []
            for i, endpoint in enumerate(self.sender.endpoints):
                workers = read_routes(self.store, endpoint.token, self.sync_id, f"{self.short} → engine {i}",
                                      self.sender.timeout_s)
                if workers is None:
                    return None
                routes.append([interned.setdefault(json.dumps(w, sort_keys=True), w) for w in workers])
            transport.routes = routes
        return transport.routes


class Staging:
    """One host buffer, grown as needed and reused by every bucket: pinned, a GPU's tensors are
    packed into it for the wire (pinning is slow, page-locking ~0.1 s a GB, so it happens once);
    not pinned, a routed worker's slices (one per distinct route). One buffer suffices because a
    bucket is sent before the next is packed (one sender thread)."""

    def __init__(self, pinned: bool = True):
        self.buffer: torch.Tensor | None = None
        self.pinned = pinned

    def take(self, size: int) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < size:
            self.buffer = None  # the old one goes first: never two alive
            self.buffer = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=self.pinned)
        return self.buffer[:size]


def _seen_by_engines(device: torch.device, endpoints: list[SyncEndpoint]) -> bool:
    """Whether every engine's process sees the GPU of the leader's buckets (mrl.sync.cuda_ipc.reachable);
    else they are staged in host memory, as for an engine that declares no GPU."""
    from mrl.sync.cuda_ipc import device_uuid, reachable

    return reachable(device_uuid(device.index), endpoints)
