"""Read slices of tensors from a HuggingFace safetensors checkpoint without loading whole files.

DeepSeek-style FP8 checkpoints (config.json `quantization_config`, mrl/quant/fp8.py) read as their
dequantised weights: a float8 weight and its `<name>_scale_inv` appear as one tensor `<name>`, and
a read dequantises just the rows and columns it asks for, so memory stays at one slice.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from mrl.bridge.mapping import Segment
from mrl.quant.fp8 import SCALE_SUFFIX, BlockFp8, block_fp8_of, check_scale, dequantize


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
        config = self.directory / "config.json"
        self.fp8: BlockFp8 | None = block_fp8_of(json.loads(config.read_text())) if config.exists() else None
        # FP8 weight name → its scale's name; the scales are read with their weights, never alone.
        self.scales = {
            name.removesuffix(SCALE_SUFFIX): name for name in self.files
            if self.fp8 and name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in self.files
        }

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
        """The model's tensors: FP8 scales are part of their weights, not names of their own."""
        scales = set(self.scales.values())
        return [name for name in self.files if name not in scales]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(name).get_slice(name).get_shape())

    def _dtype(self, name: str) -> str:
        return self._open(name).get_slice(name).get_dtype()  # safetensors' spelling: "F8_E4M3", "F32"

    def read(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole tensor: an FP8 weight dequantised to `dtype`, any other tensor as stored."""
        if name in self.scales:
            return dequantize(self._open(name).get_tensor(name), self._scale(name), self.fp8.block, dtype)
        return self._open(name).get_tensor(name)

    def read_segment(self, seg: Segment, trailing: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The rows (and columns) a segment names; zero rows for a padding segment. An FP8 weight's
        rows come dequantised to `dtype` (other tensors keep the file's dtype)."""
        if seg.hf is None:
            return torch.zeros((seg.rows, *trailing), dtype=dtype)
        sliced = self._open(seg.hf).get_slice(seg.hf)
        first_col, stop_col = seg.cols or (0, None)
        window = sliced[seg.start : seg.stop] if seg.cols is None else sliced[seg.start : seg.stop, first_col:stop_col]
        if seg.hf not in self.scales:
            return window
        return dequantize(window, self._scale(seg.hf), self.fp8.block, dtype, offset=(seg.start, first_col))

    def check_quantized(self) -> None:
        """Every float8 tensor has a float32 scale_inv on its block grid, and config.json declares
        the format; raises CheckpointError naming the first tensor that does not."""
        for name in self.names():
            if name in self.scales:
                self._checked_scale_name(name)
            elif self._dtype(name).startswith("F8"):
                raise CheckpointError(
                    f"tensor {name!r} is stored as {self._dtype(name)} but "
                    + ("config.json has no quantization_config: add DeepSeek's (quant_method fp8, weight_block_size "
                       "[128, 128]) or dequantise the checkpoint." if self.fp8 is None
                       else f"the checkpoint has no {name}{SCALE_SUFFIX}: a shard file is missing or incomplete.")
                )

    def _scale(self, name: str) -> torch.Tensor:
        scale = self._checked_scale_name(name)
        return self._open(scale).get_tensor(scale)

    def _checked_scale_name(self, name: str) -> str:
        """The name of FP8 weight `name`'s scale_inv, once its dtypes and block grid are checked."""
        scale = self.scales[name]
        if self._dtype(name) != "F8_E4M3" or self._dtype(scale) != "F32":
            raise CheckpointError(
                f"{scale} ({self._dtype(scale)}) scales {name!r} ({self._dtype(name)}): DeepSeek's FP8 format "
                "stores F8_E4M3 weights with F32 scales; the checkpoint is not in that format."
            )
        check_scale(name, self.shape(name), self.shape(scale), self.fp8.block)
        return scale
