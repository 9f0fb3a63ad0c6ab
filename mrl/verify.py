"""`mrl verify`: prove that a HuggingFace checkpoint means the same thing in a Megatron layout.

With `--rollout vllm` it proves the weight sync instead (mrl/launch/verify_rollout.py).

1. Load the checkpoint into Megatron in the requested layout (local processes, gloo on CPU).
2. Run probe token ids through the pipeline and compare logits with transformers in fp32.
3. Export the Megatron shards back to HF tensors and compare each with the file, bitwise.
Prints a JSON summary; exits 0 when both checks pass, 1 when one fails, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from mrl.layout import LayoutError, ParallelLayout
from mrl.megatron.local_launch import WorkerError, run_local
from mrl.models.registry import UnsupportedModelError, model_spec_from_hf

PROBE_SEED = 1234
PROBE_SHAPE = (2, 16)  # sequences × tokens


def probe_tokens(vocab_size: int) -> torch.Tensor:
    """Token ids drawn with a fixed seed: any checkpoint works, with or without a tokenizer."""
    generator = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab_size, PROBE_SHAPE, generator=generator)


def _worker(rank: int, world_size: int, hf_dir: str, layout: ParallelLayout, impl: str, bucket_bytes: int) -> dict:
    from mrl.bridge.export import export_hf_weights
    from mrl.bridge.hf_checkpoint import HFCheckpoint
    from mrl.bridge.hf_import import ignorable, load_hf_weights
    from mrl.megatron.forward import forward_logits
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import initialize_layout

    coords = initialize_layout(layout)
    spec = model_spec_from_hf(hf_dir)
    built = build_model(spec, layout, transformer_impl=impl)
    load_hf_weights(built, coords, hf_dir)
    logits = forward_logits(built, probe_tokens(spec.vocab_size))
    result: dict[str, Any] = {"logits": logits if logits is not None and coords.tp == 0 and coords.dp == 0 else None}

    ckpt = HFCheckpoint(hf_dir) if rank == 0 else None
    compared, mismatches, seen = 0, [], set()
    start = time.perf_counter()
    for bucket in export_hf_weights(built, coords, bucket_bytes=bucket_bytes):
        for name, tensor in bucket:
            seen.add(name)
            if name not in ckpt.files:
                mismatches.append(f"{name}: exported but not in the checkpoint")
                continue
            original = ckpt.read(name)
            compared += 1
            if tensor.shape != original.shape or not torch.equal(tensor.to(original.dtype), original):
                mismatches.append(name)
    if rank == 0:
        missing = sorted(n for n in ckpt.files if n not in seen and not ignorable(n, spec))
        result["export"] = {
            "tensors_compared": compared,
            "mismatches": mismatches,
            "missing": missing,
            "export_and_compare_seconds": round(time.perf_counter() - start, 3),
        }
    return result


def reference_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def verify(hf_dir: str, layout: ParallelLayout, *, tol: float = 1e-4, transformer_impl: str = "auto",
           bucket_bytes: int = 512 * 1024**2) -> dict[str, Any]:
    """Run both checks and return the summary (raises LayoutError/UnsupportedModelError on bad input)."""
    spec = model_spec_from_hf(hf_dir)
    world_size = layout.min_world_size()
    layout.validate(spec.dims, world_size)
    start = time.perf_counter()
    results = run_local(_worker, world_size, hf_dir, layout, transformer_impl, bucket_bytes)
    megatron_logits = next(r["logits"] for r in results if r["logits"] is not None)
    diff = (megatron_logits - reference_logits(hf_dir, probe_tokens(spec.vocab_size))).abs().max().item()
    export = results[0]["export"]
    export["ok"] = not export["mismatches"] and not export["missing"]
    summary = {
        "model": hf_dir,
        "arch": spec.arch,
        "layout": layout.describe(),
        "world_size": world_size,
        "logits": {"max_abs_diff": diff, "tol": tol, "ok": diff <= tol},
        "export": export,
        "seconds": round(time.perf_counter() - start, 1),
    }
    summary["ok"] = summary["logits"]["ok"] and export["ok"]
    return summary


def parse_layout(args: argparse.Namespace) -> ParallelLayout:
    return ParallelLayout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, vpp=args.vpp)


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size")
    parser.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per stage")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mrl verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", required=True, help="HuggingFace model directory (config.json + safetensors)")
    add_layout_arguments(parser)
    parser.add_argument("--tol", type=float, default=None,
                        help="max |logit diff| vs transformers (default 1e-4, fp32); with --rollout, max "
                             "|logprob diff| vLLM vs Megatron after the sync (default 2e-2, bf16-safe)")
    parser.add_argument("--rollout", choices=("vllm",), default=None,
                        help="instead: train one step, sync to a vLLM engine, check it matches Megatron")
    parser.add_argument("--transport", choices=("broadcast", "colocated"), default="broadcast",
                        help="weight-sync transport for --rollout")
    parser.add_argument("--engine-dtype", default="auto", help="vLLM dtype for --rollout (auto: the checkpoint's)")
    parser.add_argument("--transformer-impl", default="auto", choices=("auto", "local", "transformer_engine"))
    parser.add_argument("--bucket-mb", type=int, default=512, help="export bucket size")
    parser.add_argument("--debug", action="store_true", help="print full worker tracebacks")
    args = parser.parse_args(argv)
    try:
        if args.rollout:
            from mrl.launch.verify_rollout import verify_rollout

            summary = verify_rollout(args.hf, parse_layout(args), transport=args.transport,
                                     tol=2e-2 if args.tol is None else args.tol, engine_dtype=args.engine_dtype,
                                     bucket_bytes=args.bucket_mb * 1024**2)
        else:
            summary = verify(args.hf, parse_layout(args), tol=1e-4 if args.tol is None else args.tol,
                             transformer_impl=args.transformer_impl, bucket_bytes=args.bucket_mb * 1024**2)
    except (LayoutError, UnsupportedModelError) as err:
        print(f"mrl verify: {err}", file=sys.stderr)
        return 2
    except WorkerError as err:
        print(f"mrl verify: {err if args.debug else err.summary}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
