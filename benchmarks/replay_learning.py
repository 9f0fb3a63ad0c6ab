"""Does rollout routing replay (R3) change learning? The demo recipe, none against R3, over seeds.

The demo (configs/tiny_cpu_grpo.yaml: a tiny DeepSeek-V3 in TP2 × EP2) with a bf16 engine against
the fp32 trainer, so that engine and trainer route some tokens differently; every run captures the
engine's routes (rollout.return_routes), so both modes log the routing agreement. Each seed is a
whole `mrl train` (benchmarks/demo_seeds.py) with algo.router_replay none, then R3. Per mode: the
held-out gains (mean ± sd), and over the RL steps the train-inference drift (rollout/train_kl,
rollout/train_logprob_abs_diff_{mean,max}) and the routing agreement; one figure of the drift and
KL curves (seed mean, band = min..max over seeds) beside the reward. Results: docs/benchmarks.md.

    .venv/bin/python benchmarks/replay_learning.py [--seeds 0,1,2,3,4] [--workdir DIR] [--plot FILE]
    .venv/bin/python benchmarks/replay_learning.py --table-only --workdir DIR   (finished runs only)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_seeds import ROOT, row, run_seeds  # noqa: E402

MODES = ("none", "R3")
SETTINGS = ["rollout.dtype=bfloat16", "rollout.return_routes=true", "sync.parity_threshold=5.0",
            "logging.trace_every=0"]  # a bf16 engine: probe gaps to ~1 (a routing flip); the gate only guards
CURVES = {"rollout/train_kl": "train-inference KL (k3)", "rollout/train_logprob_abs_diff_max": "max |Δ log-prob|",
          "rollout/routing_agreement": "routing agreement", "critic/score/mean": "reward (training samples)"}
DRIFT = ("rollout/train_kl", "rollout/train_logprob_abs_diff_mean", "rollout/train_logprob_abs_diff_max",
         "rollout/routing_agreement", "rollout/routing_tokens_any_diff")


def steps(out: Path) -> list[dict]:
    """A run's RL step rows (metrics.jsonl), in step order."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return sorted((r for r in rows if r.get("step", 0) >= 1 and "critic/score/mean" in r), key=lambda r: r["step"])


def spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{scale * statistics.mean(values):.{digits}f} ± {scale * sd:.{digits}f}"


def table(seeds: list[int], workdir: Path) -> str:
    lines = ["| replay | greedy gain (points) | sampled gain | greedy after RL | train_kl | mean \\|Δ\\| | max \\|Δ\\| "
             "| routing agreement | tokens differing |", "|---|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        done = [s for s in seeds if (workdir / mode / f"seed{s}" / "summary.json").is_file()]
        if not done:
            continue
        runs = [row(workdir / mode / f"seed{s}") for s in done]
        per_run = [steps(workdir / mode / f"seed{s}") for s in done]
        drift = {k: [statistics.mean(r[k] for r in rows) for rows in per_run] for k in DRIFT}
        lines.append(
            f"| {mode} ({len(done)} seeds) | {spread([100 * (r['greedy'][1] - r['greedy'][0]) for r in runs])} "
            f"| {spread([100 * (r['sampled'][1] - r['sampled'][0]) for r in runs])} "
            f"| {spread([r['greedy'][1] for r in runs], digits=3)} | {spread(drift['rollout/train_kl'], 1e4, 2)} e-4 "
            f"| {spread(drift['rollout/train_logprob_abs_diff_mean'], 1e3, 2)} e-3 "
            f"| {spread(drift['rollout/train_logprob_abs_diff_max'], 1e2, 2)} e-2 "
            f"| {spread(drift['rollout/routing_agreement'], digits=4)} "
            f"| {spread(drift['rollout/routing_tokens_any_diff'], 100, 2)} % |")
    return "\n".join(lines) + ("\n\nPer-run means over the RL steps, then mean ± sd over seeds; gains as in "
                               "benchmarks/demo_seeds.py.")


def plot(seeds: list[int], workdir: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.2 * len(CURVES), 3.4))
    for mode, colour in zip(MODES, ("tab:red", "tab:blue")):
        runs = [steps(workdir / mode / f"seed{s}") for s in seeds
                if (workdir / mode / f"seed{s}" / "summary.json").is_file()]
        if not runs:
            continue
        length = min(len(r) for r in runs)
        x = [r["step"] for r in runs[0][:length]]
        for ax, (key, title) in zip(axes, CURVES.items()):
            values = [[r[key] for r in rows[:length]] for rows in runs]
            smooth = [_ema(v) for v in values]
            ax.plot(x, [statistics.mean(c) for c in zip(*smooth)], color=colour, label=f"{mode} ({len(runs)} seeds)")
            ax.fill_between(x, [min(c) for c in zip(*smooth)], [max(c) for c in zip(*smooth)], color=colour, alpha=0.15)
            ax.set_title(title, fontsize=10)
            ax.set_yscale("log" if key == "rollout/train_kl" else "linear")
            ax.set_xlabel("RL step")
    axes[0].legend(fontsize=8)
    fig.suptitle("Routing replay on the demo (tiny DeepSeek-V3, bf16 engine, fp32 trainer): seed mean, band "
                 "min..max, EMA 0.8", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _ema(values: list[float], weight: float = 0.8) -> list[float]:
    out, last = [], values[0]
    for v in values:
        last = weight * last + (1 - weight) * v
        out.append(last)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "replay-learning")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "images" / "routing-replay-learning.png")
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    for seed in seeds if not args.table_only else ():  # paired: a cut-short sweep still compares like with like
        for mode in MODES:
            (args.workdir / mode).mkdir(parents=True, exist_ok=True)
            run_seeds([seed], args.workdir / mode, 1, [*SETTINGS, f"algo.router_replay={mode}"])
    print(table(seeds, args.workdir))
    plot(seeds, args.workdir, args.plot)
    print(f"figure: {args.plot}")


if __name__ == "__main__":
    main()
