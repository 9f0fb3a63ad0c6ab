"""Megatron shards → the rollout engine after every update, the transport hidden behind one interface.

Every trainer rank calls `WeightSender.push`; the engine's process calls `WeightReceiver.receive`.
The bridge's export (mrl/bridge/export.py) assembles HF tensors bucket by bucket on a leader rank,
which hands each bucket to the engine over a *channel*: a two-member gloo group (leader, engine)
rendezvousing on a TCPStore that the engine hosts. Per bucket the leader sends a JSON header
(names, shapes, dtypes, byte offsets, checksums) and then the bytes:

- "broadcast": the bytes go through the channel itself, and every pipeline stage has its own
  leader and channel, so stages export and send in parallel (the engine may sit on another node);
- "colocated": one leader (global rank 0) for the whole model; the bytes are written once into a
  shared-memory file that the engine maps (same node; on GPUs this is the place of CUDA IPC).

The engine compares each received tensor's checksum with the sender's, so a failed parity check
can name the first tensor that arrived different. Every wait has a timeout, and its error names
the rank, the pipeline stage, the bucket and the tensors it was waiting for; a peer that dies
closes its sockets, which fails the wait at once instead of hanging.
"""

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
from typing import Any

import torch
import torch.distributed as dist

from mrl.rollout.engine import Bucket, WeightUpdateReport

TRANSPORTS = ("colocated", "broadcast")
DEFAULT_BUCKET_BYTES = 512 * 1024**2
SHM_DIR = "/dev/shm"
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}
_KEEP_FP32 = ("e_score_correction_bias",)  # DeepSeek-V3's routing bias is fp32 in every engine


class SyncError(RuntimeError):
    """A weight sync failed or timed out; the message says who waited for what."""


def tensor_checksum(tensor: torch.Tensor) -> tuple[float, float]:
    """fp64 sums of two interleaved samples (every 61st element, offsets 0 and 30).

    Cheap on purpose, since it runs on both sides of every sync: summing every element in fp64 was
    measured ~40× slower (~0.35 s per 128 MB on 2 cores). A stale or lost tensor changes both
    sums; a handful of corrupted elements may not. It names the tensor behind a failed parity
    check; it is not a hash.
    """
    flat = tensor.reshape(-1)
    return (flat[::61].sum(dtype=torch.float64).item(), flat[30::61].sum(dtype=torch.float64).item())


def checksums_match(a: tuple[float, float], b: tuple[float, float]) -> bool:
    # Equal bytes at equal offsets reduce identically; the tolerance only absorbs a summation
    # order that differs with the buffers' alignment.
    return all(abs(x - y) <= 1e-6 * max(1.0, abs(x), abs(y)) for x, y in zip(a, b))


@dataclass(frozen=True)
class SyncEndpoint:
    """Where the engine listens, and what it wants: picklable, handed from engine to trainers."""

    host: str
    port: int
    dtype: str  # the engine's parameter dtype: tensors are cast before they travel


# --- wire format -------------------------------------------------------------------------------

