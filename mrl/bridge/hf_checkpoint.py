"""Read slices of tensors from a HuggingFace safetensors checkpoint without loading whole files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from mrl.bridge.mapping import Segment


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; the message names the tensor and the fix."""


class HFCheckpoint:
    """Tensor names, shapes and sliced reads across the safetensors files of one HF directory."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.directory / file for name, file in weight_map.items()}
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise CheckpointError(
                    f"no *.safetensors files in {self.directory}: pass a HuggingFace model directory "
                    "(convert .bin checkpoints to safetensors first)."
                )
            self.files = {}
            for file in files:
                with safe_open(file, framework="pt") as f:
                    self.files.update(dict.fromkeys(f.keys(), file))
        self._handles: dict[Path, object] = {}

    def _open(self, name: str):
        if name not in self.files:
            raise CheckpointError(f"checkpoint {self.directory} lacks tensor {name!r}.")
        file = self.files[name]
        if file not in self._handles:
            if not file.exists():
                raise CheckpointError(f"{file} is listed in the index but missing: re-download the checkpoint.")
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]

    def names(self) -> list[str]:
        return list(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(name).get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        return self._open(name).get_tensor(name)

    def read_segment(self, seg: Segment, trailing: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The rows (and columns) a segment names; zero rows for a padding segment."""
        if seg.hf is None:
            return torch.zeros((seg.rows, *trailing), dtype=dtype)
        sliced = self._open(seg.hf).get_slice(seg.hf)
        if seg.cols is None:
            return sliced[seg.start : seg.stop]
        return sliced[seg.start : seg.stop, seg.cols[0] : seg.cols[1]]
