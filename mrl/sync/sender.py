"""Trainer side of the sync: the bridge's export, bucket by bucket, packed and sent to the engine."""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from mrl.sync.channel import (IDENTITY_KEY, SHM_DIR, Channel, SyncEndpoint, bucket_path, bucket_prefix,
                              channel_count, offer_kept, slot_path, unlink_quietly)
from mrl.sync.routing import look
from mrl.sync.wire import (Bucket, Packed, SyncError, checksums, describe, describe_failure, dtype_named, error_key,
                           in_shared_memory, pack, packed_layout, payload_bytes, wire_dtype)

TRANSPORTS = ("colocated", "broadcast", "routed")
QUANTIZATIONS = (None, "fp8")  # what the sender can produce for an engine: as is, or DeepSeek's block FP8
# TCPStore retries an unreachable port for its timeout, and its last try (plus a back-off) may
# start just before that ends (measured: ~9.5 s with a 3 s timeout): wait 2 × timeout + this.
CONNECT_GRACE_S = 5.0


def open_limit_s(timeout_s: float) -> float:
    """The longest a leader's channel may take to open: the store's connect (2 × timeout + grace),
    the identity check, the offer of the kept channel and the rendezvous (a timeout each)."""
    return 5 * timeout_s + CONNECT_GRACE_S


# After a channel error, how long the sender looks for an engine whose port refuses connections.
GONE_GRACE_S = 5.0


# --- trainer side ------------------------------------------------------------------------------

@dataclass
class SentReport:
    """What one leader sent: per-tensor checksums in send order, bytes and seconds."""

    checksums: dict[str, tuple[float, float]] = field(default_factory=dict)
    bytes: int = 0
    seconds: float = 0.0
    started_at: float = 0.0  # wall clock (time.time()) when this rank began exporting


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
        endpoints = _endpoints(endpoints, transport)  # refused on every rank before any collective
        self.built, self.coords = built, coords
        self.transport, self.bucket_bytes, self.timeout_s = transport, bucket_bytes, timeout_s
        self.group, self.leader, self.stage = self._export_group()
        self.plan = self._export_plan()
        self.writes_shared = self._can_write_shared(endpoints[0])
        self.shared: Any = None  # mrl.sync.shared_export.SharedExport, at the first push that writes shared
        # Broadcast from host memory to engines that take the bytes as they are: the leader
        # assembles each bucket in its wire buffer (mrl.sync.shared_export.GatheredExport).
        self.assembles = (transport == "broadcast" and built.device.type == "cpu"
                          and endpoints[0].quantization is None and coords.rank == self.leader)
        self.gathered: Any = None  # that GatheredExport, made at the first push
        self.buckets = BucketSender(endpoints, transport=transport, timeout_s=timeout_s, pipeline=pipeline,
                                    who=f"rank {coords.rank} (PP stage {self.stage})", stage=self.stage)

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
        if self.transport != "colocated" or endpoint.device != "cpu" or endpoint.quantization is not None:
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


def _endpoints(endpoints: SyncEndpoint | list[SyncEndpoint], transport: str) -> list[SyncEndpoint]:
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown weight-sync transport {transport!r}; choose one of {TRANSPORTS}")
    endpoints = [endpoints] if isinstance(endpoints, SyncEndpoint) else list(endpoints)
    if not endpoints or len({(e.dtype, e.device, e.quantization) for e in endpoints}) != 1:
        raise ValueError(f"a weight sync feeds one or more engines of one dtype, device and quantization; got {endpoints}")
    if transport == "routed" and endpoints[0].quantization is not None:
        raise ValueError("sync.transport routed sends unquantised slices; an engine holding FP8 weights takes "
                         "'broadcast' or 'colocated'")
    if endpoints[0].quantization not in QUANTIZATIONS:
        raise ValueError(f"the engine holds {endpoints[0].quantization!r}-quantised weights; the weight sync produces "
                         "unquantised or block-FP8 ('fp8') weights only: start the engine from an unquantised or a "
                         "DeepSeek-style FP8 checkpoint")
    return endpoints


