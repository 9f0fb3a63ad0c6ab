"""`mrl verify`: prove that a HuggingFace checkpoint means the same thing in a Megatron layout
(mrl/bridge/verify.py), or with `--rollout vllm` that a weight sync hands vLLM exactly the policy
Megatron holds (mrl/verify_rollout.py). Prints a JSON summary; exits 0 when the checks pass,
1 when one fails, 2 on bad input.

With `--checkpoint CKPT` (mrl's or Megatron-LM's torch_dist) the checkpoint is first merged into a
temporary HF directory (config and tokenizer from `--hf`, required for Megatron-LM's), then loaded
into Megatron in the layout as RL loads the policy it starts from, and compared with that.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from mrl.cli.layout_args import add_layout_arguments, parse_layout
from mrl.config.schema import DEFAULT_BUCKET_MB
from mrl.layout import LayoutError
from mrl.models.registry import UnsupportedModelError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mrl verify", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--hf", default=None, help="HuggingFace model directory (config.json + safetensors); with "
                                                   "--checkpoint, the model's config and tokenizer")
    parser.add_argument("--checkpoint", default=None,
                        help="a Megatron checkpoint (mrl's, or Megatron-LM's torch_dist) to check instead of --hf's weights")
    add_layout_arguments(parser)
    parser.add_argument("--tol", type=float, default=None,
                        help="max |logit diff| vs transformers (default 1e-4, fp32); with --rollout, max "
                             "|logprob diff| vLLM vs Megatron after the sync (default: 1e-4 for an fp32 "
                             "engine; otherwise 3 × the engine's own noise on this model measured before "
                             "the update, at least 2e-2)")
    parser.add_argument("--rollout", choices=("vllm",), default=None,
                        help="instead: train one step, sync to a vLLM engine, check it matches Megatron")
    parser.add_argument("--transport", choices=("broadcast", "colocated"), default="broadcast",
                        help="weight-sync transport for --rollout")
    parser.add_argument("--engine-dtype", default="auto", help="vLLM dtype for --rollout (auto: the checkpoint's)")
    parser.add_argument("--transformer-impl", default="auto", choices=("auto", "local", "transformer_engine"))
    parser.add_argument("--bucket-mb", type=int, default=DEFAULT_BUCKET_MB, help="export bucket size")
    parser.add_argument("--debug", action="store_true", help="print full worker tracebacks")
    args = parser.parse_args(argv)
    if args.hf is None and args.checkpoint is None:
        parser.error("give --hf (an HF model) or --checkpoint (a Megatron checkpoint)")
    if args.checkpoint and args.rollout:
        parser.error("--rollout checks an HF model's sync (--hf); --checkpoint is not used with it")
    from mrl.bridge.verify import verify
    from mrl.megatron.local_launch import WorkerError

    try:
        if args.checkpoint:
            summary = verify_checkpoint(args)
        elif args.rollout:
            from mrl.verify_rollout import verify_rollout

            summary = verify_rollout(args.hf, parse_layout(args), transport=args.transport,
                                     tol=args.tol, engine_dtype=args.engine_dtype,
                                     bucket_bytes=args.bucket_mb * 1024**2)
        else:
            summary = verify(args.hf, parse_layout(args), tol=1e-4 if args.tol is None else args.tol,
                             transformer_impl=args.transformer_impl, bucket_bytes=args.bucket_mb * 1024**2)
    except (LayoutError, UnsupportedModelError, ValueError, OSError) as err:
        print(f"mrl verify: {err}", file=sys.stderr)
        return 2
    except WorkerError as err:
        print(f"mrl verify: {err if args.debug else err.summary}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    return 0 if summary["ok"] else 1


def verify_checkpoint(args: argparse.Namespace) -> dict:
    """Merge the checkpoint into a temporary HF directory, then verify it in the layout against it."""
    from checkpoints_tools.merge import check_verifiable, merge
    from mrl.bridge.verify import verify

    check_verifiable(args.checkpoint)
    with tempfile.TemporaryDirectory(prefix="mrl-verify-") as tmp:
        merged = merge(args.checkpoint, Path(tmp) / "hf", hf_config=args.hf, progress=False)
        return verify(str(Path(tmp) / "hf"), parse_layout(args), tol=1e-4 if args.tol is None else args.tol,
                      transformer_impl=args.transformer_impl, bucket_bytes=args.bucket_mb * 1024**2,
                      checkpoint=merged["checkpoint"])


if __name__ == "__main__":
    sys.exit(main())
