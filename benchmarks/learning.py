"""Learning curves on the demo task from one SFT start: GRPO (sync), PPO, and the async recipe.

Issue 13's check (the PPO recipe raises held-out accuracy by ≥ 5 points from the SFT'd model over a
comparable number of samples as GRPO) and issue 15's (the async recipe raises it at least as much as
sync GRPO for the same trained samples) are both measured here, on the same SFT start: every
(recipe, seed) run starts from one SFT checkpoint, varies `rollout.seed` and evaluates the held-out
set, greedy and sampled. Prints each recipe's gains and, paired by seed, their difference from
GRPO's (`table`); the method and the results: docs/benchmarks.md, "Learning on the demo task".

    .venv/bin/python benchmarks/learning.py [--modes grpo,ppo,fully_async] [--steps 40] [--seeds 0,1,2]
        [--eval-every 5] [--eval-samples 8] [--sft-steps N] [--set k=v ...] [--workdir DIR]
        [--plot docs/images/learning.png] [--late-from 1280]
    .venv/bin/python benchmarks/learning.py --pool NAME=DIR[,DIR...] [--pool ...]   (compare finished runs only)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
SAMPLES_PER_STEP = 64  # every recipe's: 8 × 8 (GRPO) or 64 × 1 (PPO) (--plot-only reads runs without their config)
RECIPES = {"grpo": ROOT / "configs" / "tiny_cpu_grpo.yaml", "ppo": ROOT / "configs" / "tiny_cpu_ppo.yaml",
           "fully_async": ROOT / "configs" / "tiny_cpu_async.yaml"}
COLORS = {"grpo": "tab:blue", "ppo": "tab:green", "fully_async": "tab:orange"}


def train_sft(workdir: Path, steps: int | None, extra: list[str]) -> Path:
    """The demo's SFT warm start (`steps`: the recipe's unless given), once: its checkpoint root (RL step 0).
    Every RL run starts from it (checkpoint.resume=<its checkpoint>, trainer.sft_steps=0), so every
    recipe starts from the same weights and the same held-out accuracy (PPO's critic starts fresh
    from it)."""
    from mrl.config import load_config
    from mrl.sft import sft_only

    out = workdir / "sft"
    cfg = load_config(RECIPES["grpo"], [f"trainer.output_dir={out}", "checkpoint.export_hf=false"]
                      + ([f"trainer.sft_steps={steps}"] if steps else []) + extra)
    summary = sft_only(cfg)
    print(f"SFT: {json.dumps(summary.get('sft', summary))}", flush=True)
    return out / "checkpoints" / "sft"


def run_rl(mode: str, seed: int, sft: Path, args, workdir: Path) -> dict:
    """One RL run from the SFT checkpoint; its held-out accuracy curve and step times. The seed varies
    `rollout.seed` (the samples drawn); the held-out set is evaluated every --eval-every steps,
    greedy and sampled as in training (--eval-samples a prompt, trainer.eval_samples). `--set k=v`
    overrides apply to the SFT start and to every run (e.g. another task: data.arithmetic.max_operand=...)."""
    from mrl.config import load_config
    from mrl.trainer import train

    out = workdir / f"{mode}-seed{seed}"
    overrides = [f"trainer.output_dir={out}", f"model.path={workdir / 'sft' / 'model'}", "model.tiny=null",
                 f"checkpoint.resume={sft}", "trainer.sft_steps=0", f"trainer.total_steps={args.steps}",
                 f"trainer.eval_every={args.eval_every}", f"rollout.seed={seed}", "checkpoint.export_hf=false",
                 f"trainer.eval_samples={args.eval_samples}",
                 f"checkpoint.save_every={args.steps}"] + args.set
    cfg = load_config(RECIPES[mode], overrides)
    start = time.perf_counter()
    train(cfg)
    return read_run(out, mode, seed, cfg.data.batch_size * cfg.rollout.n_samples_per_prompt,
                    time.perf_counter() - start)


def read_run(out: Path, mode: str, seed: int, samples_per_step: int, wall_s: float | None = None) -> dict:
    """A finished run's curves (from its metrics.jsonl) against trained samples: held-out accuracy
    and the training batch's mean reward (smoothed over 5 steps: one batch is 64 noisy samples)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "timing_s/step" in r]
    rewards = [float(r["critic/score/mean"]) for r in steps]
    smooth = [sum(rewards[max(0, i - 4):i + 1]) / len(rewards[max(0, i - 4):i + 1]) for i in range(len(rewards))]
    return {"mode": mode, "seed": seed, "wall_s": wall_s,
            "curve": [(int(r["step"]) * samples_per_step, float(r["eval/accuracy"])) for r in rows if "eval/accuracy" in r],
            "sampled": [(int(r["step"]) * samples_per_step, float(r["eval/accuracy_sampled"]))
                        for r in rows if "eval/accuracy_sampled" in r],
            "reward": [(int(r["step"]) * samples_per_step, v) for r, v in zip(steps, smooth)],
            "step_s": sum(float(r["timing_s/step"]) for r in steps),
            "staleness_max": max((float(r.get("async/staleness_max", 0.0)) for r in steps), default=0.0),
            "partial_ratio_mean": _mean([float(r["async/partial_ratio"]) for r in steps if "async/partial_ratio" in r])}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def mean_curve(runs: list[dict], key: str = "curve") -> list[tuple[int, float]]:
    """Per number of trained samples, the mean over the runs that measured there."""
    points: dict[int, list[float]] = {}
    for run in runs:
        for samples, value in run[key]:
            points.setdefault(samples, []).append(value)
    return [(s, sum(v) / len(v)) for s, v in sorted(points.items())]


