"""Benchmark mrl-merge: throughput and peak RSS at two checkpoint sizes, beside two baselines.

For random Qwen3-MoE checkpoints of about 1 GB and 3 GB (fp32; written by transformers, converted
with `mrl convert` in EP2 on two local processes), in the same run:
  - merge: `python -m mrl.cli.merge --dtype fp32 --max-shard-size 256MB` (streaming),
    with 1 and 2 workers;
  - copy: a plain read + write + fsync of the same checkpoint files in 64 MB blocks;
  - in-RAM: the same conversion, but every tensor is read first and held, then all are written;
each in a fresh process whose peak RSS is sampled every 5 ms. GB/s = output bytes / seconds.

    .venv/bin/python benchmarks/merge_throughput.py [--sizes-gb 1,3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

MB = 1024**2
SHARD = "256MB"  # output shard size for both merges: the streaming merge holds one shard
BLOCK = 64 * MB


def prepare(workdir: Path, size_gb: float) -> Path:
    """A random HF model of ~size_gb converted into an EP2 checkpoint; cached in workdir."""
    sys.path.insert(0, str(Path(__file__).parent))
    from export_throughput import write_model

    from checkpoints_tools.convert import convert
    from mrl.layout import ParallelLayout

    hf = write_model(workdir, size_gb)
    root = workdir / f"ckpt-{hf.name}"
    if not (root / "latest").exists():
        convert(hf, root, ParallelLayout(ep=2), dtype="fp32", force=True)
    return root


def run_measured(argv: list[str]) -> tuple[float, float, str]:
    """Run argv; return (seconds, peak RSS MB of the process, stdout)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ps, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            peak = max(peak, ps.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.005)
    out = proc.stdout.read()
    if proc.wait(timeout=60) != 0:
        raise RuntimeError(f"{argv} failed with exit code {proc.returncode}")
    return time.perf_counter() - start, peak / MB, out


def plain_copy(src: Path, dst: Path) -> int:
    """Read and write every file of src into dst in 64 MB blocks, fsynced; return bytes."""
    dst.mkdir(parents=True)
    total = 0
    for path in sorted(src.iterdir()):
        if path.is_file():
            with open(path, "rb") as fin, open(dst / path.name, "wb") as fout:
                while block := fin.read(BLOCK):
                    fout.write(block)
                    total += len(block)
                fout.flush()
                os.fsync(fout.fileno())
    return total


def in_ram_merge(ckpt: Path, out: Path) -> int:
    """The naive merge: hold every converted tensor, then write them all; return bytes."""
    import torch

    from checkpoints_tools import merge as m
    from mrl import checkpoint_dir as cd
    from mrl.bridge.mapping import SplitDims

    source = m.open_checkpoint(ckpt)
    dims = SplitDims.of(source.spec)
    held = [t for item in m.plan_items(source.reader, source.spec)
            for t in m.convert_item(source.reader, item, dims, torch.float32)]
    with cd.atomic_dir(out) as tmp:
        writer = m.ShardWriter(tmp, 5 * 10**9)
        for name, tensor in held:
            writer.add(name, tensor)
        writer.finish()
    return writer.total_bytes


def measure(root: Path, workdir: Path) -> dict:
    py = sys.executable
    iteration = root / (root / "latest").read_text().strip()
    ckpt_bytes = sum(p.stat().st_size for p in iteration.iterdir() if p.is_file())
    row = {"checkpoint_gb": round(ckpt_bytes / 1e9, 2)}
    runs = {
        "merge_w1": [py, "-m", "mrl.cli.merge", str(root), "--dtype", "fp32", "--no-progress", "--workers", "1", "--max-shard-size", SHARD],
        "merge_w2": [py, "-m", "mrl.cli.merge", str(root), "--dtype", "fp32", "--no-progress", "--workers", "2", "--max-shard-size", SHARD],
        "copy": [py, __file__, "--_copy", str(iteration)],
        "in_ram": [py, __file__, "--_in_ram", str(root)],
    }
    for name, argv in runs.items():
        out = workdir / f"out-{name}"
        shutil.rmtree(out, ignore_errors=True)
        argv = argv + ["--out", str(out)]
        seconds, rss, stdout = run_measured(argv)
        written = json.loads(stdout.strip().splitlines()[-1])["bytes"]
        row[name] = {"seconds": round(seconds, 2), "gb_s": round(written / 1e9 / seconds, 3), "peak_rss_mb": round(rss)}
        shutil.rmtree(out, ignore_errors=True)
    for name in ("merge_w1", "merge_w2", "in_ram"):
        row[name]["vs_copy"] = round(row[name]["gb_s"] / row["copy"]["gb_s"], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-gb", default="1,3")
    parser.add_argument("--workdir", default="/tmp/mrl-merge-bench")
    parser.add_argument("--_copy", help=argparse.SUPPRESS)
    parser.add_argument("--_in_ram", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._copy:  # child processes of the baselines
        print(json.dumps({"bytes": plain_copy(Path(args._copy), Path(args.out))}))
        return
    if args._in_ram:
        print(json.dumps({"bytes": in_ram_merge(Path(args._in_ram), Path(args.out))}))
        return
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for size in (float(s) for s in args.sizes_gb.split(",")):
        root = prepare(workdir, size)
        print(json.dumps({"size_gb": size, **measure(root, workdir)}), flush=True)


if __name__ == "__main__":
    main()
