"""How much of a sample's score its prompt explains, from the rollout traces of finished runs.

The intra-class correlation of the scores (over every ordered pair of samples of one prompt in one
traced step, with the pooled mean and variance) estimates Var(p) / Var(score), p being a prompt's
success rate: the share of the return's variance that a critic knowing each prompt's p would
explain at the first response token. Compare it with the runs' `critic/vf_explained_var`.

    .venv/bin/python benchmarks/score_icc.py WORKDIR [WORKDIR ...]

WORKDIR holds runs (benchmarks/learning.py's `<mode>-seed<k>/`) with `rollouts/step_*.jsonl`
(logging.trace_every).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # mrl, run from any directory


def score_groups(workdir: Path) -> list[list[float]]:
    """Every traced step's samples of one prompt, as lists of scores (every run under `workdir`)."""
    from mrl.rollout_trace import TRACE_DIR, read_traces

    by_prompt: dict[tuple[str, int, int], list[float]] = {}
    for run in sorted(d.parent for d in workdir.glob(f"*/{TRACE_DIR}")):
        for record in read_traces(run):
            by_prompt.setdefault((run.name, record["step"], record["group"]), []).append(float(record["score"]))
    return list(by_prompt.values())


def intra_class_correlation(groups: list[list[float]]) -> float:
    scores = [s for g in groups for s in g]
    mean, variance = statistics.fmean(scores), statistics.pvariance(scores)
    pairs = [pair for g in groups for pair in itertools.permutations(g, 2)]
    return sum((a - mean) * (b - mean) for a, b in pairs) / len(pairs) / variance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdirs", type=Path, nargs="+")
    for workdir in parser.parse_args().workdirs:
        groups = score_groups(workdir)
        samples = sum(len(g) for g in groups)
        print(f"{workdir}: {samples} samples in {len(groups)} prompt groups, mean score "
              f"{statistics.fmean(s for g in groups for s in g):.3f}, intra-class correlation "
              f"{intra_class_correlation(groups):.3f}")


if __name__ == "__main__":
    main()
