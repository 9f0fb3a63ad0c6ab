"""Start-up costs the test suite and every run pay: a vLLM engine's start, and a local launch's ranks.

- engine: `VLLMEngine` of a tiny model, one worker, with vLLM's `uni` executor (mrl's default for
  one worker: the worker runs in the engine's process) against `mp` (a worker process), each start
  in a fresh process, alternated; seconds from the constructor's call to its return, and the
  tokens of one seeded generate (the same for both).
- local launch: `run_local` of `initialize_layout` on 2 and on 4 ranks, twice in one process (the
  first call starts the fork server, which imports torch, Megatron-core and transformers once),
  against what each spawned rank paid before the fork server: N spawned processes that import
  those modules, all at once.

    PYTHONPATH=. .venv/bin/python benchmarks/startup.py [--repeats 2] [--arch qwen3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def engine_start(model: str, backend: str) -> dict:
    """In this (fresh) process: start one engine, generate once."""
    from mrl.rollout.engine import SamplingSettings
    from mrl.rollout.vllm_engine import VLLMEngine

    start = time.monotonic()
    engine = VLLMEngine(model, dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20,
                        distributed_executor_backend=backend)
    took = time.monotonic() - start
    out = engine.generate(["1+2="], SamplingSettings(n=2, max_tokens=8, temperature=1.0, seed=0))
    engine.shutdown()
    return {"backend": backend, "start_s": round(took, 2), "tokens": [g.token_ids for g in out[0]]}


def _layout(rank: int, world: int, layout) -> float:
    from mrl.megatron.parallel import initialize_layout

    start = time.monotonic()
    initialize_layout(layout)
    return time.monotonic() - start


def _import_rank_modules() -> None:
    import mrl.megatron.rank_imports  # noqa: F401


def local_launches() -> dict:
    """In this (fresh) process: spawned imports as before, then run_local twice per world size."""
    from mrl.layout import ParallelLayout
    from mrl.megatron.local_launch import run_local

    result = {}
    for world, layout in ((2, ParallelLayout(tp=2)), (4, ParallelLayout(tp=2, ep=2))):
        start = time.monotonic()
        spawned = [multiprocessing.get_context("spawn").Process(target=_import_rank_modules) for _ in range(world)]
        for process in spawned:
            process.start()
        for process in spawned:
            process.join()
        result[f"spawned_imports_{world}_ranks_s"] = round(time.monotonic() - start, 2)
        for call in ("first", "second"):
            start = time.monotonic()
            run_local(_layout, world, layout, timeout_s=300)
            result[f"run_local_{world}_ranks_{call}_s"] = round(time.monotonic() - start, 2)
    return result


def _in_fresh_process(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # one measurement in this fresh process
        value = engine_start(*args.child[1:]) if args.child[0] == "engine" else local_launches()
        print(json.dumps(value))
        return
    from mrl.models.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_model(args.arch, Path(tmp) / args.arch))
        for _ in range(args.repeats):
            for backend in ("mp", "uni"):
                print(json.dumps(_in_fresh_process("--child", "engine", model, backend)), flush=True)
        for _ in range(args.repeats):
            print(json.dumps(_in_fresh_process("--child", "launch")), flush=True)


if __name__ == "__main__":
    main()
