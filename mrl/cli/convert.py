"""`mrl convert hf-to-mcore --hf HF_DIR --out CKPT_DIR [layout]`: the command line of
checkpoints_tools.convert (a HuggingFace directory, FP8 included, → an mrl checkpoint in a layout);
`mrl convert fp8-to-hf --hf FP8_DIR --out HF_DIR [--dtype bf16]`: a DeepSeek-style FP8 directory →
its dequantised HF twin (mrl.bridge.dequantize, DeepSeek's fp8_cast_bf16);
`mrl convert hf-to-fp8 --hf HF_DIR --out FP8_DIR`: the reverse, an unquantised directory → its
block-FP8 twin (the format rollout.quantization: fp8 engines load)."""

from __future__ import annotations

import argparse
import json
import sys

from checkpoints_tools.convert import DTYPES, convert
from mrl.bridge.dequantize import write_dequantized, write_quantized
from mrl.cli.layout_args import add_layout_arguments, parse_layout
from mrl.layout import LayoutError
from mrl.megatron.local_launch import WorkerError
from mrl.models.registry import UnsupportedModelError

DEFAULT_DTYPE = {"hf-to-mcore": "fp32", "fp8-to-hf": "bf16", "hf-to-fp8": None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mrl convert", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("direction", choices=tuple(DEFAULT_DTYPE), help="conversion direction")
    parser.add_argument("--hf", required=True, help="HuggingFace model directory")
    parser.add_argument("--out", required=True,
                        help="hf-to-mcore: checkpoint root to write (iter_0000000 + latest); fp8-to-hf, hf-to-fp8: HF directory")
    add_layout_arguments(parser)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="parameter dtype (hf-to-mcore, default fp32) or dequantised weight dtype (fp8-to-hf, default bf16)")
    parser.add_argument("--force", action="store_true", help="replace an existing output")
    parser.add_argument("--debug", action="store_true", help="print full worker tracebacks")
    args = parser.parse_args(argv)
    dtype = args.dtype or DEFAULT_DTYPE[args.direction]
    try:
        if args.direction == "fp8-to-hf":
            summary = write_dequantized(args.hf, args.out, DTYPES[dtype], force=args.force)
        elif args.direction == "hf-to-fp8":
            summary = write_quantized(args.hf, args.out, force=args.force)
        else:
            summary = convert(args.hf, args.out, parse_layout(args), dtype=dtype, force=args.force)
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
