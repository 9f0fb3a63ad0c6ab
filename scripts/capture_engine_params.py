"""Capture a vLLM engine's parameter metadata (checkpoint format, this TP rank) for the sync plan's
unit tests: tests/fixtures/engine_params/<arch>.json, one per tiny-zoo architecture; with
--expert-parallel N, an expert-parallel engine of N workers: <arch>_ep<N>.json.

    PYTHONPATH=. .venv/bin/python scripts/capture_engine_params.py llama qwen2 [...] [--out DIR]
    PYTHONPATH=. .venv/bin/python scripts/capture_engine_params.py qwen3_moe deepseek_v3 --expert-parallel 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("archs", nargs="+")
    parser.add_argument("--out", default="tests/fixtures/engine_params")
    parser.add_argument("--expert-parallel", type=int, default=0, metavar="N",
                        help="capture a TP N engine with vLLM's expert parallelism (MoE models)")
    args = parser.parse_args()
    from mrl.models.tiny import write_tiny_model
    from mrl.rollout.vllm_engine import VLLMEngine
    from mrl.sync.plan import hf_metadata

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for arch in args.archs:
        model = write_tiny_model(arch, Path(tempfile.mkdtemp()) / arch)
        ep = args.expert_parallel
        engine = VLLMEngine(str(model), dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20,
                            tensor_parallel_size=max(ep, 1), expert_parallel=ep > 1)
        meta = {"arch": arch, "workers": engine.parameter_metadata(), "hf": hf_metadata(model)}
        (out / f"{arch}{f'_ep{ep}' if ep > 1 else ''}.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        print(arch, len(meta["workers"][0]["params"]), "engine params", file=sys.stderr)
        engine.shutdown()
        del engine


if __name__ == "__main__":
    main()
