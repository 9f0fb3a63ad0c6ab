"""`mrl train RECIPE [k=v ...]` and `mrl sft RECIPE [k=v ...]`: validate, run, print a JSON summary.

Exit 0 when the run finished; 2 when the configuration is wrong (every problem listed, nothing
started); 1 when the run failed (the error names the rank, stage or tensor involved).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from mrl.config import ConfigError, RunConfig, load_config


def _run(prog: str, argv: list[str] | None, job: Callable[[RunConfig], dict]) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("config", help="recipe YAML (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.kl_coef=0.01")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    summary = job(cfg)
    print(json.dumps(summary, indent=2))
    return 0


def train(argv: list[str] | None = None) -> int:
    from mrl.trainer import train as run_training

    return _run("mrl train", argv, run_training)


def sft(argv: list[str] | None = None) -> int:
    from mrl.sft import sft_only

    return _run("mrl sft", argv, sft_only)
