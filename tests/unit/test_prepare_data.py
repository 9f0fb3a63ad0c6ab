"""scripts/prepare_data.py (docs/guide.md): GSM8K's and verl's files become records mrl's data
loading reads, with a seeded held-out split; inputs it cannot convert are one line, exit 2."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from mrl.data import PromptTemplate, load_records, prompt_samples

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "prepare_data.py"
_spec = importlib.util.spec_from_file_location("prepare_data", SCRIPT)
prepare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prepare)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def gsm8k(count: int) -> list[dict]:
    return [{"question": f"q{i}?", "answer": f"{i} * 1000 = <<{i}*1000={i}000>>{i}000\n#### {i},000"}
            for i in range(1, count + 1)]


def verl(question: str, truth, system: str | None = None, index: int = 0) -> dict:
    prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return {"data_source": "openai/gsm8k", "prompt": prompt, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"split": "train", "index": index}}


def test_gsm8k_jsonl_splits_into_train_and_heldout(tmp_path, capsys):
    src = write_jsonl(tmp_path / "raw.jsonl", gsm8k(10))
    argv = [str(src), str(tmp_path / "train.jsonl"), "--heldout", str(tmp_path / "held.jsonl"), "--heldout-size", "3"]
    assert prepare.main(argv) == 0
    assert "wrote 7 records" in capsys.readouterr().out
    train, held = load_records(tmp_path / "train.jsonl"), load_records(tmp_path / "held.jsonl")
    assert len(train) == 7 and len(held) == 3
    indices = [r["extra_info"]["index"] for r in train + held]
    assert sorted(indices) == list(range(10)) and indices[:7] == sorted(indices[:7])  # disjoint, source order
    assert train[0] == {"data_source": "openai/gsm8k", "question": gsm8k(10)[indices[0]]["question"],
                        "answer": f"{indices[0] + 1}000",  # the number after ####, without its comma
                        "extra_info": {"index": indices[0], "solution": gsm8k(10)[indices[0]]["answer"]}}
    assert prepare.main([*argv[:2], "--heldout", str(tmp_path / "again.jsonl"), "--heldout-size", "3"]) == 0
    assert load_records(tmp_path / "again.jsonl") == held  # the same seed draws the same records
    samples = prompt_samples(train, PromptTemplate("{question} Answer after ####."))
    assert samples[0]["ground_truth"] == train[0]["answer"] and samples[0]["prompt"].startswith("q")


def test_verl_parquet_becomes_records_mrl_renders(tmp_path, capsys):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = [verl("What is 2+2?", 4, system="Be brief.", index=0), verl("What is 3+4?", 7, system="Be brief.", index=1)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    assert prepare.main([str(tmp_path / "train.parquet"), str(tmp_path / "out.parquet")]) == 0
    assert 'data.system_prompt: "Be brief."' in capsys.readouterr().out
    out = load_records(tmp_path / "out.parquet")
    assert out[0] == {"data_source": "openai/gsm8k", "ability": "math", "question": "What is 2+2?", "answer": "4",
                      "extra_info": {"split": "train", "index": 0}}
    assert out[1]["answer"] == "7"  # a ground truth that is not text becomes JSON text, as mrl passes text
    assert prepare.main([str(tmp_path / "train.parquet"), str(tmp_path / "out.jsonl")]) == 0
    assert load_records(tmp_path / "out.jsonl") == out


@pytest.mark.parametrize("records, extra, says", [
    ([verl("q", "1"), {**verl("q", "2"), "prompt": [{"role": "user", "content": "a"},
                                                     {"role": "assistant", "content": "b"},
                                                     {"role": "user", "content": "c"}]}],
     [], "record 1: its prompt has roles ['user', 'assistant', 'user']"),
    ([verl("q", "1", system="A"), verl("q", "2", system="B")], [], "2 different system messages"),
    ([{**verl("q", "1"), "reward_model": {}}], [], "record 0 has no reward_model.ground_truth"),
    ([{"question": "q", "answer": "no final line"}], [], "record 0: its answer has no '#### <number>' line"),
    ([{"text": "q"}], [], "record 0 (fields ['text']) is neither verl's"),
    (gsm8k(3), ["--heldout-size", "2"], "--heldout FILE and --heldout-size N (0 < N < 3"),
    (gsm8k(3), ["--heldout", "held.jsonl", "--heldout-size", "3"], "--heldout FILE and --heldout-size N"),
])
def test_what_it_cannot_convert_is_one_line(tmp_path, capsys, records, extra, says):
    src = write_jsonl(tmp_path / "raw.jsonl", records)
    assert prepare.main([str(src), str(tmp_path / "out.jsonl"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"prepare_data.py: {src}: ") and says in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.jsonl").exists()


def test_a_line_that_is_not_json_is_named(tmp_path, capsys):
    src = tmp_path / "raw.jsonl"
    src.write_text(json.dumps(gsm8k(1)[0]) + "\n{not json\n")
    assert prepare.main([str(src), str(tmp_path / "out.jsonl")]) == 2
    assert "line 2 is not JSON" in capsys.readouterr().err