def plot(runs: list[dict], path: Path) -> None:
    """The plot --plot (default docs/images/learning.png): held-out accuracy and the training reward
    against trained samples, one thin line per run and the mean over seeds per recipe (--plot-only
    redraws it from WORKDIR's runs; WORKDIR/learning.json holds every run's curve and wall-clock)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("curve", "held-out accuracy (greedy)"), ("sampled", "held-out accuracy (sampled as in training)"),
              ("reward", "training reward (batch mean, 5-step mean)")]
    panels = [(key, label) for key, label in panels if any(run.get(key) for run in runs)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2))
    for ax, (key, label) in zip(axes, panels):
        for mode, color in COLORS.items():
            mine = [r for r in runs if r["mode"] == mode]
            for run in mine:
                ax.plot(*zip(*run[key]), color=color, alpha=0.25, linewidth=1)
            if mine:
                ax.plot(*zip(*mean_curve(mine, key)), color=color, linewidth=2.5, marker="o" if key == "curve" else None,
                        label=f"{mode} (mean of {len(mine)} seeds)")
        ax.set_xlabel("trained samples")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Demo task from one SFT start: GRPO (sync), PPO, and the async recipe (fully async, η 2, TIS, partial rollout)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _gain(run: dict, key: str) -> tuple[float, float] | None:
    return (run[key][0][1], run[key][-1][1]) if run.get(key) else None


def _end_gain(run: dict, key: str) -> float | None:
    """The last evaluation minus the start."""
    span = _gain(run, key)
    return None if span is None else span[1] - span[0]


def _cell(span: tuple[float, float] | None) -> str:
    return "–" if span is None else f"{span[0]:.3f} → {span[1]:.3f} ({span[1] - span[0]:+.3f})"


def _late_gain(run: dict, key: str, late_from: int) -> float | None:
    """The mean of the evaluations from `late_from` trained samples on, minus the start."""
    late = [v for samples, v in run.get(key) or [] if samples >= late_from]
    return sum(late) / len(late) - run[key][0][1] if late else None


def _mean_and_se(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0


def _mean_se(values: list[float]) -> str:
    """Points: mean ± standard error over the seeds."""
    if not values:
        return "–"
    mean, se = _mean_and_se(values)
    return f"{100 * mean:+.1f} ± {100 * se:.1f}"


def table(runs: list[dict], late_from: int) -> str:
    """Each run's gains, their mean ± s.e. per recipe and, where GRPO ran the same seeds, each
    recipe's gain minus GRPO's paired by seed."""
    lines = ["| mode | seed | held-out greedy | held-out sampled | RL wall s | max staleness | partial ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        partial = "–" if r["partial_ratio_mean"] is None else f"{r['partial_ratio_mean']:.2f}"
        lines.append(f"| {r['mode']} | {r['seed']} | {_cell(_gain(r, 'curve'))} | {_cell(_gain(r, 'sampled'))} | "
                     f"{r['step_s']:.0f} | {r['staleness_max']:.0f} | {partial} |")
    lines += ["", f"Gain in points, mean ± s.e. over seeds (late: the mean of the evaluations from {late_from} "
              "trained samples on)", "",
              "| mode | seeds | greedy, end | greedy, late | sampled, end | sampled, late |", "|---|---|---|---|---|---|"]
    for mode in RECIPES:
        mine = [r for r in runs if r["mode"] == mode]
        if mine:
            cells = []
            for key in ("curve", "sampled"):
                cells.append(_mean_se([g for g in (_end_gain(r, key) for r in mine) if g is not None]))
                cells.append(_mean_se([v for v in (_late_gain(r, key, late_from) for r in mine) if v is not None]))
            lines.append(f"| {mode} | {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines + paired(runs, late_from))


MEASURES = ("greedy, end", "greedy, late", "sampled, end", "sampled, late")


def paired_differences(runs: list[dict], mode: str, late_from: int) -> list[list[float]]:
    """Per measure (MEASURES): the mode's gain minus GRPO's on the same seed (the same prompts in the
    same order and the same eval seeds), one value per seed both ran."""
    grpo = {r["seed"]: r for r in runs if r["mode"] == "grpo"}
    mine = [(r, grpo[r["seed"]]) for r in runs if r["mode"] == mode and r["seed"] in grpo]
    columns = []
    for key in ("curve", "sampled"):
        for gain in (lambda run: _end_gain(run, key), lambda run: _late_gain(run, key, late_from)):
            pairs = [(gain(r), gain(g)) for r, g in mine]
            columns.append([a - b for a, b in pairs if a is not None and b is not None])
    return columns


def paired(runs: list[dict], late_from: int) -> list[str]:
    """Table rows: each recipe's gain minus GRPO's paired by seed, mean ± s.e. over the seeds both ran."""
    rows = []
    for mode in RECIPES:
        columns = paired_differences(runs, mode, late_from) if mode != "grpo" else [[]]
        if columns[0]:
            rows.append(f"| {mode} − grpo | {len(columns[0])} | " + " | ".join(map(_mean_se, columns)) + " |")
    if not rows:
        return []
    return ["", "Paired by seed against GRPO, points, mean ± s.e.", "",
            "| recipe | seeds | " + " | ".join(MEASURES) + " |", "|---|---|---|---|---|---|"] + rows


T_975_SMALL = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}  # Student's t 97.5 % quantiles, exact


def _t_quantile_975(dof: int) -> float:
    """Student's t 97.5 % quantile: exact to 4 degrees of freedom, then the Cornish-Fisher expansion
    around the normal's to the third order in 1/dof (2.568 at 5 against the exact 2.571; 2.306 at 8; 2.093 at 19)."""
    if dof in T_975_SMALL:
        return T_975_SMALL[dof]
    z = 1.959964
    return (z + (z ** 3 + z) / (4 * dof) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * dof ** 3))


