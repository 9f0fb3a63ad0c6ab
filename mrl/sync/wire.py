"""The wire format of a weight sync: what travels from a trainer leader to an engine, and the
checksums both sides compute on it.

A bucket is a list of (HF name, full tensor) pairs. pack() casts them to the engine's dtype (FP8
weights and their float32 block scales, for an engine that holds DeepSeek's FP8 format, travel as
they are) and concatenates them into one uint8 buffer; its JSON header gives each tensor's name, shape, dtype,
byte offset and checksum. unpack() gives views into the received buffer (no copy).
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

Bucket = list[tuple[str, torch.Tensor]]  # (HF name, full tensor) pairs


@dataclass
class Packed:
    """A bucket already packed where the engines map it (mrl.sync.shared_export: every trainer rank
    wrote its shards into the leader's shared-memory file): its header and bytes."""

    header: dict
    flat: torch.Tensor


_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn)}
# fp32 in every engine: DeepSeek-V3's routing bias, and the block scales of FP8 weights
_KEEP_FP32 = ("e_score_correction_bias", "_scale_inv")
# A gather costs ~8 tensor operations whatever its size (0.13–0.3 ms on 2 CPU cores), a tensor in
# the concatenation ~10 µs: tensors of one storage are gathered from this many on (a parameter's
# few regions, of which the demo's read-back had ~15 groups, are concatenated instead).
GATHER_MIN = 16
CHECKSUM_BATCH = 64 << 20  # elements checksummed in one batch (checksums): ~64 MB of temporaries (~1 B an element)
# A tensor this large is sampled alone, by two strided sums: batching pays for index arithmetic per
# sample, which for large tensors cost more than two operations saved (a 448 MB bucket of 28
# tensors on 2 CPU cores: 111 ms all batched, 42 ms with these alone; a 4 GB broadcast from an
# H200 ~0.5 s shorter).
ALONE_NUMEL = 1 << 20


class SyncError(RuntimeError):
    """A weight sync failed or timed out; the message says who waited for what."""


class WeightLoadError(RuntimeError):
    """An engine could not load a tensor: raised by an engine's load_weights to name the tensor
    (the receiver reports `tensor` and the message to every sender)."""

    def __init__(self, tensor: str, message: str):
        super().__init__(f"loading {tensor!r}: {message}")
        self.tensor, self.message = tensor, message

    def __reduce__(self):  # picklable across vLLM's worker processes and Ray
        return WeightLoadError, (self.tensor, self.message)


def error_key(sync_id: str) -> str:
    """The rendezvous-store key where the engine posts a failed update's error for the senders."""
    return f"{sync_id}/error"


def describe_failure(outcome: dict) -> str:
    """An engine's failed update ({"engine", "error", "tensor"}, and "index", "engines" in a fan-out
    to several), or a sender's ({"sender", "error"}), as one line."""
    if "sender" in outcome:  # a routed leader's own failure (mrl.sync.transports.RoutedLink._abort)
        return f"the weight update failed: the sender {outcome['sender']} failed: {outcome['error']}"
    where = f" while loading {outcome['tensor']!r}" if outcome.get("tensor") else ""
    who = f"engine {outcome['index']} of {outcome['engines']}" if "index" in outcome else "the engine"
    return f"the weight update failed: {who} at {outcome['engine']} failed{where}: {outcome['error']}"


def tensor_checksum(tensor: torch.Tensor) -> tuple[float, float]:
    """fp64 sums of two interleaved samples (every 61st element, offsets 0 and 30).

    Cheap on purpose, since it runs on both sides of every sync: summing every element in fp64 was
    measured ~40× slower (~0.35 s per 128 MB on 2 cores). A stale or lost tensor changes both
    sums; a handful of corrupted elements may not. It names the tensor behind a failed parity
    check; it is not a hash.
    """
    return tuple(_strided_sums([_sampled(tensor)])[0].tolist())


