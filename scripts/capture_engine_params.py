"""Capture a vLLM engine's parameter metadata (checkpoint format, this TP rank) for the sync plan's
unit tests: tests/fixtures/engine_params/<arch>.json, one per tiny-zoo architecture.

    PYTHONPATH=. .venv/bin/python scripts/capture_engine_params.py llama qwen2 [...] [--out DIR]
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
    args = parser.parse_args()
    from mrl.models.tiny import write_tiny_model
    from mrl.rollout.vllm_engine import VLLMEngine
    from mrl.sync.plan import hf_metadata

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for arch in args.archs:
        model = write_tiny_model(arch, Path(tempfile.mkdtemp()) / arch)
        engine = VLLMEngine(str(model), dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20)
        meta = {"arch": arch, "workers": engine.parameter_metadata(), "hf": hf_metadata(model)}
        (out / f"{arch}.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        print(arch, len(meta["workers"][0]["params"]), "engine params", file=sys.stderr)
        del engine


if __name__ == "__main__":
    main()
