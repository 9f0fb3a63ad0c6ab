"""mrl.data: prompt files and templates, the arithmetic task's splits, sampler resume."""

import json
import sys

import pytest

from mrl.data import ArithmeticTask, DataError, EpochSampler, PromptTemplate, load_records, prompt_samples


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_with_format_template(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "2+2", "answer": 4}, {"question": "3*3", "answer": "9"}])
    samples = prompt_samples(load_records(path), PromptTemplate("Q: {question}\nA:"))
    assert samples[0] == {"prompt": "Q: 2+2\nA:", "ground_truth": "4", "metadata": {"question": "2+2", "answer": 4}}
    assert samples[1]["prompt"] == "Q: 3*3\nA:" and samples[1]["ground_truth"] == "9"


def test_chat_template(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from mrl.models.tiny import build_tokenizer

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    template = PromptTemplate("{question}=", chat=True, system="be brief")
    assert template.render({"question": "1+1"}, tokenizer) == "<system>be brief</system><user>1+1=</user><assistant>"
    with pytest.raises(DataError, match="needs a tokenizer with a chat template"):
        template.render({"question": "1+1"})
    # verl's datasets: the prompt column holds the messages; its own system message wins
    verl = {"prompt": [{"role": "system", "content": "think"}, {"role": "user", "content": "2+2="}],
            "reward_model": {"ground_truth": "4"}}
    rendered = prompt_samples([verl], PromptTemplate("{prompt}", chat=True, system="be brief"),
                              "reward_model.ground_truth", tokenizer)
    assert rendered[0]["prompt"] == "<system>think</system><user>2+2=</user><assistant>"
    assert rendered[0]["ground_truth"] == "4"
    assert PromptTemplate("{prompt}", chat=True, system="be brief").render(
        {"prompt": [{"role": "user", "content": "3+3="}]}, tokenizer) == "<system>be brief</system><user>3+3=</user><assistant>"
    with pytest.raises(DataError, match="holds chat messages \\(verl's format\\): set data.chat_template: true"):
        PromptTemplate("{prompt}").render(verl)


@pytest.mark.parametrize(
    "content, suffix, message",
    [
        ('{"a": 1}\n{not json}\n', ".jsonl", "line 2 is not valid JSON"),
        ("[1, 2]\n", ".jsonl", "line 1 is a list, not a JSON object"),
        ("\n", ".jsonl", "holds no records"),
        ("a,b\n", ".csv", "use .jsonl or .parquet"),
    ],
)
def test_bad_data_files(tmp_path, content, suffix, message):
    path = tmp_path / f"d{suffix}"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        load_records(path)
    with pytest.raises(DataError, match="not found"):
        load_records(tmp_path / "missing.jsonl")


def test_template_field_missing_names_record_and_fields(tmp_path):
    with pytest.raises(DataError, match=r"record 1: prompt template needs field\(s\) \['question'\].*has \['q'\]"):
        prompt_samples([{"question": "x"}, {"q": "y"}], PromptTemplate("{question}"))


def test_parquet_without_pyarrow_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # what an install without pyarrow sees
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(DataError, match="needs pyarrow.*pip install pyarrow"):
        load_records(path)


def test_parquet_records(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": "2"}]), tmp_path / "d.parquet")
    assert load_records(tmp_path / "d.parquet") == [{"prompt": "1+1=", "answer": "2"}]


def test_arithmetic_splits_disjoint_deterministic_and_correct():
    task = ArithmeticTask(ops=("+", "-", "*"), min_operand=0, max_operand=20, heldout_fraction=0.2, seed=3)
    train = task.sample(500, "train")
    heldout = task.sample(100, "heldout")
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    assert len({r["prompt"] for r in train}) == 500, "samples within a split are distinct"
    assert train == task.sample(500, "train"), "same seed, same problems"
    assert train != task.sample(500, "train", seed=1)
    other_seed = ArithmeticTask(ops=("+", "-", "*"), max_operand=20, heldout_fraction=0.2, seed=4)
    assert {r["prompt"] for r in other_seed.sample(100, "heldout")} != {r["prompt"] for r in heldout}
    for record in train[:50] + heldout[:50]:
        assert str(eval(record["prompt"][:-1])) == record["answer"]  # the prompt is "a op b="
    # the split is a property of the problem, not of the draw
    assert all(task.split_of(*_parse(r["prompt"])) == "heldout" for r in heldout)
    share = sum(task.split_of(a, "+", b) == "heldout" for a in range(21) for b in range(21)) / 441
    assert 0.12 < share < 0.28


def _parse(prompt):
    for op in "+-*":
        if op in prompt[1:]:
            left, right = prompt[:-1].split(op, 1)
            return int(left), op, int(right)


def test_arithmetic_bad_arguments():
    with pytest.raises(ValueError, match="each must be one of"):
        ArithmeticTask(ops=("/",))
    with pytest.raises(ValueError, match="has only"):
        ArithmeticTask(max_operand=3).sample(1000, "train")


def test_sampler_covers_each_epoch_and_resumes_exactly():
    full = EpochSampler(10, 3, seed=5, drop_last=False)
    batches = [full.next_batch() for _ in range(9)]
    assert sorted(sum(batches[:4], [])) == list(range(10)), "epoch 0 covers every item once"
    assert [len(b) for b in batches[:4]] == [3, 3, 3, 1]
    assert batches[:4] != batches[4:8], "each epoch reshuffles"
    first = EpochSampler(10, 3, seed=5, drop_last=False)
    head = [first.next_batch() for _ in range(5)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = EpochSampler(10, 3, seed=5, drop_last=False)
    resumed.load_state_dict(state)
    assert head + [resumed.next_batch() for _ in range(4)] == batches


def test_sampler_drop_last_and_state_mismatch():
    sampler = EpochSampler(7, 3, seed=0)
    batches = [sampler.next_batch() for _ in range(4)]
    assert all(len(b) == 3 for b in batches) and sampler.epoch == 1
    with pytest.raises(ValueError, match="saved with batch_size=3 but this run has 2"):
        EpochSampler(7, 2).load_state_dict(sampler.state_dict())
    with pytest.raises(ValueError, match="lower data.batch_size"):
        EpochSampler(2, 3)


def test_a_dotted_answer_key_reads_verl_nested_ground_truth():
    record = {"prompt": "1+1=", "reward_model": {"ground_truth": 2}}
    (sample,) = prompt_samples([record], PromptTemplate(), answer_key="reward_model.ground_truth")
    assert sample["ground_truth"] == "2"
    assert prompt_samples([record], PromptTemplate(), answer_key="reward_model.style")[0]["ground_truth"] is None


def test_a_careless_teacher_changes_what_sft_sees_not_the_answer():
    """teacher_error: each of a problem's demonstrations is result + 10 with that probability (seeded);
    the ground truth the reward checks stays the result; SFT trains on every demonstration."""
    from mrl.inputs import tokenize_samples

    task = ArithmeticTask(ops=("+",), max_operand=20, heldout_fraction=0.2, seed=3, teacher_error=0.6)
    train = task.sample(300, "train")
    shown = [(int(d) - int(r["answer"])) for r in train for d in r["demonstrations"]]
    assert set(shown) == {0, 10} and 0.55 < sum(shown) / 10 / len(shown) < 0.65
    assert train == task.sample(300, "train"), "the same teacher every draw"
    assert all(r["demonstrations"] == [r["answer"]] for r in ArithmeticTask(("+",), max_operand=20).sample(50, "train"))

    class Chars:  # one id a character: enough to see which text became a target
        eos_token_id = 0

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) for c in text]}

    samples = tokenize_samples(prompt_samples(train[:3], PromptTemplate(), sft_key="demonstrations"), Chars())
    for sample, record in zip(samples, train):
        assert sample["ground_truth"] == record["answer"]
        assert sample["sft_targets"] == [[ord(c) for c in d] + [0] for d in record["demonstrations"]]
    (plain,) = tokenize_samples(prompt_samples(train[:1], PromptTemplate()), Chars())
    assert plain["sft_targets"] == [[ord(c) for c in train[0]["answer"]] + [0]], "no sft_key: the answer"
    with pytest.raises(ValueError, match="teacher_error"):
        ArithmeticTask(teacher_error=1.5)
