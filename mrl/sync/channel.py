"""One sync channel: a gloo group of a trainer leader and N engines, rendezvousing on a TCPStore
that engine 0 hosts (the hub). Every operation waits with a timeout and names who waited for what."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from mrl.sync.wire import SyncError


@dataclass(frozen=True)
class SyncEndpoint:
    """Where the engine listens, and what it wants: picklable, handed from engine to trainers."""

    host: str
    port: int
    dtype: str  # the engine's parameter dtype: tensors are cast before they travel
    token: str = ""  # the engine's store holds it under IDENTITY_KEY: a sender checks it met this engine
    device: str = "cpu"  # where the engine's parameters live: "cuda" makes the colocated transport use CUDA IPC
    quantization: str | None = None  # "fp8": the engine holds DeepSeek's block FP8; the sender quantises each bucket
    ipc_opens: int = 1  # CUDA IPC: how many times the engine's processes open each bucket (mrl.sync.cuda_ipc)
    gpus: tuple[str, ...] = ()  # CUDA IPC: the UUIDs of the GPUs the engine's processes see (its own, or declared)


IDENTITY_KEY = "mrl/engine-token"
SHM_DIR = "/dev/shm"  # where colocated buckets (and a loading engine's received ones) are files


def unlink_quietly(path: str) -> None:
    """Remove a bucket's /dev/shm file; one already gone is fine (whoever got there first)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def bucket_path(port: int, sync_id: str, stage: int, index: int) -> str:
    """A colocated bucket's /dev/shm file, named so that every trainer rank can find it (by the
    hub's port, the sync, the stage and the bucket), and a failed sync's leftovers by bucket_prefix."""
    return f"{bucket_prefix(port, sync_id, stage)}{index}"


def slot_path(port: int, generation: int, stage: int, slot: int) -> str:
    """A /dev/shm file reused from push to push (mrl.sync.shared_export), by its generation and slot."""
    return bucket_path(port, f"g{generation:x}", stage, slot)


def bucket_prefix(port: int, sync_id: str, stage: int) -> str:
    return os.path.join(SHM_DIR, f"mrl-sync-{port}-{sync_id.replace('/', '_')}-s{stage}-")


def channel_count(transport: str, pipeline_stages: int) -> int:
    """Channels one sync opens: one per pipeline stage (broadcast: stages send in parallel), or one
    (colocated: rank 0 exports the whole model)."""
    return 1 if transport == "colocated" else pipeline_stages