class BucketSender:
    """A leader's half of a sync, whatever makes its buckets: sends them to every engine of the
    sync over one channel and hears each engine's answer. `endpoints[0]` is the hub whose store
    every channel rendezvouses on; `stage` names this leader's channel (one per pipeline stage).

    It keeps the hub's store connection and its channel from the last send that succeeded
    (mrl.sync.channel: the next send reuses the channel if every engine kept it too)."""

    def __init__(self, endpoints: SyncEndpoint | list[SyncEndpoint], *, transport: str = "broadcast",
                 timeout_s: float = 300.0, pipeline: bool = True, who: str = "rank 0 (PP stage 0)", stage: int = 0):
        self.endpoints = _endpoints(endpoints, transport)
        self.endpoint = self.endpoints[0]
        self.transport, self.timeout_s, self.pipeline = transport, timeout_s, pipeline
        self.who, self.stage = who, stage
        self.engine_dtype = dtype_named(self.endpoint.dtype)
        self._store: Any = None
        self._kept: Channel | None = None
        self._groups: dict[str, Any] = {}  # routed: each engine's LeaderGroup, kept with the channel, by prefix
        self._routes: list | None = None  # routed: every engine's routes, read once (mrl.sync.routing)
        # Routed: one buffer per distinct route, reused from bucket to bucket and push to push (a
        # failed push gives them up: an abandoned send may still read them).
        self._buffers: list[Staging] = []
        self.staging = Staging()  # the pinned host buffer a GPU's bucket is packed into for the wire

    def send(self, sync_id: str, buckets: Iterable[Bucket]) -> SentReport:
        """Send every bucket (made while the previous one is sent, with `pipeline`), then the end marker."""
        start = time.perf_counter()
        report = SentReport(started_at=time.time())
        if self.endpoint.quantization == "fp8":  # each bucket quantised where it was made (a GPU's: on the GPU)
            from mrl.quant.fp8 import quantize_pairs

            buckets = (list(quantize_pairs(bucket)) for bucket in buckets)
        link = _Link(self, sync_id)
        try:
            if self.pipeline:
                _pipelined(buckets, lambda index, bucket: link.send(index, bucket, report), link.who, self.timeout_s,
                           link.opening, link.drop)
            else:
                for index, bucket in enumerate(buckets):
                    link.send(index, bucket, report)
            link.finish(report)
            # Every message of this send went through: its connection and channel are reusable. A
            # failed send gives neither back (the engine may be gone): the next one connects anew.
            self._store, self._kept, self._groups, self._buffers = link.store, link.channel, link.groups, link.buffers
        except SyncError as err:
            raise SyncError(link.diagnosed(str(err))) from err
        finally:
            link.close()
        report.seconds = time.perf_counter() - start
        return report

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


def _engine_failed(store: Any, sync_id: str, who: str, index: int) -> bool:
    """Whether an engine posted an error for this update (a look, not a wait)."""
    return look(store, error_key(sync_id), f"{who}, before bucket {index}")


