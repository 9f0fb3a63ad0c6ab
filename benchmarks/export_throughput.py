"""Benchmark the Megatron → HF export stream against a plain copy and a naive gather-then-convert.

For each layout (TP2, PP2, EP2 on two local gloo processes) and a ~1 GB Qwen3-MoE checkpoint:
  - export: `export_hf_weights` with 512 MB and 64 MB buckets, GB/s on the destination rank;
  - copy: a plain in-memory copy of the same number of bytes on the destination rank (memory bandwidth);
  - p2p: the same bytes sent rank 1 → rank 0 over gloo in 64 MB messages (the transport's limit);
  - naive: every rank sends its whole state dict to rank 0, which holds it all and converts;
and peak extra RSS per rank in each phase (sampled every 2 ms above the phase's starting RSS).

    .venv/bin/python benchmarks/export_throughput.py [--size-gb 1.0] [--layouts tp2,pp2,ep2] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local

LAYOUTS = {"tp2": ParallelLayout(tp=2), "pp2": ParallelLayout(pp=2), "ep2": ParallelLayout(ep=2)}
MB = 1024**2


def write_model(workdir: Path, size_gb: float) -> Path:
    """A random Qwen3-MoE HF checkpoint of about size_gb (fp32), cached in workdir."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # fp32 bytes measured: 0.26 GB of embedding + LM head, 0.111 GB a layer; an even count, for PP2
    layers = 2 * max(1, round((size_gb - 0.26) / 0.111 / 2))
    path = workdir / f"qwen3-moe-{layers}l"
    if (path / "config.json").exists():
        return path
    config = AutoConfig.for_model(
        "qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=1024, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, num_hidden_layers=layers, intermediate_size=2048,
        moe_intermediate_size=512, num_experts=16, num_experts_per_tok=2, norm_topk_prob=True,
        vocab_size=32000, tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, max_shard_size="2GB")
    return path


@contextmanager
def peak_rss(out: dict, key: str):
    """Record in out[key] the peak RSS above the RSS at entry, in MB."""
    process, stop, peak = psutil.Process(), threading.Event(), [0]
    start = process.memory_info().rss

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss - start)
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        out[key] = round(peak[0] / MB, 1)


def _timed_export(built, coords, bucket_bytes: int) -> tuple[float, int, int]:
    """Seconds, total bytes and the largest tensor's bytes of one export (on the destination)."""
    from mrl.bridge.export import export_hf_weights

    dist.barrier()
    start, total, largest = time.perf_counter(), 0, 0
    for bucket in export_hf_weights(built, coords, bucket_bytes=bucket_bytes):
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        total, largest = total + sum(sizes), max([largest, *sizes])
        del bucket  # a consumer that keeps the previous bucket doubles the peak
    dist.barrier()
    return time.perf_counter() - start, total, largest


def _naive_export(built, coords) -> tuple[float, int]:
    """Baseline: rank 0 receives every rank's full state dict, holds it, then converts it all."""
    from mrl.bridge.export import _assemble, build_plan
    from mrl.bridge.local_tensors import local_tensors
    from mrl.bridge.mapping import SplitDims

    dist.barrier()
    start = time.perf_counter()
    tensors = local_tensors(built, coords)
    plan = build_plan(tensors, coords)
    by_name = {t.name: t for t in tensors}
    received, works = {}, []
    for item in plan:
        for source, shard in item.sources:
            if coords.rank == 0:
                if source == 0:
                    received[item.name, shard] = by_name[item.name].tensor.detach().clone()
                else:
                    received[item.name, shard] = torch.empty(item.local_shape, dtype=item.dtype)
                    works.append(dist.irecv(received[item.name, shard], src=source))
            elif source == coords.rank:
                works.append(dist.isend(by_name[item.name].tensor.detach().contiguous(), 0))
    for work in works:
        work.wait()
    total = 0
    if coords.rank == 0:
        dims = SplitDims.of(built.spec)
        state = [pair for item in plan for pair in _assemble(item, received, dims)]  # whole model at once
        total = sum(t.numel() * t.element_size() for _, t in state)
        del state
    dist.barrier()
    return time.perf_counter() - start, total


