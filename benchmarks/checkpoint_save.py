"""Benchmark training-checkpoint saves: sync vs async, beside a plain write of the same bytes.

A ~1 GB (fp32 weights) llama-shaped model with random weights in TP2 on two local gloo processes,
one Adam step so the optimizer state exists (the checkpoint holds weights + two Adam moments,
about 3x the weight bytes). For each mode, best of --repeats:
  - sync: the time `save_checkpoint` blocks (it returns when the checkpoint is durable);
  - async: the time the call blocks the training loop (snapshot + planning) and the time until the
    checkpoint is durable and published (`wait()` returned);
  - plain: every rank writes the same number of bytes as its checkpoint files with write + fsync
    into the same directory (the disk's limit for this volume of data);
  - checksum: each rank hashes (xxh3-64) the shards it wrote, as the save does right after writing
    them (from the page cache): its share of the sync save; verify: one process checks every file
    of the checkpoint against its manifest, as merge and a resume do before they read it.

    .venv/bin/python benchmarks/checkpoint_save.py [--layers 6] [--repeats 2] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local
from mrl.models.tiny import tiny_hf_config


def write_config(out: Path, layers: int) -> Path:
    """config.json of a llama-shaped model: hidden 1536, FFN 4096, vocab 32000 (no weights)."""
    config = tiny_hf_config("llama") | dict(
        hidden_size=1536, intermediate_size=4096, num_hidden_layers=layers, num_attention_heads=12,
        num_key_value_heads=4, head_dim=128, vocab_size=32000, tie_word_embeddings=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _plain_write(directory: Path, nbytes: int, rank: int) -> float:
    payload = torch.empty(nbytes, dtype=torch.uint8).numpy()  # untouched pages: written, not copied in
    payload[:: 4096] = 1
    start = time.perf_counter()
    path = directory / f"plain_{rank}.bin"
    with open(path, "wb") as f:
        f.write(memoryview(payload))
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def _bench(rank: int, world: int, hf_dir: str, workdir: str, repeats: int) -> dict:
    from mrl import checkpoint_dir as cd
    from mrl.megatron.checkpoint import _rank_checksums, save_checkpoint
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import initialize_layout
    from mrl.megatron.training import OptimConfig, lm_micro_batches, make_trainable, train_step
    from mrl.models.registry import model_spec_from_hf

    layout = ParallelLayout(tp=2)
    initialize_layout(layout)
    spec = model_spec_from_hf(hf_dir)
    built = build_model(spec, layout)
    weight_bytes = sum(p.numel() * p.element_size() for c in built.chunks for p in c.parameters())
    trainable = make_trainable(built, OptimConfig(lr=1e-4))
    tokens = torch.randint(0, spec.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0))
    train_step(trainable, lm_micro_batches(tokens, layout.tp))
    root = Path(workdir) / "ckpt"
    result = {"weight_bytes_rank": weight_bytes, "sync_s": [], "async_block_s": [], "async_durable_s": [],
              "plain_s": [], "checksum_s": [], "verify_s": []}
    step = 0
    for _ in range(repeats):
        step += 1
        torch.distributed.barrier()
        start = time.perf_counter()
        save_checkpoint(root, trainable, step=step)
        result["sync_s"].append(time.perf_counter() - start)
        torch.distributed.barrier()
        start = time.perf_counter()
        _rank_checksums(root / f"iter_{step:07d}")
        result["checksum_s"].append(time.perf_counter() - start)
        torch.distributed.barrier()
        start = time.perf_counter()
        if rank == 0:
            cd.verify_checksums(root / f"iter_{step:07d}", cd.read_manifest(root / f"iter_{step:07d}"))
        result["verify_s"].append(time.perf_counter() - start)
        step += 1
        torch.distributed.barrier()
        start = time.perf_counter()
        pending = save_checkpoint(root, trainable, step=step, async_save=True)
        result["async_block_s"].append(time.perf_counter() - start)
        pending.wait()
        result["async_durable_s"].append(time.perf_counter() - start)
        directory = root / f"iter_{step:07d}"
        own = sum(f.stat().st_size for f in directory.glob(f"__{rank}_*.distcp"))
        result["checkpoint_bytes_rank"] = own
        torch.distributed.barrier()
        result["plain_s"].append(_plain_write(Path(workdir), own, rank))
        torch.distributed.barrier()
        if rank == 0:
            for old in sorted(root.glob("iter_*"))[:-1]:
                shutil.rmtree(old)
        torch.distributed.barrier()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="mrl-ckpt-bench-"))
    hf_dir = write_config(workdir / "hf", args.layers)
    per_rank = run_local(_bench, 2, str(hf_dir), str(workdir), args.repeats, timeout_s=1800)
    total_ckpt = sum(r["checkpoint_bytes_rank"] for r in per_rank)
    worst = {key: min(max(r[key][i] for r in per_rank) for i in range(args.repeats))
             for key in ("sync_s", "async_block_s", "async_durable_s", "plain_s", "checksum_s", "verify_s")}
    # (the slowest rank, the best repeat)
    summary = {
        "weights_gb": round(sum(r["weight_bytes_rank"] for r in per_rank) / 1e9, 3),
        "checkpoint_gb": round(total_ckpt / 1e9, 3),
        **{k: round(v, 3) for k, v in worst.items()},
        "sync_gb_per_s": round(total_ckpt / 1e9 / worst["sync_s"], 3),
        "plain_gb_per_s": round(total_ckpt / 1e9 / worst["plain_s"], 3),
        "checksum_share_of_sync_save": round(worst["checksum_s"] / worst["sync_s"], 4),
        "verify_over_sync_save": round(worst["verify_s"] / worst["sync_s"], 4),
    }
    print(json.dumps(summary))
    shutil.rmtree(workdir / "ckpt", ignore_errors=True)


if __name__ == "__main__":
    main()
