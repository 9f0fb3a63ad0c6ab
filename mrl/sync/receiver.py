"""Engine side of the sync: hosts the rendezvous store (engine 0 of a fan-out; the others join
it), receives every channel in parallel and loads the buckets into the engine as they arrive
(one thread touches the engine)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mrl.sync.channel import IDENTITY_KEY, SHM_DIR, Channel, SyncEndpoint, accept_kept, unlink_quietly
from mrl.sync.cuda_ipc import visible_gpus
from mrl.sync.routing import publish_routes
from mrl.sync.wire import (SyncError, WeightUpdateReport, checksums_match, describe, describe_failure, error_key,
                           for_engine, give_back_unopened, in_shared_memory, shared_bytes, unpack)



class WeightReceiver:
    """Engine side of the sync: hosts the rendezvous store and loads buckets as they arrive."""

    def __init__(self, engine: Any, host: str = "127.0.0.1", timeout_s: float = 300.0):
        self.engine, self.timeout_s = engine, timeout_s
        # Port 0: the store binds a free port itself (on host, where the trainers reach it). Probing
        # a port first and binding it later lost a race to another process once (EADDRINUSE in CI).
        self.store = dist.TCPStore(host, 0, is_master=True, timeout=timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        device = torch.device(getattr(engine, "device", "cpu")).type
        # the GPUs the engine's processes see: an engine whose workers see others declares them (gpus)
        gpus = (getattr(engine, "gpus", None) or visible_gpus()) if device == "cuda" else ()
        self.endpoint = SyncEndpoint(host, self.store.port, str(engine.dtype), token=uuid.uuid4().hex, device=device,
                                     quantization=getattr(engine, "quantization", None),
                                     ipc_opens=getattr(engine, "ipc_opens", 1), gpus=tuple(gpus))
        self.store.set(IDENTITY_KEY, self.endpoint.token)
        self._used_ids: set[str] = set()
        # Kept from the last sync that succeeded (mrl.sync.channel: reused when the sender still
        # holds them too): per (hub, engines, index, channel) its Channel, and per (hub, channel)
        # the store connection it rendezvoused on.
        self._kept: dict[tuple, Channel] = {}
        self._connections: dict[tuple, Any] = {}
        self._published: set[tuple] = set()  # the hubs this engine's routes were published at

    def receive(self, sync_id: str, channels: int, engines: int = 1, index: int = 0,
                hub: SyncEndpoint | None = None) -> WeightUpdateReport:
        """Receive one complete update from `channels` senders (in parallel) and finish it.

        Fan-out: this is engine `index` of `engines` fed by the same senders; engine 0 hosts the
        rendezvous (its own store), every other engine joins it at `hub` (engine 0's endpoint) and
        posts its errors there, where every sender looks.

        One thread per channel receives; only this thread calls the engine. vLLM's multi-process
        executor (rollout TP > 1) hung when its collective_rpc was entered from several threads,
        even one at a time (measured: a TP2 engine fed by two PP stages never finished).
        `sync_id` (e.g. the training step) names this update's channels in the store, so it must be
        new each time: a reused id would make the senders meet the previous update's stale addresses.
        """
        if sync_id in self._used_ids:
            raise ValueError(f"weight sync id {sync_id!r} was already used; give each sync a new id (e.g. the step)")
        self._used_ids.add(sync_id)
        if not 0 <= index < engines or (index > 0) != (hub is not None):
            raise ValueError(f"engine {index} of {engines}: engine 0 hosts the rendezvous (hub=None), every "
                             f"other engine needs engine 0's endpoint as hub (got {hub})")
        fanout = _Fanout(self.store if hub is None else self._connect(hub), index, engines, hub or self.endpoint)
        peers: list[dict] = []  # the other engines' errors, heard in their answers to the end marker
        outcome: dict[str, Any] = {}  # {"error": ..., "tensor": ...} once the update failed
        # At most one bucket per channel waits here while the engine loads another: bounded memory.
        # A bucket in shared memory stays the sender's until this engine has loaded it (the channel
        # waits for `done` before telling the sender).
        arrivals: queue.Queue = queue.Queue(maxsize=channels)
        loaded = threading.Event()  # set once the update is finished or failed: the channels answer
        threads = [threading.Thread(target=self._serve, args=(sync_id, c, arrivals, loaded, outcome, fanout, peers),
                                    daemon=True) for c in range(channels)]
        for t in threads:  # before the engine's preparation: the senders' handshake needs them, not it
            t.start()
        try:
            self.engine.begin_weight_update()
        except Exception as err:  # noqa: BLE001 - e.g. a model this engine cannot reload: tell the senders
            self._fail(sync_id, outcome, err, None, fanout)
        sent = self._drain(sync_id, channels, arrivals, outcome, fanout)
        report = None
        if not outcome:
            try:
                report = self.engine.finish_weight_update()
            except Exception as err:  # noqa: BLE001
                self._fail(sync_id, outcome, err, None, fanout)
        loaded.set()
        for t in threads:
            t.join(self.timeout_s)
        pending = _pending(arrivals)
        for _, header, _, _ in pending:  # never loaded (the update failed): this engine's own files go
            if header and header.get("local"):
                unlink_quietly(header["shm"])
            if header:
                give_back_unopened(header)
        late = [item[2] for item in pending if isinstance(item[2], BaseException)]
        if outcome or peers or late:  # the senders drop their channels after a failed update: so does this engine
            self._kept.clear()
        if outcome:
            raise SyncError(describe_failure(outcome))
        if peers:  # this engine loaded everything, but another engine of the fan-out failed: the update did
            raise SyncError(describe_failure(peers[0]))
        if late:  # a channel failed while answering the end marker
            raise SyncError(f"{late[0]}") from late[0]
        report.finished_at = time.time()
        held = report.checksums
        report.mismatched = [n for n, c in sent.items() if n not in held or not checksums_match(c, held[n])]
        return report

    def _publish_routes(self, fanout: _Fanout) -> None:
        """Once per hub, when a routed sender asks: what each of this engine's workers needs of every
        HF tensor (or why it takes no routed buckets), where the sender reads it (mrl.sync.routing).
        On this thread, after the engine's preparation (which plans its copies)."""
        hub = (fanout.hub.host, fanout.hub.port, fanout.hub.token)
        if hub not in self._published:
            publish_routes(fanout.store, self.endpoint.token, self.engine)
            self._published.add(hub)

    def _connect(self, hub: SyncEndpoint) -> Any:
        """A client of the hub's store (engine 0's, or this engine's own): the rendezvous and the
        error key live there."""
        try:
            return dist.TCPStore(hub.host, hub.port, is_master=False, timeout=timedelta(seconds=self.timeout_s))
        except (RuntimeError, OSError) as err:
            raise SyncError(f"engine at {self.endpoint.host}:{self.endpoint.port}: cannot reach the "
                            f"weight-sync store of the hub (engine 0) at {hub.host}:{hub.port}: {err}") from err

    def _drain(self, sync_id: str, channels: int, arrivals: queue.Queue, outcome: dict, fanout: _Fanout) -> dict:
        """Load every channel's buckets until all have ended; after a failure keep receiving (and
        dropping) so that every sender reaches its end marker and hears the error in its answer."""
        sent: dict[str, tuple[float, float]] = {}
        open_channels = channels
        while open_channels:
            # Every channel wait inside _serve has its own timeout and reports here; this one only
            # guards against a receiving thread that stopped without a word.
            try:
                channel_index, header, flat, done = arrivals.get(timeout=self.timeout_s * 2)
            except queue.Empty:
                raise SyncError(f"engine: no bucket from any of {open_channels} open channel(s) "
                                f"within {self.timeout_s * 2:.0f}s (sync {sync_id!r})") from None
            if flat is None or isinstance(flat, BaseException):  # that channel is done
                open_channels -= 1
                if flat is not None and not outcome:
                    self._fail(sync_id, outcome, flat, None, fanout)
                elif flat is None and header.get("abort") and not outcome:
                    outcome.update(header["abort"])  # another engine failed: this update is void too
                continue
            # A bucket handed to load_shared is the engine's: its workers open its other CUDA IPC
            # handles (VLLMEngine.load_shared gives them back if it fails before they run).
            # Otherwise they are given back here.
            handed = not outcome and self._shares(header)
            try:
                if not outcome and header.get("routes_wanted"):  # a routed sender's first question
                    self._publish_routes(fanout)
                elif not outcome:
                    sent.update((e["name"], tuple(e["checksum"])) for e in header["tensors"])
                    self._load(header, flat)
            except Exception as err:  # noqa: BLE001 - reported to every sender, then raised
                self._fail(sync_id, outcome, err, header, fanout)
            finally:
                if not handed:
                    # A failure here leaves the bucket with the trainer until it exits; this
                    # update's outcome, and telling its channel the bucket is done, come first.
                    with contextlib.suppress(Exception):
                        give_back_unopened(header)
                del flat
                if header.get("local"):  # received into this engine's own file: loaded, or never will be
                    unlink_quietly(header["shm"])
                done.set()  # its channel may now tell the sender
        return sent

    def _load(self, header: dict, flat: torch.Tensor) -> None:
        """One bucket into the engine. An engine that loads in other processes (vLLM's workers) is
        handed a bucket in shared memory as the header, which its processes map themselves: the
        bytes are never copied into a message to them."""
        if "workers" in header:  # routed: the workers receive their own slices from the sender
            self.engine.load_routed(header)
        elif self._shares(header):
            self.engine.load_shared(header, flat)
        else:
            self.engine.load_weights(unpack(header, flat))
        if "cuda_ipc" in header:  # the leader's memory may be reused once the sender hears of this load:
            torch.cuda.synchronize()  # the engine's copies out of it must be done first

    def _shares(self, header: dict) -> bool:
        """Whether the engine loads this bucket by `load_shared` (its processes map it themselves)."""
        return getattr(self.engine, "load_shared", None) is not None and in_shared_memory(header)

    def _fail(self, sync_id: str, outcome: dict, err: BaseException, header: dict | None, fanout: _Fanout) -> None:
        """Record the update's first error and post it in the store, where every sender looks for
        it between buckets: they stop sending at once instead of waiting for an answer that the
        engine will never give."""
        if outcome:
            return
        tensor = getattr(err, "tensor", None) or (describe(header) if header else None)
        message = getattr(err, "message", None) or f"{type(err).__name__}: {err}"
        store, index, engines = fanout.store, fanout.index, fanout.engines
        outcome.update(error=" ".join(message.split()), tensor=tensor, engine=f"{self.endpoint.host}:{self.endpoint.port}")
        if engines > 1:
            outcome.update(index=index, engines=engines)
        try:
            store.compare_set(error_key(sync_id), "", json.dumps(outcome))  # the first error posted stands: the cause
        except (RuntimeError, OSError):  # the hub is gone: the senders fail on their own channels
            pass

    def _serve(self, sync_id: str, channel_index: int, arrivals: queue.Queue, loaded: threading.Event,
               outcome: dict, fanout: _Fanout, peers: list) -> None:
        """Receive one channel's buckets into `arrivals`; answer the end marker once the update is
        finished: {"ok": true}, or the engine's error (each engine answers in turn)."""
        engine_index, engines = fanout.index, fanout.engines
        try:
            who = "engine" if engines == 1 else f"engine {engine_index} of {engines}"
            who = f"{who} ← PP stage {channel_index}"
            channel, key = self._open(sync_id, channel_index, fanout, who)
            index, unreleased = 0, None
            while True:
                header = channel.recv_json(f"waiting for bucket {index}")
                if header.get("end"):
                    break
                header = for_engine(header, engine_index)
                shared = in_shared_memory(header)  # the sender's memory: given back once loaded
                flat, header = self._data(channel, header, f"receiving bucket {index} ({describe(header)})")
                done = threading.Event()
                arrivals.put((channel_index, header, flat, done))
                del flat
                if shared:
                    self._release(channel, unreleased, who)
                    unreleased = index, done
                if not header.get("routes_wanted"):  # a routed sender's question is no bucket
                    index += 1
            self._release(channel, unreleased, who)
            arrivals.put((channel_index, header, None, None))
            if not loaded.wait(self.timeout_s):
                raise SyncError(f"{who}: the engine did not finish loading within {self.timeout_s:.0f}s")
            answers = channel.answers(dict(outcome) or {"ok": True}, "answering the end marker")
            peers.extend(a for a in answers if "error" in a)
            self._kept[key] = channel  # every message of this sync went through: reusable
        except BaseException as err:  # noqa: BLE001 - surfaced by receive()
            self._connections.pop((fanout.hub.host, fanout.hub.port, channel_index), None)  # the hub may be gone
            arrivals.put((channel_index, None, err, None))

    def _release(self, channel: Channel, unreleased: tuple[int, threading.Event] | None, who: str) -> None:
        """Tell the sender (a barrier with every engine) that the shared-memory bucket before the
        one just received is loaded: its memory may go. One bucket behind, so that the sender packs
        bucket k + 1 while the engine loads bucket k, and sends the end marker without waiting for
        the last load (mrl.sync.link.Link._send)."""
        if unreleased is None:
            return
        index, done = unreleased
        if not done.wait(self.timeout_s):
            raise SyncError(f"{who}: the engine did not load bucket {index} within {self.timeout_s:.0f}s")
        channel.barrier(f"telling the sender bucket {index} is loaded (its memory may go)")

    def _open(self, sync_id: str, channel_index: int, fanout: _Fanout, who: str) -> tuple[Channel, tuple]:
        """This sync's channel: the one kept from the last sync if the sender still holds it too,
        else a new rendezvous. Each channel has a store connection of its own: a TCPStore client
        runs one operation at a time and the rendezvous blocks in a wait; shared, channel 0's wait
        for its sender held up channel 1's, and two engines of a fan-out could block each other."""
        hub = fanout.hub
        key = (hub.host, hub.port, fanout.engines, fanout.index, channel_index)
        connection = (hub.host, hub.port, channel_index)
        if connection not in self._connections:
            self._connections[connection] = self._connect(hub)
        store = self._connections[connection]
        self._forget_other_fanouts(key)
        kept = self._kept.pop(key, None)
        if accept_kept(store, sync_id, channel_index, kept.prefix if kept else "", fanout.index, who, self.timeout_s):
            return kept, key
        channel = Channel(store, f"{sync_id}/channel{channel_index}", fanout.index + 1, self.timeout_s, who,
                          members=fanout.engines + 1)
        return channel, key

    def _forget_other_fanouts(self, key: tuple) -> None:
        """Drop the channels kept from another hub or fan-out than `key`'s: never offered again.
        Every channel's thread does this at once; another may have dropped one first."""
        for other in [k for k in self._kept if k[:4] != key[:4]]:
            self._kept.pop(other, None)

    def _data(self, channel: Channel, header: dict, what: str) -> tuple[torch.Tensor, dict]:
        """A bucket's bytes and the header to load it by. Bytes on the wire, for an engine that
        loads in other processes (`load_shared`), are received straight into a shared-memory file
        of this engine's own ("local" in the header: unlinked once loaded), which its workers map
        as they map a colocated sender's: no pickled copy to them either."""
        try:
            flat = shared_bytes(header)
        except BaseException:
            if "cuda_ipc" in header:  # nobody opens this bucket now (a failed open took no reference)
                with contextlib.suppress(Exception):
                    give_back_unopened(header, range(len(header["cuda_ipc"]["handles"])))
            raise
        if flat is not None:
            return flat, header
        if "workers" in header or header.get("routes_wanted"):  # routed: no bytes follow on the channel
            return torch.empty(0, dtype=torch.uint8), header
        if getattr(self.engine, "load_shared", None) is None or not _shm_has_room(header["nbytes"]):
            return channel.recv_bytes(header["nbytes"], what), header
        path = os.path.join(SHM_DIR, f"mrl-recv-{self.endpoint.port}-{uuid.uuid4().hex[:12]}")
        try:
            flat = torch.from_file(path, shared=True, size=max(header["nbytes"], 1), dtype=torch.uint8)
            channel.recv_into(flat[: header["nbytes"]], what)
        except BaseException:
            unlink_quietly(path)
            raise
        return flat[: header["nbytes"]], {**header, "shm": path, "local": True}


@dataclass(frozen=True)
class _Fanout:
    """This engine's place in one update: the hub's store (errors are posted there), its index
    among the engines fed by the same senders, and the hub's address (each channel has a connection
    of its own there)."""

    store: Any
    index: int
    engines: int
    hub: SyncEndpoint


def _shm_has_room(nbytes: int) -> bool:
    """Whether /dev/shm can take a received bucket with room to spare: its files are sparse, so a
    full tmpfs would fail the receive with SIGBUS, not an error (Docker's default is 64 MB)."""
    stat = os.statvfs(SHM_DIR)
    return stat.f_bavail * stat.f_frsize >= 4 * nbytes


def _pending(arrivals: queue.Queue) -> list:
    """What is left in the queue (without waiting)."""
    items = []
    while True:
        try:
            items.append(arrivals.get_nowait())
        except queue.Empty:
            return items
