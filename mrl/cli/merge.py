"""`mrl-merge CKPT_DIR --out HF_DIR`: the command line of checkpoints_tools.merge (an mrl
checkpoint in any layout → a HuggingFace directory, CPU only, streaming, self-checked, atomic)."""

from __future__ import annotations

import argparse
import json
import sys

from checkpoints_tools.merge import DTYPES, MergeError, merge, verify_merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mrl-merge", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("checkpoint", help="checkpoint root (follows `latest`) or one iteration directory")
    parser.add_argument("--out", required=True, help="HuggingFace directory to write")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                        help="output dtype (default bf16; expert_bias stays fp32)")
    parser.add_argument("--workers", type=int, default=1, help="threads reading and converting tensors")
    parser.add_argument("--config", default=None, help="HF config dir or config.json (default: the checkpoint's hf/)")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    parser.add_argument("--verify", action="store_true",
                        help="compare logits of the result (transformers) with the checkpoint in Megatron")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        summary = merge(args.checkpoint, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                        workers=args.workers, force=args.force, config=args.config, progress=not args.no_progress)
        if args.verify:
            summary["verify"] = verify_merged(summary["checkpoint"], args.out, args.dtype)
    except (MergeError, OSError) as err:
        print(f"mrl-merge: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0 if summary.get("verify", {"ok": True})["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