def checksums(tensors: Sequence[torch.Tensor]) -> list[tuple[float, float]]:
    """tensor_checksum of each tensor, batched, with a few tensor operations per batch whatever the
    number of tensors: per-tensor slicing cost the demo's sync ~3 ms for each of its four checksum
    passes (sender, receipt, copies, read-back; ~180 small tensors each).

    Large tensors (ALONE_NUMEL) are summed alone. Smaller ones that share a storage with many others
    (a bucket's views) are sampled by one gather from that storage at computed offsets; the others
    are concatenated per device and dtype and summed by run. Each batch's sums are read back once."""
    shared: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
    alone: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
    large: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for index, tensor in enumerate(tensors):
        flat = _sampled(tensor)  # a view where flattening needs no copy: possibly strided (a column, a[::2])
        if flat.numel() >= ALONE_NUMEL:
            large.setdefault(flat.device, []).append((index, flat))
            continue
        if not flat.is_contiguous():  # the gather below assumes consecutive elements
            alone.setdefault((flat.device, flat.dtype), []).append((index, flat))
            continue
        storage = flat.untyped_storage()
        shared.setdefault((flat.device, flat.dtype, storage.data_ptr(), storage.nbytes()), []).append((index, flat))
    out: list[tuple[float, float]] = [(0.0, 0.0)] * len(tensors)
    for members in large.values():
        _store(out, members, _strided_sums([flat for _, flat in members]))
    for key, members in shared.items():
        if len(members) < GATHER_MIN:
            alone.setdefault(key[:2], []).extend(members)
        else:
            for batch in _batches(members):
                _store(out, batch, _gathered_sums(batch))
    for members in alone.values():
        for batch in _batches(members):
            _store(out, batch, torch.stack([_segment_sums([flat[offset::61] for _, flat in batch])
                                            for offset in (0, 30)], dim=1))
    return out


def _strided_sums(flats: list[torch.Tensor]) -> torch.Tensor:
    """[n, 2]: tensor_checksum's two sums of each flat tensor (on one device), read back at once."""
    return torch.stack([flat[offset::61].sum(dtype=torch.float64) for flat in flats for offset in (0, 30)]).view(-1, 2)


def _store(out: list[tuple[float, float]], batch: list[tuple[int, torch.Tensor]], sums: torch.Tensor) -> None:
    for (index, _), pair in zip(batch, sums.tolist()):
        out[index] = tuple(pair)