def _interval(values: list[float]) -> str:
    """Points: mean ± s.e. and the two-sided 95 % confidence interval of the mean."""
    if len(values) < 2:
        return _mean_se(values)
    mean, se = _mean_and_se(values)
    half = _t_quantile_975(len(values) - 1) * se
    return f"{_mean_se(values)} [{100 * (mean - half):+.1f}, {100 * (mean + half):+.1f}]"


def pooled(groups: dict[str, list[dict]], late_from: int) -> str:
    """Each recipe's gain minus GRPO's, paired by seed within each group (an SFT start or task
    instance) and pooled over the groups: the mean difference, its s.e. and 95 % interval, i.e. how
    far below GRPO a recipe could be and still give these runs (--pool)."""
    lines = ["| recipe | group | pairs | " + " | ".join(MEASURES) + " |", "|---|---|---|---|---|---|---|"]
    for mode in [m for m in RECIPES if m != "grpo"]:
        per_group = {name: paired_differences(runs, mode, late_from) for name, runs in groups.items()}
        per_group = {name: columns for name, columns in per_group.items() if columns[0]}
        if not per_group:
            continue
        for name, columns in per_group.items():
            lines.append(f"| {mode} − grpo | {name} | {len(columns[0])} | " + " | ".join(map(_interval, columns)) + " |")
        everything = [sum((columns[i] for columns in per_group.values()), []) for i in range(len(MEASURES))]
        lines.append(f"| {mode} − grpo | **pooled** | {len(everything[0])} | "
                     + " | ".join(map(_interval, everything)) + " |")
    return "\n".join(["Paired by seed against GRPO within each group, points: mean ± s.e. [95 % interval]", ""] + lines)


