"""`mrl convert DIRECTION`: one subcommand per direction, each with its own `--help`.

- `hf-to-mcore --hf HF_DIR --out CKPT_DIR [layout]`: a HuggingFace directory, FP8 included, → an mrl
  checkpoint in a layout (checkpoints_tools.convert);
- `fp8-to-hf --hf FP8_DIR --out HF_DIR [--dtype bf16]`: a DeepSeek-style FP8 directory → its
  dequantised HF twin (mrl.bridge.dequantize, DeepSeek's fp8_cast_bf16);
- `hf-to-fp8 --hf HF_DIR --out FP8_DIR`: the reverse, an unquantised directory → its block-FP8 twin
  (the format rollout.quantization: fp8 engines load).
"""

from __future__ import annotations

import argparse
import json
import sys

from mrl.cli.layout_args import add_layout_arguments, parse_layout
from mrl.layout import LayoutError
from mrl.models.registry import UnsupportedModelError

DTYPE_NAMES = ("bf16", "fp16", "fp32")  # checkpoints_tools.convert.DTYPES' keys, named without importing torch
DIRECTIONS = {  # direction → (one-line help, --hf's and --out's metavars, default --dtype)
    "hf-to-mcore": ("a HuggingFace directory (FP8 too) → an mrl checkpoint in a layout",
                    ("HF_DIR", "CKPT_DIR"), "fp32"),
    "fp8-to-hf": ("a DeepSeek-style FP8 HF directory → its dequantised HF twin", ("FP8_DIR", "HF_DIR"), "bf16"),
    "hf-to-fp8": ("an unquantised HF directory → its block-FP8 twin (what rollout.quantization: fp8 engines load)",
                  ("HF_DIR", "FP8_DIR"), None),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mrl convert", description="Convert a model directory or checkpoint.")
    directions = parser.add_subparsers(dest="direction", required=True, metavar="DIRECTION",
                                       title="directions (`mrl convert DIRECTION --help` describes each)")
    for name, (help_, (src, dst), dtype) in DIRECTIONS.items():
        sub = directions.add_parser(name, help=help_, description=help_ + ".")
        sub.add_argument("--hf", required=True, metavar=src, help="the HuggingFace directory to read")
        sub.add_argument("--out", required=True, metavar=dst,
                         help="the checkpoint root to write (iter_0000000 + latest)" if name == "hf-to-mcore"
                         else "the HuggingFace directory to write")
        sub.add_argument("--force", action="store_true", help="replace an existing output")
        if name == "hf-to-mcore":
            add_layout_arguments(sub)
            sub.add_argument("--dtype", choices=DTYPE_NAMES, default=dtype, help=f"parameter dtype (default {dtype})")
            sub.add_argument("--debug", action="store_true", help="print full worker tracebacks")
        elif name == "fp8-to-hf":
            sub.add_argument("--dtype", choices=DTYPE_NAMES, default=dtype,
                             help=f"dtype of the dequantised weights (default {dtype})")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from checkpoints_tools.convert import DTYPES, convert
    from mrl.bridge.dequantize import write_dequantized, write_quantized
    from mrl.megatron.local_launch import WorkerError

    try:
        if args.direction == "fp8-to-hf":
            summary = write_dequantized(args.hf, args.out, DTYPES[args.dtype], force=args.force)
        elif args.direction == "hf-to-fp8":
            summary = write_quantized(args.hf, args.out, force=args.force)
        else:
            summary = convert(args.hf, args.out, parse_layout(args), dtype=args.dtype, force=args.force)
    except (LayoutError, UnsupportedModelError, FileExistsError, ValueError, OSError) as err:
        print(f"mrl convert: {err}", file=sys.stderr)
        return 2
    except WorkerError as err:
        print(f"mrl convert: {err if getattr(args, 'debug', False) else err.summary}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