class _Link:
    """A leader's channel to every engine of this sync: sends buckets, the end marker, and hears
    each engine's answer. Colocated buckets travel in /dev/shm files that it unlinks exactly once:
    when every engine has loaded one, or at close() after a failure."""

    def __init__(self, sender: BucketSender, sync_id: str):
        self.sender, self.sync_id = sender, sync_id
        engines = len(sender.endpoints)
        hub = sender.endpoint
        address = f"{hub.host}:{hub.port}"
        to = f"engine at {address}" if engines == 1 else f"{engines} engines (hub at {address})"
        self.short = sender.who
        self.who = f"{self.short} → {to}"
        self.store: Any = None
        self.channel: Channel | None = None
        self.failed = False  # an engine posted an error: nothing more travels
        self.own_error: SyncError | None = None  # this leader's own failure (routed), raised after the end marker
        self.waiting = False  # routed: in a wait for the engines' routes or workers (see opening)
        self.unreleased: tuple[int, str | None, torch.Tensor] | None = None  # sent, not yet loaded by every engine
        # The store connection and channel kept from the last push: taken here, on the calling
        # thread (the sender gets them back only after a push that succeeded; an opening still
        # running after a failed push must not take a later push's).
        store, kept, self.groups, self.buffers = sender._store, sender._kept, sender._groups, sender._buffers
        sender._store, sender._kept, sender._groups, sender._buffers = None, None, {}, []
        # The channel opens on a thread while the export makes the first bucket: the handshake waits
        # for the engines' receiving threads, the export for the other ranks' shards (measured: 7 of
        # the demo's 60 ms sync were the export waiting for the handshake).
        self._opening: list[BaseException] = []
        self._opener = threading.Thread(target=self._open, args=(engines, store, kept), daemon=True)
        self._opener.start()

    def _open(self, engines: int, store: Any, kept: Channel | None) -> None:
        """Meet the engines on the channel kept from the last sync, else on a new one."""
        sender = self.sender
        try:
            self.store = store or sender._open_store(self.who)
            if offer_kept(self.store, self.sync_id, sender.stage, kept.prefix if kept else "", engines, self.who,
                          sender.timeout_s):
                self.channel = kept
            else:
                self.channel = Channel(self.store, f"{self.sync_id}/channel{sender.stage}", 0, sender.timeout_s,
                                       self.who, members=engines + 1)
        except BaseException as err:  # noqa: BLE001 - raised by opened(), on the thread that sends
            self._opening.append(err)

    def opening(self) -> bool:
        """Whether the channel is still being opened, or a routed bucket waits for the engines'
        routes or workers: each of those waits has a timeout of its own, and its error (posted for
        the engines) names the cause better than the export's wait for a slot would."""
        return self._opener.is_alive() or self.waiting

    def opened(self) -> Channel:
        """The channel, once open; the opening's error if it failed. Each step of the opening has a
        timeout of its own; this join waits as long as all of them together (open_limit_s)."""
        limit = open_limit_s(self.sender.timeout_s)
        self._opener.join(limit)
        if self._opener.is_alive():
            raise SyncError(f"{self.who}: opening the channel did not end within {limit:.0f}s")
        if self._opening:
            raise self._opening[0]
        return self.channel  # type: ignore[return-value]

    def send(self, index: int, bucket: Bucket | Packed, report: SentReport) -> int:
        """Pack (unless every rank wrote it already) and send one bucket, or drop it once an engine
        has failed: the export still runs to its end, since its other ranks take part in it.
        Returns how many buckets' memory this let go: a bucket in shared memory goes once the engines loaded it, which they
        say after the next header (or the end marker), so the engines load bucket k while this
        packs bucket k + 1, and at most two are held."""
        channel = self.opened()
        self.failed = self.failed or _engine_failed(self.store, self.sync_id, self.who, index)
        if self.failed:
            return self.drop(bucket)
        if self.sender.transport == "routed":
            return self._send_routed(channel, index, bucket, report)
        header, flat = (bucket.header, bucket.flat) if isinstance(bucket, Packed) else self._pack(bucket, index)
        del bucket
        what = f"sending bucket {index} ({describe(header)})"
        channel.send_json(header, what)
        report.checksums.update((e["name"], tuple(e["checksum"])) for e in header["tensors"])
        report.bytes += payload_bytes(header)
        if not in_shared_memory(header):
            channel.send_bytes(flat, what)
            return 1
        # Every process of every engine maps the memory itself (vLLM's workers too).
        freed = self._release()
        self.unreleased = index, header.get("shm"), flat
        return freed

    def _send_routed(self, channel: Channel, index: int, bucket: Bucket, report: SentReport) -> int:
        """Announce a bucket on the channel, then send each engine worker its own slices over its
        engine's routed group (mrl.sync.routing); the workers receive them while loading it. A
        failure on this side (a refusal, workers that never come) is posted for the engines, which
        hear it in the end marker instead of waiting out their timeout."""
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
        receiver answers by publishing them in the hub's store) and kept: an engine's plan never
        changes, and a restarted engine is a new sender. None if an engine failed first."""
        from mrl.sync.routing import read_routes

        sender = self.sender
        if sender._routes is None:
            channel.send_json({"routes_wanted": True, "tensors": [], "nbytes": 0}, "asking the engines for their routes")
            interned: dict[str, Any] = {}  # engines with equal routes share one packed buffer per bucket
            routes = []
            for i, endpoint in enumerate(sender.endpoints):
                workers = read_routes(self.store, endpoint.token, self.sync_id, f"{self.short} → engine {i}",
                                      sender.timeout_s)
                if workers is None:
                    return None
                routes.append([interned.setdefault(json.dumps(w, sort_keys=True), w) for w in workers])
            sender._routes = routes
        return sender._routes

    @staticmethod
    def drop(bucket: Bucket | Packed) -> int:
        """A bucket that will not be sent (the sync failed): a packed one's file goes at once, so
        that the rest of the export (which runs to its end) keeps at most two files alive."""
        if isinstance(bucket, Packed) and "shm" in bucket.header:
            unlink_quietly(bucket.header["shm"])
        return 1

    def _release(self) -> int:
        """Once every engine has loaded the bucket sent before the last header (a barrier), its file
        goes and its GPU buffer is dropped (the engines copied what they keep); how many buckets
        that freed."""
        if self.unreleased is None:
            return 0
        index, path, _ = self.unreleased
        self.channel.barrier(f"waiting for the engines to load bucket {index}")
        self.unreleased = None
        if path is not None:
            unlink_quietly(path)
        return 1

    def finish(self, report: SentReport) -> None:
        """Send the end marker (with the posted error, after a failure) and raise the first engine's error."""
        channel = self.opened()
        marker: dict[str, Any] = {"end": True, "tensors": len(report.checksums)}
        try:
            if self.failed:
                marker["abort"] = json.loads(self.store.get(error_key(self.sync_id)))
            channel.send_json(marker, "sending the end marker")
            self._release()
            answers = channel.answers(None, "waiting for the engine to finish loading")
        except (SyncError, RuntimeError) as err:
            if self.own_error is not None:  # the cause, not what it left behind
                raise self.own_error from err
            raise
        if self.own_error is not None:
            raise self.own_error
        if self.failed:  # the first error posted is the cause (an engine's answer may be a consequence)
            raise SyncError(f"{self.short}: {describe_failure(marker['abort'])}")
        for answer in answers:
            if "error" in answer:
                raise SyncError(f"{self.short}: {describe_failure(answer)}")

    def diagnosed(self, message: str) -> str:
        """A channel error, with the engines whose port refuses connections (their process is gone)."""
        if len(self.sender.endpoints) == 1:
            return message
        deadline = time.monotonic() + GONE_GRACE_S  # a process that just died may still be closing its sockets
        while True:
            gone = [f"engine {i} at {e.host}:{e.port}" for i, e in enumerate(self.sender.endpoints) if _refuses(e)]
            if gone or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        if not gone:
            return message
        return f"{message} [{', '.join(gone)}: gone (its weight-sync port refuses connections)]"

    def close(self) -> None:
        """Unlink what is left of this sync's buckets in /dev/shm (after a failure; none after a
        success): the files the leader packed here. The files every rank writes, reused from push
        to push, go by SharedExport.drop."""
        if self.sender.transport != "colocated":
            return
        folder, stem = os.path.split(bucket_prefix(self.sender.endpoint.port, self.sync_id, self.sender.stage))
        try:
            names = os.listdir(folder)
        except OSError:  # no /dev/shm: no file was ever made there
            return
        for name in names:
            if name.startswith(stem) and name[len(stem):].isdigit():
                unlink_quietly(os.path.join(folder, name))

    def _pack(self, bucket: Bucket, index: int) -> tuple[dict, torch.Tensor]:
        dtype = self.sender.engine_dtype
        size = packed_layout(bucket, dtype)[1]  # as pack lays it out (each tensor aligned to its element size)
        on_gpu = next((t.device for _, t in bucket if t.is_cuda), None)
        if self.sender.transport != "colocated":  # the wire (gloo) carries host memory: pinned for a GPU's tensors
            return pack(bucket, dtype, out=self.sender.staging.take(size) if on_gpu else None, consume=True)
        if (on_gpu is not None and self.sender.endpoint.device == "cuda"
                and _seen_by_engines(on_gpu, self.sender.endpoints)):
            # GPU to GPU on one node: pack into GPU memory the engines map (CUDA IPC); no host copy
            from mrl.sync.cuda_ipc import share

            header, flat = pack(bucket, dtype, out=torch.empty(max(size, 1), dtype=torch.uint8, device=on_gpu)[:size],
                                consume=True)
            header["cuda_ipc"] = share(flat, [e.ipc_opens for e in self.sender.endpoints])
            return header, flat
        # Pack straight into a shared-memory file: one copy on this side, none on the engines'.
        path = bucket_path(self.sender.endpoint.port, self.sync_id, self.sender.stage, index)
        flat = torch.from_file(path, shared=True, size=max(size, 1), dtype=torch.uint8)[:size]
        header, flat = pack(bucket, dtype, out=flat, consume=True)
        header["shm"] = path
        return header, flat


