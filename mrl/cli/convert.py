"""`mrl convert hf-to-mcore --hf HF_DIR --out CKPT_DIR [layout]`: the command line of
checkpoints_tools.convert (a HuggingFace directory → an mrl checkpoint in a layout)."""

from __future__ import annotations

import argparse
import json
import sys

from checkpoints_tools.convert import DTYPES, convert
from mrl.cli.layout_args import add_layout_arguments, parse_layout
from mrl.layout import LayoutError
from mrl.megatron.local_launch import WorkerError
from mrl.models.registry import UnsupportedModelError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mrl convert", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("direction", choices=("hf-to-mcore",), help="conversion direction")
    parser.add_argument("--hf", required=True, help="HuggingFace model directory")
    parser.add_argument("--out", required=True, help="checkpoint root to write (iter_0000000 + latest)")
    add_layout_arguments(parser)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameter dtype (default fp32)")
    parser.add_argument("--force", action="store_true", help="replace an existing checkpoint root")
    parser.add_argument("--debug", action="store_true", help="print full worker tracebacks")
    args = parser.parse_args(argv)
    try:
        summary = convert(args.hf, args.out, parse_layout(args), dtype=args.dtype, force=args.force)
    except (LayoutError, UnsupportedModelError, FileExistsError, ValueError, OSError) as err:
        print(f"mrl convert: {err}", file=sys.stderr)
        return 2
    except WorkerError as err:
        print(f"mrl convert: {err if args.debug else err.summary}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