def wire_dtype(name: str, engine_dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor travels and lives in on the engine."""
    return torch.float32 if name.endswith(_KEEP_FP32) else engine_dtype


def _nbytes(name: str, tensor: torch.Tensor, engine_dtype: torch.dtype) -> int:
    return tensor.numel() * torch.empty((), dtype=wire_dtype(name, engine_dtype)).element_size()


def pack(bucket: Bucket, engine_dtype: torch.dtype, out: torch.Tensor | None = None) -> tuple[dict, torch.Tensor]:
    """Cast and concatenate a bucket's tensors into one uint8 buffer (`out` if given); the header says where."""
    entries, offset = [], 0
    for name, tensor in bucket:
        entries.append({"name": name, "shape": list(tensor.shape), "dtype": str(wire_dtype(name, engine_dtype)),
                        "offset": offset})
        offset += _nbytes(name, tensor, engine_dtype)
    flat = out if out is not None else torch.empty(offset, dtype=torch.uint8)
    for entry, (_, tensor) in zip(entries, bucket):
        view = _view(flat, entry)
        view.copy_(tensor)
        entry["checksum"] = tensor_checksum(view)
    return {"tensors": entries, "nbytes": offset}, flat


def _view(flat: torch.Tensor, entry: dict) -> torch.Tensor:
    dtype = _DTYPES[entry["dtype"]]
    numel = 1
    for d in entry["shape"]:
        numel *= d
    size = numel * torch.empty((), dtype=dtype).element_size()
    return flat[entry["offset"] : entry["offset"] + size].view(dtype).view(entry["shape"])


def unpack(header: dict, flat: torch.Tensor) -> Bucket:
    """Views into `flat`: no copy on the receiving side."""
    return [(entry["name"], _view(flat, entry)) for entry in header["tensors"]]


# --- one channel: a two-member gloo group ------------------------------------------------------

class Channel:
    """Sender (member 0) and engine (member 1) of one stage; every operation waits with a timeout."""

    def __init__(self, store: Any, prefix: str, member: int, timeout_s: float, who: str):
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.who = who
        self.member = member
        try:  # the rendezvous itself waits for the peer
            self.group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), member, 2, self.timeout)
        except RuntimeError as err:
            raise SyncError(f"{who}: the peer did not join channel {prefix!r} within {timeout_s:.0f}s: {err}") from err

    def _broadcast(self, tensor: torch.Tensor, what: str, sending: bool) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = self.member if sending else 1 - self.member
        try:
            self.group.broadcast([tensor], options).wait(self.timeout)
        except RuntimeError as err:
            raise SyncError(f"{self.who}: {what} failed or timed out after {self.timeout_s:.0f}s: {err}") from err

    def send_json(self, obj: Any, what: str) -> None:
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        self._broadcast(torch.tensor([data.numel()], dtype=torch.int64), what, sending=True)
        self._broadcast(data, what, sending=True)

    def recv_json(self, what: str) -> Any:
        length = torch.zeros(1, dtype=torch.int64)
        self._broadcast(length, what, sending=False)
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        self._broadcast(data, what, sending=False)
        return json.loads(bytes(data.numpy()))

    def send_bytes(self, flat: torch.Tensor, what: str) -> None:
        self._broadcast(flat, what, sending=True)

    def recv_bytes(self, nbytes: int, what: str) -> torch.Tensor:
        flat = torch.empty(nbytes, dtype=torch.uint8)
        self._broadcast(flat, what, sending=False)
        return flat


def _describe(header: dict) -> str:
    names = [e["name"] for e in header["tensors"]]
    return f"{names[0]} … {names[-1]} ({len(names)} tensors)" if len(names) > 1 else names[0]


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
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 300.0):
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown weight-sync transport {transport!r}; choose one of {TRANSPORTS}")
        self.endpoint, self.built, self.coords = endpoint, built, coords
        self.transport, self.bucket_bytes, self.timeout_s = transport, bucket_bytes, timeout_s
        self.engine_dtype = _DTYPES[endpoint.dtype]
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
        return 1 if self.transport == "colocated" else self.built.layout.pp

    def push(self, sync_id: str) -> SentReport | None:
        """Export and send every tensor; returns the leader's report (None on other ranks)."""
        from mrl.bridge.export import export_hf_weights

        start = time.perf_counter()
        report = SentReport(started_at=time.time())
        is_leader = self.coords.rank == self.leader
        channel = self._connect(sync_id) if is_leader else None
        buckets = export_hf_weights(self.built, self.coords, bucket_bytes=self.bucket_bytes, dst=self.leader,
                                    group=self.group, timeout_s=self.timeout_s)
        for index, bucket in enumerate(buckets):
            header, flat = self._pack(bucket, sync_id, index)
            del bucket
            what = f"sending bucket {index} ({_describe(header)})"
            channel.send_json(header, what)
            if "shm" not in header:
                channel.send_bytes(flat, what)
            report.checksums.update((e["name"], tuple(e["checksum"])) for e in header["tensors"])
            report.bytes += header["nbytes"]
            del header, flat  # before the next bucket is assembled: one bucket in flight, not two
        if channel is not None:
            channel.send_json({"end": True, "tensors": len(report.checksums)}, "sending the end marker")
            channel.recv_json("waiting for the engine to finish loading")  # the engine's ack
        report.seconds = time.perf_counter() - start
        return report if is_leader else None

    def _connect(self, sync_id: str) -> Channel:
        who = f"rank {self.coords.rank} (PP stage {self.stage}) → engine at {self.endpoint.host}:{self.endpoint.port}"
        try:
            store = dist.TCPStore(self.endpoint.host, self.endpoint.port, is_master=False,
                                  timeout=timedelta(seconds=self.timeout_s))
        except (RuntimeError, OSError) as err:
            raise SyncError(f"{who}: cannot reach the engine's weight-sync store: {err}") from err
        return Channel(store, f"{sync_id}/channel{self.stage}", 0, self.timeout_s, who)

    def _pack(self, bucket: Bucket, sync_id: str, index: int) -> tuple[dict, torch.Tensor]:
        if self.transport != "colocated":
            return pack(bucket, self.engine_dtype)
        # Pack straight into a shared-memory file: one copy on this side, none on the engine's.
        nbytes = sum(_nbytes(n, t, self.engine_dtype) for n, t in bucket)
        path = os.path.join(SHM_DIR, f"mrl-sync-{sync_id.replace('/', '_')}-{index}-{uuid.uuid4().hex[:8]}")
        flat = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)[:nbytes]
        header, flat = pack(bucket, self.engine_dtype, out=flat)
        header["shm"] = path
        return header, flat


