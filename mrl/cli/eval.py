"""`mrl eval RECIPE [k=v ...] [--model PATH] [--data FILE] [--samples K] [--out FILE]`: score a model
on prompts with vLLM, as the trainer evaluates (mrl/evaluation.py, docs/evaluation.md).

The recipe gives the prompt template, the reward and the engine's settings. --model is an HF
directory or a checkpoint (mrl's, or Megatron-LM's with the recipe's model.path as its config),
merged first into a temporary HF directory; default: the recipe's model.path. --data is a
.jsonl/.parquet file (default: the recipe's held-out split). Prints the summary as JSON: greedy
accuracy; with --samples K, pass@1, pass@K and maj@K; per data_source. Exit 2 on bad input,
before an engine starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mrl eval", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="recipe YAML: template, reward, engine settings")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.max_new_tokens=512")
    parser.add_argument("--model", default=None, help="HF directory or checkpoint (default: the recipe's model.path)")
    parser.add_argument("--data", default=None, help=".jsonl/.parquet prompts (default: the recipe's held-out split)")
    parser.add_argument("--samples", type=int, default=0, help="K samples a prompt for pass@1, pass@K, maj@K")
    parser.add_argument("--out", default=None, help="also write the summary to this JSON file")
    args = parser.parse_args(argv)
    if args.samples < 0:
        parser.error("--samples must be >= 0")
    from mrl.config import ConfigError, load_config

    data = ["data.synthetic=false", f"data.path={args.data}", f"data.heldout_path={args.data}"] if args.data else []
    try:
        cfg = load_config(args.config, [*args.overrides, *data])
        with ExitStack() as stack:
            hf_dir = model_dir(cfg, args.model, stack)
            summary = run_eval(cfg, hf_dir, args.samples)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    summary = {"model": args.model or cfg.model.path, "data": args.data or "held-out split", **summary}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        from mrl.atomic import atomic_write

        atomic_write(Path(args.out), lambda f: f.write((text + "\n").encode()))
    return 0


def model_dir(cfg, model: str | None, stack: ExitStack) -> str:
    """The HF directory to evaluate: `model` itself, or a checkpoint merged into a temporary one."""
    from mrl.config import ConfigError

    if model is None:
        from mrl.inputs import prepare_model

        return prepare_model(cfg.model, cfg.trainer.seed)[0]
    if (Path(model) / "config.json").is_file():
        return model
    import torch

    from checkpoints_tools.errors import CheckpointError
    from checkpoints_tools.merge import DTYPE_NAMES, merge

    out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mrl-eval-"))) / "hf"
    try:
        config = cfg.model.path if (Path(cfg.model.path) / "config.json").is_file() else None  # Megatron-LM's need one
        merge(model, out, hf_config=config, dtype=DTYPE_NAMES[getattr(torch, cfg.model.dtype)], progress=False)
    except CheckpointError as err:
        raise ConfigError([f"--model {model} is neither an HF directory (config.json) nor a checkpoint to merge: "
                           f"{err}"]) from None
    return str(out)


def run_eval(cfg, hf_dir: str, samples: int) -> dict:
    """The held-out split of `cfg` (tokenized with `hf_dir`'s tokenizer) evaluated on a one-off engine."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from mrl import evaluation
    from mrl.config import ConfigError
    from mrl.config.derived import agent_rows
    from mrl.data import load_splits
    from mrl.inputs import tokenize_samples
    from mrl.launch.cluster import local_ray, one_off_engine
    from mrl.rewards import build_reward
    from mrl.rewards.ahead import ScoresAhead

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    heldout = tokenize_samples(load_splits(cfg.data, cfg.trainer.seed, tokenizer)[1], tokenizer)
    if not heldout:
        raise ConfigError(["nothing to evaluate: the recipe has no held-out split; pass --data FILE or set "
                           "data.heldout_path"])
    sampled = replace(evaluation.rollout_settings(cfg.rollout, seed=cfg.rollout.seed), n=samples) if samples else None
    reward = ScoresAhead(build_reward(cfg.reward))
    start = time.perf_counter()
    try:
        with local_ray(cfg.launch.cpus_per_node), one_off_engine(cfg, hf_dir) as engine:
            summary = evaluation.evaluate(engine.generate, reward.score_batch, heldout,
                                          evaluation.greedy_settings(cfg.rollout), sampled,
                                          agent_rows(cfg))
    finally:
        reward.close()
    return summary | {"seconds": round(time.perf_counter() - start, 1)}
