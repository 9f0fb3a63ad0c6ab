"""Per-request MoE routes as vLLM's workers forward them (mrl's own capture on vLLM-CPU).

Each forward step hands over, per request, the top-k expert ids of the tokens it ran and where they
sit in the request; `RouteStore` keeps each request's rows [T, L, K] until the engine takes them.
Positions served from vLLM's prefix cache were forwarded by an earlier request: their rows come from
a cache of full blocks keyed, as vLLM keys its KV blocks, by a hash chained over the tokens, so a
prompt's 2nd..nth sample still gets its full routes. A row never recorded is an error at `take`,
never a zero row. Pure numpy; the vLLM hooks that feed it: mrl/rollout/route_capture.py;
docs/rollout.md (MoE routes).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


class RouteError(RuntimeError):
    """Routes that cannot be given whole (a position never forwarded, nor found in the block cache)."""


@dataclass
class _Request:
    rows: np.ndarray  # [capacity, L, K]
    filled: np.ndarray  # [capacity] bool: rows recorded (forwarded or copied from the block cache)
    next_position: int = 0  # where the request's next forward is expected to start
    hashes: list[bytes] = field(default_factory=list)  # chain hash of block 0, 1, ... (as far as computed)
    owned: list[bytes] = field(default_factory=list)  # keys of its leading blocks, held in the cache


class RouteStore:
    """Rows by request id, and full blocks by token-chain hash for prefix-cache hits.

    A block stays cached while a request holding it is not yet taken (it computed or reused it), and
    for `retired_blocks` more blocks after that (oldest first): vLLM keeps a freed block for about as
    many allocations as its KV cache has blocks, so the engine sizes this from its KV cache.
    Thread-safe: a streaming engine's calls may take while another thread records."""

    def __init__(self, layers: int, top_k: int, dtype: np.dtype, block_size: int, retired_blocks: int):
        self.layers, self.top_k, self.dtype = layers, top_k, np.dtype(dtype)
        self.block_size, self.retired_blocks = block_size, retired_blocks
        self._requests: dict[str, _Request] = {}
        self._blocks: dict[bytes, np.ndarray] = {}  # key → rows [block_size, L, K]
        self._owners: dict[bytes, int] = {}  # key → requests holding it
        self._retired: OrderedDict[bytes, None] = OrderedDict()  # keys no request holds, oldest first
        self._lock = threading.Lock()
        self.copied_rows = 0  # rows served from the block cache (prefix-cache hits), since start

    def record(self, request_id: str, start: int, rows: np.ndarray, tokens: np.ndarray) -> None:
        """`rows` [n, L, K]: the routes of positions start..start+n-1 of `request_id`; `tokens`: the
        request's token ids from position 0 through at least start+n-1."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                request = self._requests[request_id] = self._new(start + len(rows))
            if start > 0 and start != request.next_position:  # a prefix-cache hit (or a resumed preemption)
                self._copy_cached(request, start, tokens)
            end = start + len(rows)
            self._grow(request, end)
            request.rows[start:end] = rows
            request.filled[start:end] = True
            request.next_position = end
            self._cache_full_blocks(request, tokens)

    def take(self, request_id: str, length: int) -> np.ndarray:
        """The request's first `length` rows (its prompt + response - 1 tokens); forgets the request."""
        with self._lock:
            request = self._requests.pop(request_id, None)
            if request is not None:
                self._release(request)
        if length <= 0:
            return np.zeros((0, self.layers, self.top_k), self.dtype)
        if request is None:
            raise RouteError(f"request {request_id}: no routes recorded (the route capture saw none of its "
                             f"{length} forwarded tokens); was it added after the capture was switched on?")
        filled = request.filled[:length]
        if len(filled) < length or not filled.all():
            first = len(filled) if filled.all() else int(np.argmin(filled))
            raise RouteError(f"request {request_id}: no routes for token {first} of {length}: neither forwarded "
                             "while capturing nor in the prefix-block cache, which keeps a block for as many "
                             "blocks after it as the KV cache holds; report it with the run's settings")
        return request.rows[:length].copy()

    def forget(self, keep: set[str], ours: str) -> None:
        """Drop requests not in `keep` whose ids do not start with `ours` (requests no one will take,
        e.g. prompt scoring's), keeping their blocks in the cache."""
        with self._lock:
            for request_id in [r for r in self._requests if r not in keep and not r.startswith(ours)]:
                self._release(self._requests.pop(request_id))

    def reset(self) -> None:
        """Forget everything (new weights: vLLM's prefix cache is reset with them)."""
        with self._lock:
            self._requests.clear()
            self._blocks.clear()
            self._owners.clear()
            self._retired.clear()

    def __len__(self) -> int:
        return len(self._requests)

    # --- inside the lock ---------------------------------------------------------------------

    def _new(self, capacity: int) -> _Request:
        return _Request(np.zeros((capacity, self.layers, self.top_k), self.dtype), np.zeros(capacity, bool))

    @staticmethod
    def _grow(request: _Request, end: int) -> None:
        capacity = len(request.filled)
        if end <= capacity:
            return
        capacity = max(end, 2 * capacity)  # doubling: a decode step adds one row
        rows = np.zeros((capacity, *request.rows.shape[1:]), request.rows.dtype)
        rows[: len(request.rows)] = request.rows
        filled = np.zeros(capacity, bool)
        filled[: len(request.filled)] = request.filled
        request.rows, request.filled = rows, filled

    def _hash(self, request: _Request, block: int, tokens: np.ndarray) -> bytes:
        """The chain hash of the request's tokens [0, (block + 1) · block_size)."""
        size = self.block_size
        while len(request.hashes) <= block:
            b = len(request.hashes)
            previous = request.hashes[-1] if request.hashes else b""
            chunk = np.ascontiguousarray(tokens[b * size : (b + 1) * size], dtype=np.int64)
            request.hashes.append(hashlib.blake2b(previous + chunk.tobytes(), digest_size=16).digest())
        return request.hashes[block]

    def _copy_cached(self, request: _Request, start: int, tokens: np.ndarray) -> None:
        """Fill the request's unrecorded rows before `start` from cached blocks (whole blocks only:
        vLLM's prefix cache hits whole blocks)."""
        self._grow(request, start)
        size = self.block_size
        for block in range(len(request.owned), start // size):
            span = slice(block * size, (block + 1) * size)
            if request.filled[span].all():
                continue
            cached = self._blocks.get(self._hash(request, block, tokens))
            if cached is None:
                return  # the chain breaks here: no later block can be a hit either
            self.copied_rows += int((~request.filled[span]).sum())
            request.rows[span] = cached
            request.filled[span] = True

    def _cache_full_blocks(self, request: _Request, tokens: np.ndarray) -> None:
        """Hold the request's complete leading blocks in the cache (computed or copied alike: a
        request reusing a block keeps it cached as vLLM keeps it)."""
        size, block = self.block_size, len(request.owned)
        while (block + 1) * size <= request.next_position and request.filled[block * size : (block + 1) * size].all():
            key = self._hash(request, block, tokens)
            if key not in self._blocks:
                self._blocks[key] = request.rows[block * size : (block + 1) * size].copy()
            self._owners[key] = self._owners.get(key, 0) + 1
            self._retired.pop(key, None)
            request.owned.append(key)
            block += 1

    def _release(self, request: _Request) -> None:
        for key in request.owned:
            self._owners[key] -= 1
            if not self._owners[key]:
                del self._owners[key]
                self._retired[key] = None
        while len(self._retired) > self.retired_blocks:
            self._blocks.pop(self._retired.popitem(last=False)[0], None)