# --- engine side -------------------------------------------------------------------------------

class WeightReceiver:
    """Engine side of the sync: hosts the rendezvous store and loads buckets as they arrive."""

    def __init__(self, engine: Any, host: str = "127.0.0.1", timeout_s: float = 300.0):
        self.engine, self.timeout_s = engine, timeout_s
        with socket.socket() as s:  # the port must be reachable by the trainers: bind on host
            s.bind((host, 0))
            port = s.getsockname()[1]
        self.store = dist.TCPStore(host, port, is_master=True, timeout=timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.endpoint = SyncEndpoint(host, port, str(engine.dtype))
        self._used_ids: set[str] = set()

    def receive(self, sync_id: str, channels: int) -> WeightUpdateReport:
        """Receive one complete update from `channels` senders (in parallel) and finish it.

        One thread per channel receives; only this thread calls the engine. vLLM's multi-process
        executor (rollout TP > 1) hung when its collective_rpc was entered from several threads,
        even one at a time (measured: a TP2 engine fed by two PP stages never finished).
        `sync_id` (e.g. the training step) names this update's channels in the store, so it must be
        new each time: a reused id would make the senders meet the previous update's stale addresses.
        """
        if sync_id in self._used_ids:
            raise ValueError(f"weight sync id {sync_id!r} was already used; give each sync a new id (e.g. the step)")
        self._used_ids.add(sync_id)
        self.engine.begin_weight_update()
        # At most one bucket per channel waits here while the engine loads another: bounded memory.
        arrivals: queue.Queue = queue.Queue(maxsize=channels)
        loaded = [threading.Event() for _ in range(channels)]
        threads = [threading.Thread(target=self._serve, args=(sync_id, c, arrivals, loaded[c]), daemon=True)
                   for c in range(channels)]
        for t in threads:
            t.start()
        sent: dict[str, tuple[float, float]] = {}
        open_channels = channels
        while open_channels:
            # Every channel wait inside _serve has its own timeout and reports here; this one only
            # guards against a receiving thread that stopped without a word.
            try:
                channel_index, header, bucket = arrivals.get(timeout=self.timeout_s * 2)
            except queue.Empty:
                raise SyncError(f"engine: no bucket from any of {open_channels} open channel(s) "
                                f"within {self.timeout_s * 2:.0f}s (sync {sync_id!r})") from None
            if isinstance(bucket, BaseException):
                raise bucket
            if bucket is None:  # that channel's end marker: everything it sent is loaded
                loaded[channel_index].set()
                open_channels -= 1
                continue
            sent.update((e["name"], tuple(e["checksum"])) for e in header["tensors"])
            self.engine.load_weights(bucket)
        for t in threads:
            t.join(self.timeout_s)
        report = self.engine.finish_weight_update()
        report.finished_at = time.time()
        held = report.checksums
        report.mismatched = [n for n, c in sent.items() if n not in held or not checksums_match(c, held[n])]
        return report

    def _serve(self, sync_id: str, channel_index: int, arrivals: queue.Queue, loaded: threading.Event) -> None:
        """Receive one channel's buckets into `arrivals`; acknowledge once the engine loaded them all."""
        try:
            who = f"engine ← PP stage {channel_index}"
            channel = Channel(self.store, f"{sync_id}/channel{channel_index}", 1, self.timeout_s, who)
            index = 0
            while True:
                header = channel.recv_json(f"waiting for bucket {index}")
                if header.get("end"):
                    break
                flat = self._data(channel, header, f"receiving bucket {index} ({_describe(header)})")
                arrivals.put((channel_index, header, unpack(header, flat)))
                index += 1
            arrivals.put((channel_index, header, None))
            if not loaded.wait(self.timeout_s):
                raise SyncError(f"{who}: the engine did not finish loading within {self.timeout_s:.0f}s")
            channel.send_json({"ok": True}, "acknowledging the update")
        except BaseException as err:  # noqa: BLE001 - surfaced by receive()
            arrivals.put((channel_index, None, err))

    @staticmethod
    def _data(channel: Channel, header: dict, what: str) -> torch.Tensor:
        if "shm" not in header:
            return channel.recv_bytes(header["nbytes"], what)
        path = header["shm"]
        flat = torch.from_file(path, shared=True, size=max(header["nbytes"], 1), dtype=torch.uint8)
        os.unlink(path)  # the mapping stays valid; the memory goes when both sides drop it
        return flat[: header["nbytes"]]
