"""A leader's link to every engine of one push: the channel all transports share.

A Link opens the channel (the one kept from the last push, else a new one) on a thread while the
export makes the first bucket, sends each bucket's header and bytes, looks for an engine's posted
error before every bucket, sends the end marker and reads every engine's answer. How a bucket is
packed and where its bytes travel is its transport's (mrl/sync/transports.py). The longer story:
docs/sync.md.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mrl.sync.channel import IDENTITY_KEY, Channel, SyncEndpoint, offer_kept, unlink_quietly
from mrl.sync.routing import look
from mrl.sync.wire import (Bucket, Packed, SyncError, describe, describe_failure, error_key, in_shared_memory,
                           payload_bytes)

if TYPE_CHECKING:
    from mrl.sync.pipeline import BucketSender

# TCPStore retries an unreachable port for its timeout, and its last try (plus a back-off) may
# start just before that ends (measured: ~9.5 s with a 3 s timeout): wait 2 × timeout + this.
CONNECT_GRACE_S = 5.0
# After a channel error, how long the sender looks for an engine whose port refuses connections.
GONE_GRACE_S = 5.0


def open_limit_s(timeout_s: float) -> float:
    """The longest a leader's channel may take to open: the store's connect (2 × timeout + grace),
    the identity check, the offer of the kept channel and the rendezvous (a timeout each)."""
    return 5 * timeout_s + CONNECT_GRACE_S


@dataclass
class SentReport:
    """What one leader sent: per-tensor checksums in send order, bytes and seconds."""

    checksums: dict[str, tuple[float, float]] = field(default_factory=dict)
    bytes: int = 0
    seconds: float = 0.0
    started_at: float = 0.0  # wall clock (time.time()) when this rank began exporting


def open_store(endpoint: SyncEndpoint, timeout_s: float, who: str) -> Any:
    """The engine's store, after a handshake that has a timeout. TCPStore's own connect waits
    for a reply with none: when an engine dies, its freed port may be reused (even by this
    process's own gloo group), which accepts the connection and never answers."""
    wait_s = 2 * timeout_s + CONNECT_GRACE_S
    opened: dict[str, Any] = {}

    def connect() -> None:
        try:
            opened["store"] = dist.TCPStore(endpoint.host, endpoint.port, is_master=False,
                                            timeout=timedelta(seconds=timeout_s))
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
    if not endpoint.token:  # an endpoint made by hand (tests): nothing to compare
        return store
    token = store.get(IDENTITY_KEY).decode() if store.check([IDENTITY_KEY]) else None
    if token != endpoint.token:
        raise SyncError(f"{who}: the store at that address belongs to another engine (token {token!r}, "
                        f"expected {endpoint.token!r}): the engine was restarted; ask it for its endpoint again")
    return store


def _engine_failed(store: Any, sync_id: str, who: str, index: int) -> bool:
    """Whether an engine posted an error for this update (a look, not a wait)."""
    return look(store, error_key(sync_id), f"{who}, before bucket {index}")


class Link:
    """A leader's channel to every engine of this sync: sends buckets, the end marker, and hears
    each engine's answer. A bucket in shared memory (a /dev/shm file, CUDA IPC) stays alive until
    every engine has loaded it; the link then gives it up, exactly once.

    `kept` is the sender's link of the last push that succeeded: its store connection and channel
    are reused (the sender gives a link back only after a push that succeeded)."""

    def __init__(self, sender: BucketSender, sync_id: str, kept: Link | None):
        self.sender, self.sync_id = sender, sync_id
        self.transport = sender.transport
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
        self.waiting = False  # in a wait with a timeout of its own (routed: the engines' routes or workers)
        self.unreleased: tuple[int, str | None, torch.Tensor] | None = None  # sent, not yet loaded by every engine
        # The channel opens on a thread while the export makes the first bucket: the handshake waits
        # for the engines' receiving threads, the export for the other ranks' shards (measured: 7 of
        # the demo's 60 ms sync were the export waiting for the handshake).
        self._opening: list[BaseException] = []
        store, channel = (kept.store, kept.channel) if kept is not None else (None, None)
        self._opener = threading.Thread(target=self._open, args=(engines, store, channel), daemon=True)
        self._opener.start()

    def _open(self, engines: int, store: Any, kept: Channel | None) -> None:
        """Meet the engines on the channel kept from the last sync, else on a new one."""
        sender = self.sender
        try:
            self.store = store or open_store(sender.endpoint, sender.timeout_s, self.who)
            if offer_kept(self.store, self.sync_id, sender.stage, kept.prefix if kept else "", engines, self.who,
                          sender.timeout_s):
                self.channel = kept
            else:
                self.channel = Channel(self.store, f"{self.sync_id}/channel{sender.stage}", 0, sender.timeout_s,
                                       self.who, members=engines + 1)
        except BaseException as err:  # noqa: BLE001 - raised by opened(), on the thread that sends
            self._opening.append(err)

    def opening(self) -> bool:
        """Whether the channel is still being opened, or a bucket waits on a step with a timeout of
        its own (routed: the engines' routes or workers): that step's error (posted for the
        engines) names the cause better than the export's wait for a slot would."""
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
        """Send one bucket, or drop it once an engine has failed: the export still runs to its end,
        since its other ranks take part in it. Returns how many buckets' memory this let go."""
        channel = self.opened()
        self.failed = self.failed or _engine_failed(self.store, self.sync_id, self.who, index)
        if self.failed:
            return self.drop(bucket)
        return self._send(channel, index, bucket, report)

    def _send(self, channel: Channel, index: int, bucket: Bucket | Packed, report: SentReport) -> int:
        """Pack (unless every rank wrote it already) and send one bucket's header, then its bytes
        unless they wait in shared memory. A bucket in shared memory goes once the engines loaded
        it, which they say after the next header (or the end marker), so the engines load bucket k
        while this packs bucket k + 1, and at most two are held."""
        header, flat = (bucket.header, bucket.flat) if isinstance(bucket, Packed) else self.transport.pack(
            self, bucket, index)
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
        """What this push leaves behind goes (the transport's: e.g. files after a failure)."""
        self.transport.clean(self)


def _refuses(endpoint: SyncEndpoint) -> bool:
    """Whether nothing listens on the engine's store port any more (a look with a short timeout)."""
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=2.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # a timeout or an unreachable host: no verdict
        return False
