"""The rollout trace: each record is the sample, its reward, and what the update made of it (the
row's advantage and log-prob drift), also after dynamic sampling dropped rows; bounded in size."""

from types import SimpleNamespace

import pytest
import torch

from mrl.experience import rollout_batch, select_rows
from mrl.rewards import RewardResult
from mrl.rollout.engine import Generation
from mrl.rollout_trace import read_traces, trace_path, trace_records, trace_rollouts


def _step():
    """Two prompts × two samples; the engine had received 3 weight updates."""
    groups = [[Generation([1, 2], [3, 4], "7", [-0.5, -0.25], "stop", 3),
               Generation([1, 2], [5], "x" * 40, [-1.0], "length", 3)],
              [Generation([6], [7, 8, 9], "12", [-0.1, -0.2, -0.3], "stop", 3),
               Generation([6], [], "", [], "stop", 3)]]
    prompts = [{"prompt": "3+4=", "ground_truth": "7"}, {"prompt": "5+7=", "ground_truth": "12"}]
    rewards = [RewardResult(1.0, {"extracted": "7"}), RewardResult(0.0, {"extracted": None}),
               RewardResult(0.0, {}, "ValueError: boom"), RewardResult(0.0, {})]
    batch = rollout_batch(groups, [r.score for r in rewards])
    drift = torch.tensor([[0, 0.1, -0.3], [0, 0.2, 0], [0.05, 0.05, 0.05], [0, 0, 0]])  # [B, L]: L = 4 tokens - 1
    batch["old_logprobs"] = batch["rollout_logprobs"] + drift * batch["response_mask"]
    batch["advantages"] = torch.tensor([[0.5], [-0.5], [0.0], [0.0]]) * batch["response_mask"]
    return prompts, groups, rewards, batch


def test_records_carry_the_sample_its_reward_and_what_the_update_made_of_it():
    prompts, groups, rewards, batch = _step()
    records = trace_records(5, prompts, groups, rewards, batch, start_step=2, max_samples=64, max_chars=2000)
    assert [r["sample"] for r in records] == [0, 1, 2, 3] and {r["of"] for r in records} == {4}
    first = records[0]
    assert (first["prompt"], first["response"], first["ground_truth"]) == ("3+4=", "7", "7")
    assert (first["score"], first["reward"], first["reward_info"], first["reward_error"]) == (1.0, 1.0, {"extracted": "7"}, None)
    assert first["advantage"] == pytest.approx(0.5)
    assert first["logprob_drift_mean"] == pytest.approx(0.2) and first["logprob_drift_max"] == pytest.approx(0.3)
    assert (first["response_tokens"], first["finish_reason"], first["kept"], first["truncated"]) == (2, "stop", True, {})
    # Weight version 3 in a run that started at step 2: syncs carried steps 2, 3, 4.
    assert (first["weight_version"], first["policy_step"]) == (3, 4)
    assert records[1]["finish_reason"] == "length" and records[1]["advantage"] == pytest.approx(-0.5)
    assert records[2]["reward_error"] == "ValueError: boom" and records[2]["group"] == 1
    assert records[3]["response_tokens"] == 0 and records[3]["advantage"] is None  # nothing to average


def test_rows_dropped_by_dynamic_sampling_are_traced_as_not_kept():
    prompts, groups, rewards, batch = _step()
    kept = select_rows(batch, torch.tensor([False, False, True, True]))  # group 0 dropped
    records = trace_records(5, prompts, groups, rewards, kept, start_step=0, max_samples=64, max_chars=2000)
    assert [r["kept"] for r in records] == [False, False, True, True]
    assert records[0]["advantage"] is None and records[0]["reward"] is None and records[0]["score"] == 1.0
    # The kept rows keep their own numbers, not their new row's neighbours'.
    assert records[2]["logprob_drift_mean"] == pytest.approx(0.05) and records[2]["advantage"] == pytest.approx(0.0)


def test_samples_and_text_are_capped_and_the_cut_is_named():
    prompts, groups, rewards, batch = _step()
    rewards[0].info = {"long": "y" * 100}
    records = trace_records(5, prompts, groups, rewards, batch, start_step=0, max_samples=3, max_chars=16)
    assert len(records) == 3 and records[-1]["of"] == 4
    assert records[1]["response"] == "x" * 16 and records[1]["truncated"]["response"] == 40
    assert records[2]["prompt"] == "5+7=" and "prompt" not in records[2]["truncated"]  # short fields stay whole
    assert records[0]["truncated"] == {"reward_info": len('{"long": "' + "y" * 100 + '"}')}
    assert isinstance(records[0]["reward_info"], str) and len(records[0]["reward_info"]) == 16


def test_trace_every_n_steps_into_one_file_per_step(tmp_path):
    prompts, groups, rewards, batch = _step()
    logging = SimpleNamespace(trace_every=2, trace_samples=64, trace_chars=2000)
    run = SimpleNamespace(cfg=SimpleNamespace(logging=logging), out=tmp_path, start=0)
    assert trace_rollouts(run, 3, prompts, groups, rewards, batch) is None
    assert trace_rollouts(run, 4, prompts, groups, rewards, batch) == trace_path(tmp_path, 4)
    assert trace_path(tmp_path, 4).name == "step_000004.jsonl"
    trace_rollouts(run, 4, prompts, groups, rewards, batch)  # a resumed run repeating step 4 replaces it
    assert [(r["step"], r["sample"]) for r in read_traces(tmp_path)] == [(4, 0), (4, 1), (4, 2), (4, 3)]
    logging.trace_every = 0
    assert trace_rollouts(run, 6, prompts, groups, rewards, batch) is None
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_000004.jsonl"]


def test_an_episode_is_traced_as_its_conversation_with_the_turns_that_train():
    from mrl.agent.loop import Trajectory

    episode = Trajectory([1, 2])
    episode.add_turn(Generation([1, 2], [3, 4], "<tool_call>...</tool_call>", [-0.5, -0.25], "stop", 3, [3, 3]))
    episode.add_appended([5, 6], [{"role": "tool", "content": "12" * 30}])
    episode.add_turn(Generation([1, 2, 3, 4, 5, 6], [7], "24", [-0.1], "stop", 3, [3]))
    episode.tool_calls = 1
    groups = [[episode.to_generation()]]
    rewards = [RewardResult(1.0, {})]
    batch = rollout_batch(groups, [1.0])
    batch["old_logprobs"], batch["advantages"] = batch["rollout_logprobs"], batch["response_mask"]
    (record,) = trace_records(5, [{"prompt": "12*2"}], groups, rewards, batch, start_step=0, max_samples=8,
                              max_chars=20)
    assert [(m["role"], m["trains"]) for m in record["conversation"]] == [
        ("assistant", True), ("tool", False), ("assistant", True)]
    assert record["conversation"][1]["content"] == "12" * 10  # cut to trace_chars
    assert record["agent"] == {"turns": 2, "tool_calls": 1, "tool_errors": 0, "truncated": False}
    assert record["response"] == "24" and record["logprob_drift_max"] == 0.0  # the tool's tokens are not scored
