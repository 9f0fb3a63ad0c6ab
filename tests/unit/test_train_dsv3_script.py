"""scripts/train_dsv3.sh: valid bash, refuses to run without a cluster address, and hands `mrl train`
the recipe with exactly the overrides it documents. A stand-in `mrl` on PATH records its arguments,
so nothing is ever launched."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mrl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "train_dsv3.sh"
RECIPE = ROOT / "configs" / "dsv3_671b_grpo.yaml"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="bash is not installed")


@pytest.fixture
def fake_mrl(tmp_path):
    """A PATH whose `mrl` writes its arguments, one a line, to a file instead of training."""
    bin_dir, record = tmp_path / "bin", tmp_path / "argv.txt"
    bin_dir.mkdir()
    mrl = bin_dir / "mrl"
    mrl.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{record}"\n')
    mrl.chmod(0o755)
    return bin_dir, record


def run(args: list[str], path: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MODEL_PATH", "DATA_PATH", "RUN_DIR")}
    return subprocess.run([BASH, str(SCRIPT), *args], env=base | {"PATH": path} | env,
                          capture_output=True, text=True, timeout=30)


def test_script_is_valid_bash():
    result = subprocess.run([BASH, "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_refuses_without_cluster_address(fake_mrl):
    bin_dir, record = fake_mrl
    result = run(["rollout.temperature=0.7"], f"{bin_dir}:{os.environ['PATH']}")
    assert result.returncode != 0
    assert "no Ray cluster address" in result.stderr and "RAY_ADDRESS" in result.stderr
    assert "--address" in result.stderr
    assert not record.exists(), "mrl was started without a cluster address"
    result = run(["--address"], f"{bin_dir}:{os.environ['PATH']}")
    assert result.returncode != 0 and "--address needs a value" in result.stderr
    assert not record.exists()


def test_runs_mrl_train_with_recipe_and_overrides(fake_mrl):
    bin_dir, record = fake_mrl
    path = f"{bin_dir}:{os.environ['PATH']}"
    result = run(["--address", "head:6379", "rollout.temperature=0.7"], path)
    assert result.returncode == 0, result.stderr
    assert record.read_text().splitlines() == [
        "train", str(RECIPE), "launch.address=head:6379", "model.path=/models/DeepSeek-V3",
        "data.path=/data/dapo-math-17k.jsonl", "trainer.output_dir=/checkpoints/dsv3-671b-grpo",
        "rollout.temperature=0.7",
    ]
    result = run([], path, RAY_ADDRESS="10.0.0.1:6379", MODEL_PATH="/m/v3 bf16", DATA_PATH="/d.jsonl", RUN_DIR="/c")
    assert result.returncode == 0, result.stderr
    argv = record.read_text().splitlines()
    assert argv[2:] == ["launch.address=10.0.0.1:6379", "model.path=/m/v3 bf16", "data.path=/d.jsonl", "trainer.output_dir=/c"]


def test_script_defaults_are_the_recipe_values():
    """The overrides the script passes are valid keys, and its defaults repeat the recipe's values."""
    cfg = load_config(RECIPE, check_files=False)
    text = SCRIPT.read_text()
    for default in (cfg.model.path, cfg.data.path, cfg.trainer.output_dir):
        assert f":-{default}}}" in text
    load_config(RECIPE, ["launch.address=h:6379", "model.path=/m", "data.path=/d.jsonl", "trainer.output_dir=/c"],
                check_files=False)
