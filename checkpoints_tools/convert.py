"""A HuggingFace directory → an mrl checkpoint (docs/checkpoint-format.md); the library behind
`mrl convert hf-to-mcore` (mrl/cli/convert.py).

Starts the layout's processes locally (gloo on CPU), builds the model, streams each rank's slices
from the safetensors files (mrl.bridge.hf_import) and saves the model's sharded state dict with
Megatron dist_checkpointing (torch_dist) as step 0 of a checkpoint root, model only. Training can
then start from any HF model in any layout, and `mrl-merge` turns the checkpoint back into HF.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from mrl import checkpoint_dir as cd
from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local
from mrl.models.registry import model_spec_from_hf

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
copy_hf_metadata = cd.copy_hf_metadata  # the name tests and older callers import from here


def save_model_checkpoint(hf_dir: str, layout: ParallelLayout, dtype: torch.dtype, directory: str) -> int:
    """On every rank of an initialised world: build `layout`, load HF weights, save torch_dist.

    Returns the bytes this rank read. Megatron's process groups are torn down afterwards, so one
    world can convert into several layouts in turn.
    """
    from megatron.core import dist_checkpointing

    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.checkpoint import model_sharded_state_dict
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import destroy_layout, initialize_layout

    coords = initialize_layout(layout)
    try:
        built = build_model(model_spec_from_hf(hf_dir), layout, params_dtype=dtype)
        read = load_hf_weights(built, coords, hf_dir)
        dist_checkpointing.save({"model": model_sharded_state_dict(built)}, directory)  # default strategy: torch_dist
    finally:
        destroy_layout()
    return read


def _save_worker(rank: int, world_size: int, hf_dir: str, layout: ParallelLayout, dtype: torch.dtype,
                 tmp_dir: str) -> int:
    return save_model_checkpoint(hf_dir, layout, dtype, tmp_dir)


def checkpoint_manifest(arch: str, layout: ParallelLayout, dtype: torch.dtype) -> dict:
    """Manifest fields of a model-only step-0 checkpoint (files are added by atomic_dir)."""
    return {
        "step": 0, "arch": arch, "params_dtype": str(dtype).removeprefix("torch."),
        "layout": {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "etp": layout.etp, "vpp": layout.vpp,
                   "cp": layout.cp},
        "contents": ["model"],
    }


def convert(hf_dir: str | Path, out: str | Path, layout: ParallelLayout, *, dtype: str = "fp32",
            force: bool = False) -> dict:
    """Write step 0 of checkpoint root `out` from `hf_dir` in `layout`; return a summary."""
    hf_dir, root = Path(hf_dir), Path(out)
    spec = model_spec_from_hf(hf_dir)
    world = layout.min_world_size()
    layout.validate(spec.dims, world)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    target = root / cd.iter_name(0)
    if root.exists() and any(not p.name.startswith(cd.TMP_PREFIX) for p in root.iterdir()):
        if not force:
            raise FileExistsError(f"{root} already exists and is not empty: pass --force to replace it")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    cd.remove_stale_tmp(root)
    start = time.perf_counter()
    manifest = checkpoint_manifest(spec.arch, layout, DTYPES[dtype])
    with cd.atomic_dir(target, manifest=manifest) as tmp:
        # dist_checkpointing expects an empty directory, so hf/ is copied after the save.
        bytes_read = sum(run_local(_save_worker, world, str(hf_dir), layout, DTYPES[dtype], str(tmp)))
        copy_hf_metadata(hf_dir, tmp / "hf")
    cd.write_latest(root, target.name)
    return {"checkpoint": str(target), "arch": spec.arch, "layout": layout.describe(), "world_size": world,
            "bytes_read": bytes_read, "seconds": round(time.perf_counter() - start, 2)}
