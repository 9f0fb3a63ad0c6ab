"""Reading a torch_dist checkpoint directory (Megatron dist_checkpointing) without a process group.

Shared by mrl's own checkpoints and Megatron-LM's: both write `.metadata` (a pickled torch DCP
Metadata: every tensor's global size, dtype and saved chunks; each chunk's file, byte offset and
length) beside the `__{rank}_{i}.distcp` files. The metadata is unpickled through an allow-list;
a tensor, or its slice at a position along leading (stacked layer / expert) axes, is then read
chunk by chunk by byte range, so memory holds only what is asked for.
"""

from __future__ import annotations

import io
import json
import pickle
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoints_tools.errors import CheckpointError

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
        "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex", "StorageMeta",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "dict", "list", "tuple"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Only the torch.distributed.checkpoint metadata classes (and torch dtypes) may be built."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise CheckpointError(f"checkpoint .metadata refers to {module}.{name}, which a torch_dist metadata never "
                              "holds: refusing to unpickle it (the file is damaged or not trustworthy)")


@dataclass(frozen=True)
class TensorInfo:
    """A checkpoint tensor's global size and dtype (what planning a merge needs, no data)."""

    size: tuple[int, ...]
    dtype: torch.dtype


class TorchDistReader:
    """Chunks of tensors of one torch_dist checkpoint directory, read by byte range."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        backend = json.loads((self.directory / "metadata.json").read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointError(f"{self.directory} was saved with the {backend!r} backend; only torch_dist is "
                                  "read: re-save it with --ckpt-format torch_dist")
        with open(self.directory / ".metadata", "rb") as f:
            self.metadata = _MetadataUnpickler(f).load()
        self._chunks = {k: v for k, v in self.metadata.state_dict_metadata.items() if hasattr(v, "chunks")}
        self.tensors = {k: TensorInfo(tuple(v.size), v.properties.dtype) for k, v in self._chunks.items()}
        # One saved chunk often holds several experts (all of one EP rank's): the experts are read
        # one after another, so each thread keeps the chunk it read last instead of re-reading it.
        self._last = threading.local()

    def check_files(self) -> None:
        """Every .distcp file the metadata names exists and is long enough (before any work)."""
        needed: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, size in sorted(needed.items()):
            path = self.directory / name
            if not path.is_file():
                raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete; restore it")
            if path.stat().st_size < size:
                raise CheckpointError(f"checkpoint file {path} is truncated or damaged: {path.stat().st_size} bytes, "
                                      f"its tensors need {size}; restore it")

    def read(self, key: str, index: tuple[int, ...] = ()) -> torch.Tensor:
        """The global tensor `key`, or its slice at `index` along the leading (stacked) axes."""
        meta = self._chunks[key]
        lead = len(index)
        out = torch.empty(tuple(meta.size)[lead:], dtype=meta.properties.dtype)
        filled = 0
        for chunk in meta.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if not all(o <= i < o + n for i, o, n in zip(index, offsets, sizes)):
                continue
            data = self._chunk(key, chunk.offsets)[tuple(i - o for i, o in zip(index, offsets))]
            out[tuple(slice(o, o + n) for o, n in zip(offsets[lead:], data.shape))] = data
            filled += data.numel()
        if filled != out.numel():
            raise CheckpointError(f"checkpoint tensor {key!r}{list(index) or ''} has chunks covering {filled} of "
                                  f"{out.numel()} elements: the checkpoint is incomplete")
        return out

    def _chunk(self, key: str, offsets: torch.Size) -> torch.Tensor:
        last = getattr(self._last, "chunk", None)
        if last is not None and last[0] == (key, tuple(offsets)):
            return last[1]
        self._last.chunk = None  # drop the previous chunk before reading the next
        data = self._read_chunk(key, offsets)
        self._last.chunk = ((key, tuple(offsets)), data)
        return data

    def _read_chunk(self, key: str, offsets: torch.Size) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.metadata.storage_data[MetadataIndex(key, offsets)]
        if info.transform_descriptors:
            raise CheckpointError(f"{key} is stored with transforms {info.transform_descriptors}: not supported")
        path = self.directory / info.relative_path
        with open(path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        if len(raw) != info.length:
            raise CheckpointError(f"checkpoint file {path} is truncated: {key} needs bytes up to "
                                  f"{info.offset + info.length}; restore the file")
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