def copy_and_p2p(nbytes: int, repeats: int = 3) -> tuple[float, float]:
    """Best GB/s of an in-memory copy on rank 0 and of rank 1 → rank 0 gloo sends, for nbytes.

    Both write into preallocated buffers, so they measure the memory and transport limits
    without allocation or page-fault cost (which the export pays).
    """
    chunk = 64 * MB
    source, target = torch.ones(chunk, dtype=torch.uint8), torch.zeros(chunk, dtype=torch.uint8)
    count = nbytes // chunk
    copy_time = p2p_time = float("inf")
    for _ in range(repeats):
        if dist.get_rank() == 0:
            start = time.perf_counter()
            for _ in range(count):
                target.copy_(source)
            copy_time = min(copy_time, time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(count):
            if dist.get_rank() == 0:
                dist.recv(target, src=1)
            elif dist.get_rank() == 1:
                dist.send(source, dst=0)
        dist.barrier()
        p2p_time = min(p2p_time, time.perf_counter() - start)
    gb = count * chunk / 1e9
    return gb / max(copy_time, 1e-9), gb / p2p_time


def _bench(rank: int, world_size: int, hf_dir: str, layout: ParallelLayout, repeats: int) -> dict:
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import initialize_layout
    from mrl.models.registry import model_spec_from_hf

    coords = initialize_layout(layout)
    built = build_model(model_spec_from_hf(hf_dir), layout)
    load_hf_weights(built, coords, hf_dir)
    result: dict = {"rank": rank}
    for label, bucket in (("export_512MB", 512 * MB), ("export_64MB", 64 * MB)):
        best = None
        for _ in range(repeats):
            with peak_rss(result, f"{label}_rss_mb"):
                seconds, total, largest = _timed_export(built, coords, bucket)
            best = seconds if best is None else min(best, seconds)
        result[label] = {"seconds": best, "bytes": total}
        result["largest_tensor_mb"] = largest / MB
    with peak_rss(result, "naive_rss_mb"):
        seconds, total = _naive_export(built, coords)
    result["naive"] = {"seconds": seconds, "bytes": total}
    exported = result["export_512MB"]["bytes"]
    exported = torch.tensor([exported])
    dist.broadcast(exported, 0)
    result["copy_gbps"], result["p2p_gbps"] = copy_and_p2p(int(exported.item()))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--layouts", default="tp2,pp2,ep2")
    parser.add_argument("--workdir", default=None, help="where the checkpoint is cached (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=2, help="export runs per bucket size; the best is kept")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="mrl-bench-"))
    hf_dir = write_model(workdir, args.size_gb)
    rows = []
    for name in args.layouts.split(","):
        ranks = run_local(_bench, 2, str(hf_dir), LAYOUTS[name], args.repeats, timeout_s=1800)
        root = ranks[0]
        gb = root["export_512MB"]["bytes"] / 1e9
        row = {"layout": name.upper(), "GB": round(gb, 3), "memcpy_GB/s": round(root["copy_gbps"], 2),
               "gloo_p2p_GB/s": round(root["p2p_gbps"], 2)}
        for label in ("export_512MB", "export_64MB", "naive"):
            gbps = gb / root[label]["seconds"]
            row[f"{label}_GB/s"] = round(gbps, 2)
            row[f"{label}/p2p"] = round(gbps / root["p2p_gbps"], 2)
            row[f"{label}/memcpy"] = round(gbps / root["copy_gbps"], 2)
            row[f"{label}_peak_extra_rss_MB"] = [r.get(f"{label}_rss_mb") for r in ranks]
        row["largest_tensor_MB"] = round(root["largest_tensor_mb"], 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"checkpoint": str(hf_dir), "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