def read_runs(workdirs: list[Path]) -> list[dict]:
    """Every finished run in these workdirs (named MODE-seedN); a mode and seed found twice is an error
    (it would be paired twice)."""
    runs = [read_run(d, d.name.rsplit("-seed", 1)[0], int(d.name.rsplit("-seed", 1)[1]), SAMPLES_PER_STEP)
            for w in workdirs for d in sorted(w.glob("*-seed*")) if (d / "metrics.jsonl").exists()]
    seen = [(r["mode"], r["seed"]) for r in runs]
    if twice := sorted({run for run in seen if seen.count(run) > 1}):
        raise SystemExit(f"runs found twice in {', '.join(map(str, workdirs))}: {twice}; give each run's workdir once")
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-samples", type=int, default=8, help="held-out samples a prompt for eval/accuracy_sampled")
    parser.add_argument("--sft-steps", type=int, default=None, help="the warm start's SFT steps (default: the recipe's)")
    parser.add_argument("--modes", default="grpo,ppo,fully_async")
    parser.add_argument("--set", action="append", default=[], metavar="K=V", help="an override for the SFT start and every run")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "images" / "learning.png")
    parser.add_argument("--plot-only", action="store_true", help="re-read WORKDIR's finished runs and plot them")
    parser.add_argument("--late-from", type=int, default=1280, help="trained samples from which the table's late mean counts")
    parser.add_argument("--pool", action="append", default=[], metavar="NAME=DIR[,DIR...]",
                        help="only compare: the finished runs of these workdirs are one group (an SFT start); "
                             "prints each recipe minus GRPO paired by seed per group and pooled over the groups")
    args = parser.parse_args()
    if args.pool:
        specs = [spec.split("=", 1) for spec in args.pool]
        if any(len(spec) != 2 or not spec[1] for spec in specs) or len({name for name, *_ in specs}) != len(specs):
            parser.error(f"--pool takes NAME=DIR[,DIR...] with a name of its own for each group; got {args.pool}")
        groups = {name: read_runs([Path(d) for d in dirs.split(",") if d]) for name, dirs in specs}
        print(pooled(groups, args.late_from))
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="mrl-learning-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        runs = read_runs([workdir])
        plot(runs, args.plot)
        print(table(runs, args.late_from))
        return
    sft = workdir / "sft" / "checkpoints" / "sft"
    if not sft.exists():
        sft = train_sft(workdir, args.sft_steps, args.set)
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for mode in args.modes.split(","):
            runs.append(run_rl(mode, seed, sft, args, workdir))
            (workdir / "learning.json").write_text(json.dumps(runs, indent=1))
            print(table(runs[-1:], args.late_from), flush=True)
    plot(runs, args.plot)
    print(table(runs, args.late_from))
    print(f"plot: {args.plot}; runs: {workdir}")


if __name__ == "__main__":
    main()
