"""An FP8 HF checkpoint → its dequantised twin: what DeepSeek's `inference/fp8_cast_bf16.py` does,
for any DeepSeek-style FP8 directory (`mrl convert fp8-to-hf`, and the reference model of
`mrl verify` on an FP8 checkpoint).

Shard by shard, as in the source: each output file holds the source file's tensors, FP8 weights
dequantised (float32 product, one cast to the target dtype) and their scales dropped, the rest
unchanged. Peak memory is one output shard. Writes into a temporary sibling, renamed at the end.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from mrl import checkpoint_dir as cd
from mrl.bridge.hf_checkpoint import CheckpointError, HFCheckpoint


def write_dequantized(src: str | Path, out: str | Path, dtype: torch.dtype = torch.bfloat16,
                      force: bool = False) -> dict:
    """Write the dequantised twin of FP8 checkpoint `src` to `out`; return a summary."""
    ckpt = HFCheckpoint(src)
    if ckpt.fp8 is None:
        raise CheckpointError(f"{src} is not an FP8 checkpoint (config.json has no quantization_config): nothing to dequantise.")
    ckpt.check_quantized()
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists: pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        weight_map, total = _write_shards(ckpt, staging, dtype)
        if len(set(weight_map.values())) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        cd.copy_hf_metadata(ckpt.directory, staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"out": str(out), "dtype": str(dtype).removeprefix("torch."), "tensors": len(weight_map),
            "dequantised": len(ckpt.scales), "bytes": total}


def _write_shards(ckpt: HFCheckpoint, directory: Path, dtype: torch.dtype) -> tuple[dict[str, str], int]:
    """One output file per source file; returns (tensor name → file name, bytes written)."""
    by_file: dict[Path, list[str]] = {}
    for name in ckpt.names():
        by_file.setdefault(ckpt.files[name], []).append(name)
    weight_map, total = {}, 0
    for file, names in sorted(by_file.items()):
        tensors = {name: ckpt.read(name, dtype) for name in names}
        save_file(tensors, str(directory / file.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file.name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    return weight_map, total