def _gathered_sums(members: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """[n, 2]: the two sample sums of each flat contiguous tensor of `members`, which share one
    storage (sizes known on the host: no wait for a GPU to size the index)."""
    first = members[0][1]
    whole = torch.as_strided(first, (first.untyped_storage().nbytes() // first.element_size(),), (1,), 0)
    return _Samples.of([flat.storage_offset() for _, flat in members], [flat.numel() for _, flat in members],
                       first.device).sums(whole)


@dataclass(frozen=True)
class _Samples:
    """Where the checksum samples of some tensors lie in one 1-D buffer: each tensor's start (in
    elements) and its samples' counts. The samples' offsets (start + 61·k, start + 30 + 61·k) are
    built as tensors, so the work per tensor is only reading these lists."""

    starts: torch.Tensor  # [2n]: each tensor's start, then start + 30
    counts: torch.Tensor  # [2n]: how many samples each of the two takes
    total: int

    @staticmethod
    def of(starts: Sequence[int], sizes: Sequence[int], device: torch.device) -> _Samples:
        counts = [c for n in sizes for c in ((n + 60) // 61, (n + 30) // 61)]  # ceil((numel − start) / 61)
        return _Samples(torch.tensor([s + start for s in starts for start in (0, 30)], dtype=torch.int64, device=device),
                        torch.tensor(counts, dtype=torch.int64, device=device), sum(counts))

    def sums(self, whole: torch.Tensor) -> torch.Tensor:
        """[n, 2]: the sample sums of each tensor, read from `whole`."""
        device, counts = whole.device, self.counts
        segment = torch.repeat_interleave(torch.arange(len(counts), device=device), counts, output_size=self.total)
        # sample k of a segment lies at start + 61·k = (start − 61·(samples before it)) + 61·(its index overall)
        shifted = (self.starts - 61 * (torch.cumsum(counts, 0) - counts)).index_select(0, segment)
        values = whole.index_select(0, shifted + torch.arange(0, 61 * self.total, 61, device=device))
        return _run_sums(values, counts).view(-1, 2)


def bucket_checksums(entries: list[dict], flat: torch.Tensor) -> list[tuple[float, float]]:
    """checksums() of a bucket's tensors (its header entries), read from its bytes `flat` without a
    view per tensor: where a layout's samples lie is worked out once per process (a sync sends the
    same layouts every time), and each sync is a few tensor operations per dtype. The samples of
    checksums(unpack(...)), summed in the same order on a CPU (checksums_match on any device)."""
    key = tuple((e["offset"], e["dtype"], math.prod(e["shape"])) for e in entries)
    if flat.storage_offset() % 16:  # the dtype views below need an aligned start
        return checksums([tensor for _, tensor in unpack({"tensors": entries}, flat)])
    out = [(0.0, 0.0)] * len(entries)
    large, groups = _bucket_samples(key, flat.device, ALONE_NUMEL, CHECKSUM_BATCH)
    if large:
        sums = _strided_sums([_sampled(_view(flat, entries[slot])) for slot in large])
        for slot, pair in zip(large, sums.tolist()):
            out[slot] = tuple(pair)
    for dtype, batches in groups:
        whole = flat[: flat.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
        for slots, samples in batches:
            for slot, pair in zip(slots, samples.sums(whole).tolist()):
                out[slot] = tuple(pair)
    return out


@functools.lru_cache(maxsize=None)  # a sync cycles through all its buckets' layouts: an LRU of a few would never hit
def _bucket_samples(key: tuple, device: torch.device, alone: int,
                    limit: int) -> tuple[list[int], list[tuple[torch.dtype, list]]]:
    """For a bucket layout `key` ((byte offset, dtype name, numel) per entry; `layout` puts each at
    a multiple of its element size): the entries summed alone (from `alone` elements), and per
    sample dtype batches (of at most `limit` elements) of (entry indices, _Samples) for the others."""
    large: list[int] = []
    groups: dict[torch.dtype, list[tuple[int, int, int]]] = {}
    for slot, (offset, name, numel) in enumerate(key):
        if numel >= alone:
            large.append(slot)
            continue
        dtype = _DTYPES[name]
        sampled = _sample_dtype(dtype)
        groups.setdefault(sampled, []).append((slot, offset // sampled.itemsize, numel))
    out = []
    for dtype, members in groups.items():
        batches = _batches(members, size=lambda member: member[2], limit=limit)
        out.append((dtype, [([slot for slot, _, _ in batch], _Samples.of([start for _, start, _ in batch],
                                                                         [numel for _, _, numel in batch], device))
                            for batch in batches]))
    return large, out


def _batches(members: list, size: Callable[[Any], int] = lambda member: member[1].numel(),
             limit: int | None = None) -> list[list]:
    """Members in batches of at most `limit` (CHECKSUM_BATCH) elements (a larger one alone): the samples'
    fp64 copy and their indices take up to ~1 byte an element, which a GPU whose memory vLLM holds may lack."""
    limit = CHECKSUM_BATCH if limit is None else limit
    batches: list[list] = []
    total = 0
    for member in members:
        if not batches or total + size(member) > limit:
            batches.append([])
            total = 0
        batches[-1].append(member)
        total += size(member)
    return batches


def _sample_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.float8_e4m3fn else dtype  # FP8: no sum in torch; its bytes


def _sampled(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    return flat.view(_sample_dtype(flat.dtype))


def _segment_sums(samples: list[torch.Tensor]) -> torch.Tensor:
    """The fp64 sum of each tensor of `samples` (all on one device)."""
    if len(samples) == 1:  # a tensor alone in its batch: no copy, no index
        return samples[0].sum(dtype=torch.float64).reshape(1)
    return _run_sums(torch.cat(samples), torch.tensor([s.numel() for s in samples], device=samples[0].device))


def _run_sums(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The fp64 sum of each run of consecutive `values`, `lengths` long. A scatter-add into the
    sums (index_add_) serialises on a GPU's atomics, every sample of a run adding into one address:
    a 4 GB model's checksums took 0.14 s that way on an H200. The runs are summed in order, as
    index_add_ did on a CPU (the same sums there, and faster for long runs)."""
    # unsafe: no check of `lengths` (made here to fit), which would wait for a GPU twice
    return torch.segment_reduce(values.to(torch.float64), "sum", lengths=lengths, unsafe=True)


def checksums_match(a: tuple[float, float], b: tuple[float, float]) -> bool:
    # Equal bytes at equal offsets reduce identically; the tolerance only absorbs a summation
    # order that differs with the buffers' alignment.
    return all(abs(x - y) <= 1e-6 * max(1.0, abs(x), abs(y)) for x, y in zip(a, b))



@dataclass
class WeightUpdateReport:
    """What the engine received in one update: per-tensor checksums and parameters left stale."""

    tensors: int = 0
    bytes: int = 0
    checksums: dict[str, tuple[float, float]] = field(default_factory=dict)
    not_updated: list[str] = field(default_factory=list)  # engine parameters no tensor reached
    mismatched: list[str] = field(default_factory=list)  # arrived different from what was sent, in order
    # sync.apply in_place: engine parameters whose planned region, read back, differs from what was copied
    misapplied: list[str] = field(default_factory=list)
    load_seconds: float = 0.0  # inside the backend's load_weights
    finish_seconds: float = 0.0  # post-load processing (re-packing, derived matrices) and cache reset
    finished_at: float = 0.0  # wall clock (time.time()) when the engine was ready with the new weights


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype of its str() (as endpoints and headers carry it)."""
    return _DTYPES[name]


def wire_dtype(name: str, engine_dtype: torch.dtype, dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype a tensor (of `dtype`) travels and lives in on the engine: FP8 stays FP8."""
    if dtype == torch.float8_e4m3fn:
        return dtype
    return torch.float32 if name.endswith(_KEEP_FP32) else engine_dtype


def packed_layout(bucket: Bucket, engine_dtype: torch.dtype) -> tuple[list[dict], int]:
    """layout() of a bucket's tensors as they travel (cast to the engine's dtype, FP8 as is)."""
    return layout((name, tensor.shape, wire_dtype(name, engine_dtype, tensor.dtype)) for name, tensor in bucket)


def layout(tensors: Iterable[tuple[str, Sequence[int], torch.dtype]]) -> tuple[list[dict], int]:
    """Where each (name, shape, wire dtype) lies in a bucket: its header entries (without
    checksums) and the bucket's size in bytes. The one definition of the layout, for `pack` and
    for buckets every rank writes into (mrl.sync.shared_export)."""
    entries, offset = [], 0
    for name, shape, dtype in tensors:
        offset += -offset % dtype.itemsize  # each tensor at a multiple of its element size (a dtype view needs it)
        entries.append({"name": name, "shape": list(shape), "dtype": str(dtype), "offset": offset})
        offset += math.prod(shape) * dtype.itemsize
    return entries, offset


def pack(bucket: Bucket, engine_dtype: torch.dtype, out: torch.Tensor | None = None,
         consume: bool = False) -> tuple[dict, torch.Tensor]:
    """Cast and concatenate a bucket's tensors into one uint8 buffer (`out` if given: host memory,
    pinned for a GPU's tensors, or GPU memory); the header says where. `consume` drops each tensor
    from `bucket` once it is copied."""
    entries, offset = packed_layout(bucket, engine_dtype)
    flat = out if out is not None else torch.empty(offset, dtype=torch.uint8)
    waiting = False
    for index, entry in enumerate(entries):
        view, tensor = _view(flat, entry), bucket[index][1]
        if tensor.device != flat.device and tensor.is_cuda:
            # GPU → host: cast on the GPU, copy without waiting (one wait for the whole bucket below)
            view.copy_(tensor.to(view.dtype), non_blocking=True)
            waiting = True
        else:
            view.copy_(tensor)
        del tensor
        if consume:  # the packed copy replaces the tensor: one bucket plus one tensor alive, not two buckets
            bucket[index] = (entry["name"], None)  # type: ignore[assignment]
    if waiting:
        torch.cuda.current_stream().synchronize()
    for entry, checksum in zip(entries, bucket_checksums(entries, flat)):  # of the bytes that travel
        entry["checksum"] = checksum
    return {"tensors": entries, "nbytes": offset}, flat


def _view(flat: torch.Tensor, entry: dict) -> torch.Tensor:
    dtype = _DTYPES[entry["dtype"]]
    size = math.prod(entry["shape"]) * dtype.itemsize
    return flat[entry["offset"] : entry["offset"] + size].view(dtype).view(entry["shape"])


def payload_bytes(header: dict) -> int:
    """The bytes of a bucket's tensors, without the alignment between them (what a report counts)."""
    return sum(math.prod(e["shape"]) * _DTYPES[e["dtype"]].itemsize for e in header["tensors"])


def unpack(header: dict, flat: torch.Tensor) -> Bucket:
    """Views into `flat`: no copy on the receiving side."""
    return [(entry["name"], _view(flat, entry)) for entry in header["tensors"]]


def in_shared_memory(header: dict) -> bool:
    """Whether a bucket's bytes wait in memory every process of the engine can map (shared_bytes),
    rather than travelling on the channel."""
    return "shm" in header or "cuda_ipc" in header


def shared_bytes(header: dict, opener: int = 0) -> torch.Tensor | None:
    """A bucket's bytes where the sender left them for any process of the engine to map: a /dev/shm
    file (header "shm") or GPU memory (header "cuda_ipc", mrl.sync.cuda_ipc: `opener` picks this
    open's handle); None when they travel on the channel. Valid until the sender hears that every
    engine loaded the bucket."""
    if "cuda_ipc" in header:
        from mrl.sync.cuda_ipc import open_shared

        return open_shared(header["cuda_ipc"], opener)[: header["nbytes"]]
    if "shm" in header:
        if not reused(header):  # a file made for this bucket alone
            return map_file(header["shm"], max(header["nbytes"], 1), "engine")[: header["nbytes"]]
        return _KEPT.mapping(header)[: header["nbytes"]]
    return None


def for_engine(header: dict, index: int) -> dict:
    """The header as engine `index` of a fan-out loads it: its own CUDA IPC handles (mrl.sync.cuda_ipc),
    or its own workers' slices of a routed bucket ("workers", mrl.sync.routing)."""
    if "routed" in header:
        mine = {key: value for key, value in header.items() if key != "routed"}
        return {**mine, **header["routed"][index]}  # its group, members and workers
    if "cuda_ipc" not in header:
        return header
    from mrl.sync.cuda_ipc import for_engine as handles_for

    return {**header, "cuda_ipc": handles_for(header["cuda_ipc"], index)}


def give_back_unopened(header: dict, openers: range | None = None) -> None:
    """Give back the CUDA IPC handles `openers` of a bucket that will not open them (by default all
    but the receiver's: a bucket not handed to the engine's load_shared), mrl.sync.cuda_ipc.give_back.
    Nothing for other buckets."""
    if "cuda_ipc" in header:
        from mrl.sync.cuda_ipc import give_back

        shared = header["cuda_ipc"]
        give_back(shared, range(1, len(shared["handles"])) if openers is None else openers)


def reused(header: dict) -> bool:
    """Whether a bucket's memory is rewritten with a later bucket once the engines say they loaded
    it (GPU memory, or a /dev/shm file the sender reuses): an engine that keeps the tensors it is
    given past that (vLLM's layer-wise reload) must copy them."""
    return "cuda_ipc" in header or "shm_generation" in header


class _KeptMappings:
    """This process's mappings of the files a colocated sender reuses from one sync to the next
    (mrl.sync.shared_export), of the current generation, by path: their names are gone after the
    sync that first sent them, so the mapping is the only way back to them."""

    def __init__(self):
        self.lock = threading.Lock()  # the receiving threads and the engine's thread map alike
        self.generation: str | None = None
        self.files: dict[str, torch.Tensor] = {}

    def mapping(self, header: dict) -> torch.Tensor:
        with self.lock:
            if header["shm_generation"] != self.generation:  # the sender made new files: the old ones go
                self.generation, self.files = header["shm_generation"], {}
            if header["shm"] not in self.files:
                self.files[header["shm"]] = map_file(header["shm"], max(header["shm_bytes"], 1), "engine")
            return self.files[header["shm"]]


_KEPT = _KeptMappings()


def map_file(path: str, size: int, who: str, writable: bool = False) -> torch.Tensor:
    """A /dev/shm file, `size` bytes: shared and writable for the ranks that write a bucket,
    else read-only and private (this process cannot write into the sender's file; Linux shows
    other processes' later writes through a private mapping of pages it never wrote). A file that
    is gone (a sender that failed and cleaned up, or reused files whose names went before this
    process mapped them) is an error here, where torch.from_file would create one."""
    try:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except FileNotFoundError as err:
        raise SyncError(f"{who}: the bucket file {path} is gone (the sender failed and cleaned up, or this "
                        "process lost its mapping of a file the sender reuses)") from err
    try:
        buffer = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    return torch.frombuffer(buffer, dtype=torch.uint8)




def describe(header: dict) -> str:
    names = [e["name"] for e in header["tensors"]]
    if not names:  # e.g. a routed sender's question for the routes
        return "no tensors"
    return f"{names[0]} … {names[-1]} ({len(names)} tensors)" if len(names) > 1 else names[0]

