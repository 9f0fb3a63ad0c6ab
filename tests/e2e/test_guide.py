"""docs/guide.md, run as written: its `bash tested` blocks, in order, on a tiny model.

The blocks run in a scratch directory holding copies of configs/ and scripts/, with generated
GSM8K-style files where the guide downloads GSM8K, and `.venv/bin/` standing for this Python's
bin directory. So the guide's commands are the test's: editing one edits the other. The cheap
checks beside it hold the guide's reward and YAML snippets to the files they show, and the Slurm
example to the lines docs/runs.md asks for.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide.md"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.M | re.S)


def guide_blocks(info: str) -> list[str]:
    """The guide's fenced blocks whose info string is `info` ("bash tested", "python", "yaml")."""
    return [body for head, body in FENCE.findall(GUIDE.read_text()) if head.strip() == info]


def gsm8k_like(count: int, start: int = 0) -> str:
    """`count` records in GSM8K's format (question; worked answer ending in "#### N"), some with
    thousands commas in the final answer, as GSM8K writes them."""
    lines = []
    for i in range(start, start + count):
        a, b = 7 * i % 40 + 2, 1000 * (i % 3) + i % 9 + 1
        total = f"{a + b:,}"
        lines.append(json.dumps({"question": f"Sam has {a} marbles and finds {b} more. How many marbles now?",
                                 "answer": f"Sam has {a}+{b}=<<{a}+{b}={a + b}>>{a + b} marbles.\n#### {total}"}))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A scratch copy of what the guide's commands read, and the raw files its download would leave."""
    work = tmp_path_factory.mktemp("guide")
    for name in ("configs", "scripts"):
        shutil.copytree(ROOT / name, work / name, ignore=shutil.ignore_patterns("__pycache__"))
    raw = work / "data" / "gsm8k" / "raw"
    raw.mkdir(parents=True)
    (raw / "train.jsonl").write_text(gsm8k_like(108))  # the guide holds 100 out: 8 to train on
    (raw / "test.jsonl").write_text(gsm8k_like(8, start=500))
    return work


def test_the_guide_runs_as_written(workdir):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    bin_dir = f"{Path(sys.executable).parent}/"
    blocks = guide_blocks("bash tested")
    assert len(blocks) == 5, blocks
    for block in blocks:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.replace(".venv/bin/", bin_dir)], cwd=workdir,
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{block}\nexit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"

    data = workdir / "data" / "gsm8k"
    train = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    assert len(train) == 8 and len((data / "heldout.jsonl").read_text().splitlines()) == 100
    assert all(r["answer"].isdigit() and r["data_source"] == "openai/gsm8k" for r in train)  # "1,041" → "1041"

    run = workdir / "runs" / "guide-gsm8k"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rl_steps = [s for s in steps if "critic/score/mean" in s]
    assert [s["step"] for s in rl_steps] == [1, 2], steps
    assert all(s.get("reward/errors", 0) == 0 for s in rl_steps), rl_steps  # verl's signature called, no failure
    assert not (run / "reward_errors.jsonl").exists() or not (run / "reward_errors.jsonl").read_text().strip()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["accuracy_before"] is not None and summary["accuracy_after"] is not None, summary
    assert (run / "checkpoints" / "latest").read_text().strip() == "iter_0000002"

    result = json.loads((run / "eval_test.json").read_text())
    assert result["prompts"] == 8 and result["model"] == "runs/guide-gsm8k/checkpoints", result
    assert 0.0 <= result["greedy"]["accuracy"] <= 1.0 and result["sampled"]["k"] == 4, result
    assert set(result["by_source"]) == {"openai/gsm8k"}, result


def test_the_reward_shown_is_the_file():
    shown = guide_blocks("python")
    assert shown == [(ROOT / "scripts" / "gsm8k_reward.py").read_text()]


def test_the_reward_scores_a_prepared_record_as_mrl_calls_it():
    """verl's signature, called through mrl's adapter with a record as prepare_data.py writes it."""
    from mrl.rewards.sandbox import load_reward_fn

    spec = f"{ROOT / 'scripts' / 'gsm8k_reward.py'}:compute_score"
    score = load_reward_fn(spec)
    record = {"data_source": "openai/gsm8k", "question": "q", "answer": "1041", "extra_info": {"index": 0}}
    assert score("q", "1000 + 41 = 1041\n#### 1,041", "1041", record) == (1.0, {"extracted": "1041"})
    assert score("q", "#### 1040", "1041", record) == (0.0, {"extracted": "1040"})
    assert score("q", "no answer", "1041", record) == (0.0, {"extracted": None})


def test_the_yaml_snippets_are_the_recipe_and_load(tmp_path):
    """The data/reward snippet holds configs/guide_gsm8k.yaml's values; the real-model recipe loads."""
    from mrl.config import load_config

    snippets = [yaml.safe_load(text) for text in guide_blocks("yaml")]
    recipe = yaml.safe_load((ROOT / "configs" / "guide_gsm8k.yaml").read_text())
    assert len(snippets) == 2
    for section, values in snippets[0].items():
        assert {k: recipe[section][k] for k in values} == values, section
    shutil.copy(ROOT / "configs" / "base.yaml", tmp_path)
    shutil.copy(ROOT / "configs" / "guide_gsm8k.yaml", tmp_path)
    (tmp_path / "my_gsm8k.yaml").write_text(guide_blocks("yaml")[1])
    cfg = load_config(tmp_path / "my_gsm8k.yaml", check_files=False)
    assert cfg.model.tiny is None and cfg.model.path == "/models/Qwen2.5-0.5B-Instruct"
    assert cfg.reward.name == "scripts/gsm8k_reward.py:compute_score"


def test_the_slurm_example_is_bash_and_lets_the_driver_take_sigterm():
    script = ROOT / "scripts" / "slurm_example.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert re.search(r"^#SBATCH --signal=B:TERM@300\b", text, re.M)
    last = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert any(line.startswith("exec .venv/bin/mrl train ") for line in last[-3:]), last[-3:]
