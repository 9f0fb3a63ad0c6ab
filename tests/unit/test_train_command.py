"""`mrl train` / `mrl sft` refuse a bad configuration before anything starts: exit 2, every problem named."""

from pathlib import Path

import pytest

from mrl.launch.commands import sft, train

RECIPE = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu_grpo.yaml")


@pytest.mark.parametrize("command", [train, sft])
def test_bad_config_exits_2_with_every_problem_named(command, capsys, tmp_path):
    code = command([RECIPE, "algo.kl_coeff=0.1", "parallel.tp=3", f"trainer.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2
    assert "kl_coeff" in err and "kl_coef" in err  # the unknown key and its close match
    assert "tp" in err.lower()  # a layout that cannot hold the model
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_missing_data_file_is_named(capsys):
    code = train([RECIPE, "data.synthetic=false", "data.path=/nonexistent/prompts.jsonl"])
    assert code == 2 and "/nonexistent/prompts.jsonl" in capsys.readouterr().err
