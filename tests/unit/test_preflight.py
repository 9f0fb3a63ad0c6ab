"""`mrl train` / `mrl sft` read the data, import the reward and probe the output dirs before anything
starts: a bad record, reward file or directory is one line naming it, exit 2."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mrl.cli.train import _run

RECIPE = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu_grpo.yaml")
GOOD = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


def jsonl(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def reward_file(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


def data(path: Path, *more: str) -> list[str]:
    return ["data.synthetic=false", f"data.path={path}", *more]


def rewarded(source: str):
    return lambda t: [f"reward.name={reward_file(t / 'r.py', source)}:score"]


# (overrides of the tiny recipe from tmp_path, what the one line must say)
CASES = {
    "empty jsonl": (lambda t: data(jsonl(t / "d.jsonl", "", " ")),
                    "data.path {t}/d.jsonl holds no records"),
    "malformed line": (lambda t: data(jsonl(t / "d.jsonl", json.dumps(GOOD[0]), '{"prompt": "3+3=", "answer": 6')),
                       "data.path {t}/d.jsonl line 2 is not valid JSON"),
    "missing template field": (
        lambda t: data(jsonl(t / "d.jsonl", *map(json.dumps, GOOD), '{"question": "5+5=", "answer": "10"}'),
                       "data.template=Q: {prompt}"),
        "data.path {t}/d.jsonl line 3 has no field 'prompt' (data.template uses it; its fields: answer, question): "
        "add it to every record, or change data.template."),
    "missing answer": (lambda t: data(jsonl(t / "d.jsonl", json.dumps(GOOD[0]), '{"prompt": "3+3="}')),
                       "data.path {t}/d.jsonl line 2 has no field 'answer' (data.answer_key: reward exact_answer "
                       "compares responses with it; its fields: prompt)"),
    "missing SFT demonstration": (lambda t: data(jsonl(t / "d.jsonl", *map(json.dumps, GOOD)), "data.sft_key=solution"),
                                  "data.path {t}/d.jsonl line 1 has no field 'solution' (data.sft_key: trainer.sft_steps "
                                  "trains on it; its fields: answer, prompt)"),
    "null field in held-out parquet": (
        lambda t: data(jsonl(t / "d.jsonl", json.dumps(GOOD[0])),
                       f"data.heldout_path={parquet(t / 'h.parquet', GOOD + [{'prompt': None, 'answer': '1'}])}"),
        "data.heldout_path {t}/h.parquet record 3 has 'prompt': null (data.template uses it)"),
    "parquet without the answer column": (
        lambda t: data(parquet(t / "d.parquet", [{"prompt": "1+1="}] * 3)),
        "data.path {t}/d.parquet record 1 has no field 'answer' (data.answer_key: reward exact_answer compares "
        "responses with it; its fields: prompt): add it to every record, or set data.answer_key to the field that "
        "holds the answer (2 later records have problems too)."),
    "chat messages without a chat template": (
        lambda t: data(jsonl(t / "d.jsonl", json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}))),
        "data.path {t}/d.jsonl line 1 field 'prompt' holds chat messages (verl's format): set data.chat_template: true"),
    "reward syntax error": (rewarded("def score(prompt, response:\n    return 1.0\n"),
                             "reward.name: reward '{t}/r.py:score': {t}/r.py line 1 has a syntax error"),
    "reward import error": (rewarded("import mrl_no_such_pkg_zz\n"),
                            "reward.name: reward '{t}/r.py:score': importing {t}/r.py failed with ModuleNotFoundError: "
                            "No module named 'mrl_no_such_pkg_zz': install the missing module"),
    "reward callable missing": (rewarded("def scores(prompt, response, ground_truth, metadata):\n    return 1.0\n"),
                                "reward.name: {t}/r.py has no callable 'score' (from reward '{t}/r.py:score'; its "
                                "functions: scores): fix the name after the colon."),
    "reward signature": (rewarded("def score(text, answer):\n    return 1.0\n"),
                         "reward.name: reward '{t}/r.py:score': score(text, answer) has neither mrl's signature "
                         "fn(prompt, response, ground_truth, metadata) nor verl's compute_score(data_source, "
                         "solution_str, ground_truth, extra_info=None)"),
    "output dir under a file": (
        lambda t: [f"trainer.output_dir={jsonl(t / 'taken', 'x')}/run"],
        "trainer.output_dir {t}/taken/run cannot be created: {t}/taken is a file, not a directory"),
    "output dir that takes no file": (  # /proc refuses new files, even root's
        lambda t: ["trainer.output_dir=/proc/mrl-run"],
        "trainer.output_dir /proc/mrl-run is not writable: creating a file in /proc failed"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_before_anything_starts(case, tmp_path, capsys):
    overrides, expected = CASES[case]
    started = []
    argv = [RECIPE, f"trainer.output_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}",
            *overrides(tmp_path)]
    code = _run("mrl train", argv, started.append)
    err = capsys.readouterr().err
    assert code == 2 and not started
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f": {expected.format(t=tmp_path)}" in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "ckpt").exists()


def test_a_verl_dataset_and_reward_pass(tmp_path):
    from mrl.config import load_config

    rows = [{"prompt": "1+1=", "data_source": "gsm8k", "reward_model": {"ground_truth": "2"}}]
    reward = reward_file(tmp_path / "r.py", "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                                            "    return 1.0\n")
    verl_data = data(parquet(tmp_path / "d.parquet", rows), "data.answer_key=reward_model.ground_truth")
    cfg = load_config(RECIPE, [f"trainer.output_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}",
                               *verl_data, f"reward.name={reward}:compute_score"])
    assert cfg.reward.name.endswith("r.py:compute_score")


def test_mrl_train_exits_2_with_one_line_and_starts_nothing(tmp_path):
    bad = jsonl(tmp_path / "d.jsonl", json.dumps(GOOD[0]), "{not json")
    result = subprocess.run([str(Path(sys.executable).with_name("mrl")), "train", RECIPE, *data(bad),
                             f"trainer.output_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr.count("\n") == 1 and f"data.path {bad} line 2 is not valid JSON" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]  # the run writes its dir before Ray starts
