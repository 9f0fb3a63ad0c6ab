"""The demo (`make demo`, configs/tiny_cpu_grpo.yaml) over several seeds: does RL's gain hold?

Each seed is a whole `mrl train` of the recipe (trainer.seed and rollout.seed set to it: another
tiny model, split, teacher, SFT order and samples), then one markdown row a seed: held-out greedy
accuracy before SFT → after SFT → after RL, sampled after SFT → after RL, the merged HF model's,
the curve at each evaluation; and the gains' mean, standard deviation and minimum.
Results: docs/benchmarks.md, "The demo".

    .venv/bin/python benchmarks/demo_seeds.py [--seeds 0,1,2,3,4] [--parallel 2] [--workdir DIR] [k=v ...]
    .venv/bin/python benchmarks/demo_seeds.py --table-only --workdir DIR      (rows of finished runs)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "tiny_cpu_grpo.yaml"


def run_seeds(seeds: list[int], workdir: Path, parallel: int, overrides: list[str], recipe: Path = RECIPE) -> None:
    """`mrl train` of `recipe` for every seed, `parallel` at a time; each run's log beside its output."""
    mrl = Path(sys.executable).with_name("mrl")
    for first in range(0, len(seeds), parallel):
        running = []
        for seed in seeds[first:first + parallel]:
            out = workdir / f"seed{seed}"
            argv = [str(mrl), "train", str(recipe), f"trainer.output_dir={out}", f"trainer.seed={seed}",
                    f"rollout.seed={seed}", *overrides]
            log = open(workdir / f"seed{seed}.log", "w")
            running.append((seed, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log))
        for seed, process, log in running:
            if process.wait() != 0:
                print(f"seed {seed} failed (exit {process.returncode}): {log.name}", file=sys.stderr)
            log.close()


def row(out: Path) -> dict:
    """One finished run's evaluations (metrics.jsonl) and summary (summary.json)."""
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    evals = {r["step"]: (r["eval/accuracy"], r.get("eval/accuracy_sampled")) for r in metrics
             if r.get("eval/accuracy") is not None}
    (greedy0, sampled0), (greedy1, sampled1) = evals[0], evals[max(evals)]
    return {"initial": summary["accuracy_initial"], "greedy": (greedy0, greedy1), "sampled": (sampled0, sampled1),
            "merged": summary.get("accuracy_merged_hf"), "curve": [round(evals[s][0], 3) for s in sorted(evals)],
            "seconds": summary.get("seconds")}


def table(seeds: list[int], workdir: Path) -> str:
    lines = ["| seed | greedy: before SFT → after SFT → after RL | gain | sampled: after SFT → after RL | gain "
             "| merged HF | greedy at each evaluation | training s |", "|---|---|---|---|---|---|---|---|"]
    gains: dict[str, list[float]] = {"greedy": [], "sampled": []}
    for seed in seeds:
        r = row(workdir / f"seed{seed}")
        (g0, g1), (s0, s1) = r["greedy"], r["sampled"]
        gains["greedy"].append(100 * (g1 - g0))
        gains["sampled"].append(100 * (s1 - s0))
        lines.append(f"| {seed} | {r['initial']:.3f} → {g0:.3f} → {g1:.3f} | {100 * (g1 - g0):+.1f} | {s0:.3f} → "
                     f"{s1:.3f} | {100 * (s1 - s0):+.1f} | {r['merged']:.3f} | {r['curve']} | {r['seconds']} |")
    return "\n".join(lines + gain_lines(gains))


def gain_lines(gains: dict[str, list[float]]) -> list[str]:
    """Per measure, its gains' mean, standard deviation and smallest over the seeds."""
    lines = []
    for name, values in gains.items():
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        lines.append(f"\n{name}: {statistics.mean(values):+.1f} ± {spread:.1f} points (mean ± sd over "
                     f"{len(values)} seeds), smallest {min(values):+.1f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (2 on 2 cores: slower each, sooner all)")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "demo-seeds")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("overrides", nargs="*", help="k=v settings for every run")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    args.workdir.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        run_seeds(seeds, args.workdir, args.parallel, args.overrides)
    print(table(seeds, args.workdir))


if __name__ == "__main__":
    main()
