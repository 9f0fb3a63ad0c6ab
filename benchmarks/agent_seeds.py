"""The agent recipe (configs/tiny_cpu_agent.yaml) over several seeds: does RL teach it to use the tool?

Each seed is a whole `mrl train` of the recipe (trainer.seed and rollout.seed set to it: another tiny
model, split, teacher, SFT order and samples), one at a time (benchmarks/demo_seeds.py runs them), then
one markdown row a seed: held-out task success (the reward: the true sum in the final turn) and
tool-call success (the share of episodes with a call that parsed and that the calculator answered)
after SFT → after RL, greedy and sampled; the merged HF model's success; the training episodes'
turns and tool errors at the first and last RL step; then the gains' mean, standard deviation, minimum.
Results: docs/benchmarks.md, "The agent recipe".

    .venv/bin/python benchmarks/agent_seeds.py [--seeds 0,1,2,3,4] [--workdir DIR] [k=v ...]
    .venv/bin/python benchmarks/agent_seeds.py --table-only --workdir DIR      (rows of finished runs)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from demo_seeds import gain_lines, run_seeds

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "tiny_cpu_agent.yaml"
EVALS = {"task greedy": "eval/accuracy", "task sampled": "eval/accuracy_sampled",
         "tool greedy": "eval/tool_call_success", "tool sampled": "eval/tool_call_success_sampled"}


def row(out: Path) -> dict:
    """One finished run's evaluations after SFT (step 0) and after RL, its first and last RL step, summary."""
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    evals = {r["step"]: r for r in metrics if r.get("eval/accuracy") is not None}
    steps = [r for r in metrics if "agent/turns_mean" in r]
    before, after = evals[0], evals[max(evals)]
    return {"evals": {name: (before[key], after[key]) for name, key in EVALS.items()},
            "merged": summary.get("accuracy_merged_hf"), "seconds": summary.get("seconds"),
            "turns": (steps[0]["agent/turns_mean"], steps[-1]["agent/turns_mean"]),
            "errors": (steps[0]["agent/tool_errors"], steps[-1]["agent/tool_errors"])}


def table(seeds: list[int], workdir: Path) -> str:
    names = list(EVALS)
    lines = ["| seed | " + " | ".join(f"{n}: after SFT → after RL" for n in names)
             + " | merged HF task | turns, first → last step | tool errors | training s |",
             "|---" * (len(names) + 5) + "|"]
    gains: dict[str, list[float]] = {n: [] for n in names}
    for seed in seeds:
        r = row(workdir / f"seed{seed}")
        cells = []
        for name in names:
            before, after = r["evals"][name]
            gains[name].append(100 * (after - before))
            cells.append(f"{before:.3f} → {after:.3f} ({100 * (after - before):+.1f})")
        merged = "-" if r["merged"] is None else f"{r['merged']:.3f}"
        lines.append(f"| {seed} | " + " | ".join(cells) + f" | {merged} | {r['turns'][0]:.2f} → {r['turns'][1]:.2f} "
                     f"| {r['errors'][0]:.2f} → {r['errors'][1]:.2f} | {r['seconds']} |")
    return "\n".join(lines + gain_lines(gains))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "agent-seeds")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("overrides", nargs="*", help="k=v settings for every run")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    args.workdir.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        run_seeds(seeds, args.workdir, 1, args.overrides, RECIPE)  # one at a time: 2 cores
    print(table(seeds, args.workdir))


if __name__ == "__main__":
    main()