def _seen_by_engines(device: torch.device, endpoints: list[SyncEndpoint]) -> bool:
    """Whether every engine's process sees the GPU of the leader's buckets (mrl.sync.cuda_ipc.reachable);
    else they are staged in host memory, as for an engine that declares no GPU."""
    from mrl.sync.cuda_ipc import device_uuid, reachable

    return reachable(device_uuid(device.index), endpoints)


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


def _refuses(endpoint: SyncEndpoint) -> bool:
    """Whether nothing listens on the engine's store port any more (a look with a short timeout)."""
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=2.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # a timeout or an unreachable host: no verdict
        return False


def _pipelined(buckets: Iterable[Bucket], send: Callable[[int, Bucket], int], who: str, timeout_s: float,
               opening: Callable[[], bool] = lambda: False, drop: Callable[[Bucket], int] = lambda bucket: 1) -> None:
    """Export on the calling thread (its collectives stay there) while a thread sends the previous
    bucket. Two slots, each given back when a bucket's memory goes (`send` says how many went: a
    bucket in shared memory goes when the engines have loaded it, after the next one is sent); the
    wait for one does not count while the channel is `opening` (its own steps have timeouts). After
    an error the thread `drop`s the buckets it is handed. Its first error is raised here, once the
    export has run to its end (its other ranks take part in it), or when a slot's wait times out."""
    slots = threading.Semaphore(2)
    handoff: queue.Queue = queue.Queue(maxsize=1)
    errors: list[BaseException] = []

    def sending() -> None:
        index = 0
        while True:
            try:
                item = handoff.get(timeout=timeout_s * 2)
            except queue.Empty:
                errors.append(SyncError(f"{who}: the sender thread waited {timeout_s * 2:.0f}s for bucket {index} "
                                        "from the export"))
                return
            if item is None:
                return
            index, bucket = item
            del item
            freed = 1
            try:
                freed = drop(bucket) if errors else send(index, bucket)
            except BaseException as err:  # noqa: BLE001 - raised on the calling thread
                errors.append(err)
            finally:
                del bucket
                if freed:
                    slots.release(freed)
            index += 1

    thread = threading.Thread(target=sending, name="mrl-sync-sender", daemon=True)
    thread.start()
    iterator, index = iter(buckets), 0
    while True:
        while not slots.acquire(timeout=timeout_s):
            if opening():
                continue
            if errors:  # the sending thread's own error names the cause better (e.g. the channel's)
                raise errors[0]
            raise SyncError(f"{who}: bucket {index - 2} was not sent (or, in shared memory, loaded by the engines) "
                            f"within {timeout_s:.0f}s (the export waited to assemble bucket {index})")
        bucket = next(iterator, None)
        if bucket is None:
            break
        _put(handoff, (index, bucket), who, f"bucket {index}", timeout_s)
        del bucket
        index += 1
    _put(handoff, None, who, "the end of the export", timeout_s)
    thread.join(timeout_s)
    if thread.is_alive():
        raise SyncError(f"{who}: the sender thread did not finish sending within {timeout_s:.0f}s of the export's end")
    if errors:
        raise errors[0]


def _put(handoff: queue.Queue, item: Any, who: str, what: str, timeout_s: float) -> None:
    try:
        handoff.put(item, timeout=timeout_s)
    except queue.Full:
        raise SyncError(f"{who}: the sender thread did not take {what} within {timeout_s:.0f}s") from None
