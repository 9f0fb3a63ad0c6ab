"""The layout flags shared by `mrl verify` and `mrl convert`."""

from __future__ import annotations

import argparse

from mrl.layout import ParallelLayout


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size")
    parser.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per stage")
    parser.add_argument("--cp", type=int, default=1, help="context parallel size (each sequence split over CP ranks)")


def parse_layout(args: argparse.Namespace) -> ParallelLayout:
    return ParallelLayout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, vpp=args.vpp, cp=args.cp)