class Channel:
    """One stage's group: the sender is member 0, engine i is member i + 1 (1 + N members).

    The sender's headers and bytes go to every engine at once (a gloo broadcast rooted at the
    sender); the engines' answers to the end marker come back one engine after the other, each
    rooted at its engine, so every member hears every answer. Every operation waits with a timeout.
    """

    def __init__(self, store: Any, prefix: str, member: int, timeout_s: float, who: str, members: int = 2):
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.who = who
        self.member, self.members = member, members
        self.prefix = prefix
        try:  # the rendezvous itself waits for every peer
            self.group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), member, members, self.timeout)
        except RuntimeError as err:
            raise SyncError(f"{who}: the peer did not join channel {prefix!r} within {timeout_s:.0f}s: {err}") from err

    def _broadcast(self, tensor: torch.Tensor, what: str, root: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = root
        try:
            self.group.broadcast([tensor], options).wait(self.timeout)
        except RuntimeError as err:
            raise SyncError(f"{self.who}: {what} failed or timed out after {self.timeout_s:.0f}s: {err}") from err

    def send_json(self, obj: Any, what: str) -> None:
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        self._broadcast(torch.tensor([data.numel()], dtype=torch.int64), what, self.member)
        self._broadcast(data, what, self.member)

    def recv_json(self, what: str, root: int = 0) -> Any:
        length = torch.zeros(1, dtype=torch.int64)
        self._broadcast(length, what, root)
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        self._broadcast(data, what, root)
        return json.loads(bytes(data.numpy()))

    def send_bytes(self, flat: torch.Tensor, what: str) -> None:
        self._broadcast(flat, what, self.member)

    def recv_bytes(self, nbytes: int, what: str) -> torch.Tensor:
        flat = torch.empty(nbytes, dtype=torch.uint8)
        self.recv_into(flat, what)
        return flat

    def recv_into(self, flat: torch.Tensor, what: str) -> None:
        """The sender's bytes into `flat` (uint8, the sent length): e.g. a shared-memory file."""
        self._broadcast(flat, what, 0)

    def answers(self, mine: dict | None, what: str) -> list[dict]:
        """Every engine's answer, engine 0 first (`mine` is this engine's; the sender passes None)."""
        out = []
        for root in range(1, self.members):
            if root == self.member:
                self.send_json(mine, what)
                out.append(mine)
            else:
                out.append(self.recv_json(f"{what} (engine {root - 1}'s answer)", root))
        return out

    def barrier(self, what: str) -> None:
        """Wait until every member got here (an all-reduce of one number)."""
        try:
            self.group.allreduce([torch.zeros(1)]).wait(self.timeout)
        except RuntimeError as err:
            raise SyncError(f"{self.who}: {what} failed or timed out after {self.timeout_s:.0f}s: {err}") from err


# --- keeping a channel from one sync to the next -----------------------------------------------
# A gloo group costs a rendezvous to make and ~20 ms to destroy (measured: `del` of a two-member
# ProcessGroupGloo), each on both sides of every sync: a quarter of the demo's sync. So both sides
# keep each channel after a sync that succeeded, and the next sync reuses it when every member
# still holds it: the sender offers the channel it kept (by its prefix), every engine says whether
# it holds the same one, and the sender announces the outcome. A member that lost its channel (a
# failed sync, a restarted process, another sender) makes everyone rendezvous anew.


def _keys(sync_id: str, stage: int) -> tuple[str, str, str]:
    return f"{sync_id}/offer{stage}", f"{sync_id}/keeps{stage}", f"{sync_id}/reuse{stage}"


def _step(step: Callable[[], Any], who: str, what: str, timeout_s: float) -> Any:
    """One store operation of the handshake; its failure names who waited for what."""
    try:
        return step()
    except RuntimeError as err:
        timed_out = "timeout" in str(err).lower() or "timed out" in str(err).lower()
        how = f"within {timeout_s:.0f}s" if timed_out else "(the store failed)"
        raise SyncError(f"{who}: {what} {how}: {err}") from err


def offer_kept(store: Any, sync_id: str, stage: int, kept: str, engines: int, who: str, timeout_s: float) -> bool:
    """The sender's half: offer the channel `kept` (its prefix; "" for none) for this sync's
    channel of `stage`. Returns whether every engine holds it (then it is reused)."""
    offer, keeps, reuse = _keys(sync_id, stage)
    _step(lambda: store.set(offer, kept), who, "could not post its channel offer in the hub's store", timeout_s)
    if not kept:
        return False
    answers = [f"{keeps}/{engine}" for engine in range(engines)]
    _step(lambda: store.wait(answers, timedelta(seconds=timeout_s)), who,
          f"the engines did not say whether they still hold channel {kept!r}", timeout_s)
    reused = all(_step(lambda: store.get(key), who, "reading an engine's answer", timeout_s) == b"1" for key in answers)
    _step(lambda: store.set(reuse, "1" if reused else "0"), who, "could not post whether the channel is reused",
          timeout_s)
    return reused


def accept_kept(store: Any, sync_id: str, stage: int, kept: str, engine: int, who: str, timeout_s: float) -> bool:
    """An engine's half (`kept`: the prefix of the channel of `stage` it holds, "" for none):
    whether this sync reuses it. Waits for the sender's offer as long as the store's timeout."""
    offer, keeps, reuse = _keys(sync_id, stage)
    offered = _step(lambda: store.get(offer), who, f"no sender offered channel {stage} of sync {sync_id!r}",
                    timeout_s).decode()
    if not offered:
        return False
    _step(lambda: store.set(f"{keeps}/{engine}", "1" if offered == kept else "0"), who,
          "could not answer the sender's channel offer", timeout_s)
    answer = _step(lambda: store.get(reuse), who, f"the sender did not say whether channel {offered!r} is reused "
                   "(it waits for every engine of the sync to answer)", timeout_s)
    return answer == b"1"
