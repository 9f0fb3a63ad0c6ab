"""FP8 twins of an HF checkpoint, in DeepSeek's block format.

- `write_dequantized`: an FP8 checkpoint → its dequantised twin, what DeepSeek's
  `inference/fp8_cast_bf16.py` does, for any DeepSeek-style FP8 directory (`mrl convert
  fp8-to-hf`, and the reference model of `mrl verify` on an FP8 checkpoint): FP8 weights
  dequantised (float32 product, one cast to the target dtype) and their scales dropped.
- `write_quantized`: an unquantised checkpoint → its block-FP8 twin (`mrl convert hf-to-fp8`, and
  the engine's checkpoint for `rollout.quantization: fp8`): the decoder's linear projections
  quantised (mrl.quant.fp8, 128×128 blocks) with their float32 scales beside them, config.json
  given DeepSeek's `quantization_config`.

Shard by shard, as in the source: each output file holds the source file's tensors, the rest
unchanged. Peak memory is one output shard. Writes into a temporary sibling, renamed at the end.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from mrl import checkpoint_dir as cd
from mrl.atomic import open_modes
from mrl.bridge.hf_checkpoint import CheckpointError, HFCheckpoint
from mrl.quant.fp8 import QUANTIZATION_CONFIG, quantize_pairs

Shard = Callable[[list[str]], dict[str, torch.Tensor]]  # a source file's tensor names → the twin's tensors


def write_dequantized(src: str | Path, out: str | Path, dtype: torch.dtype = torch.bfloat16,
                      force: bool = False) -> dict:
    """Write the dequantised twin of FP8 checkpoint `src` to `out`; return a summary."""
    ckpt = HFCheckpoint(src)
    if ckpt.fp8 is None:
        raise CheckpointError(f"{src} is not an FP8 checkpoint (config.json has no quantization_config): nothing to dequantise.")
    ckpt.check_quantized()
    weight_map, total = _write_twin(ckpt, out, force, lambda names: {n: ckpt.read(n, dtype) for n in names})
    return {"out": str(out), "dtype": str(dtype).removeprefix("torch."), "tensors": len(weight_map),
            "dequantised": len(ckpt.scales), "bytes": total}


def write_quantized(src: str | Path, out: str | Path, force: bool = False) -> dict:
    """Write the block-FP8 twin of unquantised checkpoint `src` to `out`; return a summary."""
    ckpt = HFCheckpoint(src)
    if ckpt.fp8 is not None:
        raise CheckpointError(f"{src} is already FP8 (config.json has quantization_config): nothing to quantise.")
    weight_map, total = _write_twin(ckpt, out, force, lambda names: dict(quantize_pairs((n, ckpt.read(n)) for n in names)),
                                    quantization=QUANTIZATION_CONFIG)
    quantised = sum(1 for name in weight_map if name.endswith("_scale_inv"))
    return {"out": str(out), "tensors": len(weight_map), "quantised": quantised, "bytes": total}


def _write_twin(ckpt: HFCheckpoint, out: str | Path, force: bool, shard: Shard,
                quantization: dict | None = None) -> tuple[dict[str, str], int]:
    """`shard`'s tensors of each source file into a file of the same name, the index and the
    metadata beside them (config.json with `quantization`, else without any), all at once."""
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists: pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        weight_map, total = _write_shards(ckpt, staging, shard)
        if len(set(weight_map.values())) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        cd.copy_hf_metadata(ckpt.directory, staging)
        if quantization is not None:
            config = json.loads((staging / "config.json").read_text())
            config["quantization_config"] = dict(quantization)
            (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        open_modes(staging)  # mkdtemp's 0700 and safetensors' 0600: the modes the umask gives instead
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return weight_map, total


def _write_shards(ckpt: HFCheckpoint, directory: Path, shard: Shard) -> tuple[dict[str, str], int]:
    """One output file per source file; returns (tensor name → file name, bytes written)."""
    by_file: dict[Path, list[str]] = {}
    for name in ckpt.names():
        by_file.setdefault(ckpt.files[name], []).append(name)
    weight_map, total = {}, 0
    for file, names in sorted(by_file.items()):
        tensors = shard(names)
        save_file(tensors, str(directory / file.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file.name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    return weight_map, total
