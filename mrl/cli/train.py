"""`mrl train RECIPE [k=v ...]` and `mrl sft RECIPE [k=v ...]`: validate, run, print a JSON summary.

Exit 0 when the run finished; 2 when the configuration is wrong (every problem listed, nothing
started); 1 when the run failed (the error names the rank, engine, stage or tensor involved);
128 + the signal's number when SIGTERM or Ctrl-C stopped it: during RL after the step in progress,
with a checkpoint and the command that resumes; otherwise (a second signal, set-up, SFT) at once,
the run's actors, engines and, if it started it, Ray stopped first, and one line says what was
saved last.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from mrl.checkpoint_dir import read_latest
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
    from mrl.launch.fleet import EngineError
    from mrl.launch.worker_group import WorkerGroupError
    from mrl.rank_map import PlacementError
    from mrl.rewards.watch import RewardFailedError

    start = time.perf_counter()
    try:
        summary = job(cfg)
    except (ConfigError, PlacementError) as exc:  # found at start-up: a checkpoint that does not fit, a split TP group
        print(exc, file=sys.stderr)
        return 2
    except (WorkerGroupError, EngineError, RewardFailedError) as exc:  # a rank, engine or reward failed: one line
        print(f"{prog}: {exc} (traceback: {write_traceback(exc, cfg.trainer.output_dir)})", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # a signal that stops at once: the run closed everything it started
        name = str(exc).split(":")[0] or "SIGINT"
        latest = read_latest(cfg.checkpoint.dir)
        saved = f"its last checkpoint is {cfg.checkpoint.dir}/{latest}" if latest else "nothing was saved"
        print(f"{prog}: stopped at once by {name} after {time.perf_counter() - start:.0f} s, without saving: {saved}; "
              f"its actors and engines were stopped (where: {write_traceback(exc, cfg.trainer.output_dir)})",
              file=sys.stderr)
        return 128 + signal.Signals[name].value
    summary["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(summary, indent=2))
    if "stopped" in summary:
        stopped = summary["stopped"]
        print(f"{prog}: stopped by {stopped['signal']} after RL step {stopped['step']}, saved in "
              f"{stopped['checkpoint']}; resume with: {prog} {shlex.join(resume_args(args, cfg))}", file=sys.stderr)
        return 128 + signal.Signals[stopped["signal"]].value
    print(headline(summary))
    return 0


def resume_args(args: argparse.Namespace, cfg: RunConfig) -> list[str]:
    """The command line again, resuming this run's own checkpoints (not a checkpoint.resume PATH)."""
    overrides = [o for o in args.overrides if not o.startswith("checkpoint.resume=")]
    return [args.config, *overrides, *([] if cfg.checkpoint.resume == "auto" else ["checkpoint.resume=auto"])]


def write_traceback(exc: BaseException, output_dir: str) -> Path:
    path = Path(output_dir) / "error.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(traceback.format_exception(exc)))
    return path


def headline(summary: dict) -> str:
    """The one line a user reads first: what the run did to the model."""
    parts = []
    if "sft" in summary:
        sft = summary["sft"]
        parts.append(f"SFT loss {sft['loss_first']:.3f} → {sft['loss_last']:.3f} in {sft['steps']} steps")
    if summary.get("accuracy_initial") is not None:
        parts.append(f"held-out accuracy {summary['accuracy_initial']:.3f} before SFT")
    if summary.get("accuracy_before") is not None:
        before, after = summary["accuracy_before"], summary["accuracy_after"]
        parts.append(f"held-out accuracy before RL {before:.3f} → after RL {after:.3f} ({100 * (after - before):+.1f} points)")
    if summary.get("accuracy_sampled_before") is not None:
        before, after = summary["accuracy_sampled_before"], summary["accuracy_sampled_after"]
        parts.append(f"sampled {before:.3f} → {after:.3f} ({100 * (after - before):+.1f} points)")
    if summary.get("accuracy_merged_hf") is not None:
        parts.append(f"merged HF model scored by vLLM: {summary['accuracy_merged_hf']:.3f}")
    if summary.get("merged_hf_logprob_gap") is not None:
        parts.append(f"merged HF model vs the trained engine: max |log-prob gap| {summary['merged_hf_logprob_gap']:.1e}")
    return "; ".join(parts + [f"{summary['seconds']:.0f} s"])


def train(argv: list[str] | None = None) -> int:
    def run_training(cfg: RunConfig) -> dict:
        from mrl.trainer import train as run

        return run(cfg)

    return _run("mrl train", argv, run_training)


def sft(argv: list[str] | None = None) -> int:
    def sft_only(cfg: RunConfig) -> dict:
        from mrl.sft import sft_only as run

        return run(cfg)

    return _run("mrl sft", argv, sft_only)
