"""One sync channel: a two-member gloo group (a trainer leader, the engine) rendezvousing on a
TCPStore the engine hosts. Every operation waits with a timeout and names who waited for what."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

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


IDENTITY_KEY = "mrl/engine-token"


def channel_count(transport: str, pipeline_stages: int) -> int:
    """Channels one sync opens: one per pipeline stage (broadcast: stages send in parallel), or one
    (colocated: rank 0 exports the whole model)."""
    return 1 if transport == "colocated" else pipeline_stages


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

