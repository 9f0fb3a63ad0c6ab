"""`mrl-merge CKPT --out HF_DIR [--hf-config HF_CONFIG_DIR]`, also `mrl merge ...`: the command line
of checkpoints_tools.merge (an mrl or Megatron-LM checkpoint in any layout → a HuggingFace directory,
CPU only, streaming, self-checked, atomic)."""

from __future__ import annotations

import argparse
import json
import sys

from checkpoints_tools.errors import CheckpointError

DTYPE_NAMES = ("bf16", "fp16", "fp32")  # checkpoints_tools.merge.DTYPES' keys, named without importing torch


def main(argv: list[str] | None = None, prog: str = "mrl-merge") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("checkpoint", help="checkpoint root (follows mrl's `latest` or Megatron-LM's "
                                           "latest_checkpointed_iteration.txt) or one iteration directory")
    parser.add_argument("--out", required=True, help="HuggingFace directory to write")
    parser.add_argument("--hf-config", "--config", dest="hf_config", default=None,
                        help="HF model directory (or its config.json) whose config and tokenizer the output gets; "
                             "required for a Megatron-LM checkpoint (default for mrl's: the checkpoint's hf/)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                        help="output dtype (default: the checkpoint's parameter dtype; expert_bias stays fp32)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    parser.add_argument("--workers", type=int, default=1, help="threads reading and converting tensors")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    parser.add_argument("--verify", action="store_true",
                        help="compare logits of the result (transformers) with the checkpoint in Megatron")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    from checkpoints_tools.merge import check_verifiable, merge, verify_merged

    try:
        if args.verify:
            check_verifiable(args.checkpoint)
        summary = merge(args.checkpoint, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                        workers=args.workers, force=args.force, hf_config=args.hf_config, progress=not args.no_progress)
        if args.verify:
            summary["verify"] = verify_merged(summary["checkpoint"], args.out, summary["dtype"])
    except (CheckpointError, OSError) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0 if summary.get("verify", {"ok": True})["ok"] else 1


def subcommand(argv: list[str] | None = None) -> int:
    """`mrl merge ...`: the same command, under the name it was called by."""
    return main(argv, prog="mrl merge")


if __name__ == "__main__":
    sys.exit(main())
