"""Custom rewards with verl's compute_score signature, taken as they are; a reward that fails every
call stops the run after N steps."""

import textwrap

import pytest

from mrl.rewards import RewardErrorWatch, RewardFailedError, RewardInput, RewardLoadError, RewardResult, SandboxedReward
from mrl.rewards.base import call_reward
from mrl.rewards.signature import adapt

# verl's custom reward: called by keyword, returns a dict with "score" (or a float)
VERL_REWARD = textwrap.dedent(
    """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        correct = solution_str.strip().endswith(str(ground_truth))
        if data_source == "gsm8k":
            return {"score": float(correct), "acc": correct, "split": (extra_info or {}).get("split")}
        return 0.5 * correct
    """
)


def test_a_verl_reward_file_scores_in_the_sandbox(tmp_path):
    path = tmp_path / "verl_reward.py"
    path.write_text(VERL_REWARD)
    verl_record = {"prompt": "1+1=", "data_source": "gsm8k", "reward_model": {"ground_truth": "2"},
                   "extra_info": {"split": "train"}}
    samples = [
        RewardInput("1+1=", "so 2", None, verl_record),  # verl's parquet: the truth under reward_model
        RewardInput("1+1=", "so 3", None, verl_record),
        RewardInput("2+2=", "4", "4", {"data_source": "math"}),  # mrl's data.answer_key, a float back
    ]
    with SandboxedReward(f"{path}:compute_score", timeout_s=10, workers=1) as reward:
        results = reward.score_batch(samples)
    assert [(r.score, r.error) for r in results] == [(1.0, None), (0.0, None), (0.5, None)]
    assert results[0].info == {"acc": True, "split": "train"}


def gsm8k_style(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    return float(solution_str == ground_truth)


def takes_kwargs(solution_str, **kwargs):
    return kwargs["data_source"] == "src" and kwargs["ground_truth"] == "7"


def mrl_style(prompt, response, ground_truth, metadata=None):
    return 1.0


def neither(prompt, answer):
    return 1.0


def verl_needing_more(data_source, solution_str, ground_truth, tokenizer):
    return 1.0


@pytest.mark.parametrize("fn, score", [(gsm8k_style, 1.0), (takes_kwargs, 1.0), (mrl_style, 1.0)])
def test_the_signature_decides_how_a_reward_is_called(fn, score):
    result = call_reward(adapt(fn, "r.py:fn"), RewardInput("p", "7", "7", {"data_source": "src"}))
    assert result == RewardResult(score)


@pytest.mark.parametrize("fn", [neither, verl_needing_more])
def test_a_signature_that_is_neither_is_refused_naming_both(fn):
    with pytest.raises(RewardLoadError, match=r"has neither mrl's signature fn\(prompt, response, ground_truth, "
                                              r"metadata\) nor verl's compute_score\(data_source, solution_str"):
        adapt(fn, "r.py:fn")


def test_a_verl_dict_without_a_score_is_a_failed_call():
    with pytest.raises(TypeError, match="without a 'score' key"):
        call_reward(adapt(lambda solution_str, ground_truth: {"acc": 1.0}, "r.py:fn"), RewardInput("p", "r", "t"))


def failed(n: int) -> list[RewardResult]:
    return [RewardResult(0.0, {}, f"raised ValueError: bad {i}") for i in range(n)]


def test_the_watch_counts_errors_and_stops_after_n_steps_where_every_call_failed(tmp_path):
    watch = RewardErrorWatch(3, tmp_path / "reward_errors.jsonl")
    assert watch.observe(failed(2) + [RewardResult(1.0)] * 2) == {"reward/errors": 2.0, "reward/error_fraction": 0.5}
    assert watch.observe(failed(4))["reward/error_fraction"] == 1.0
    assert watch.observe(failed(4))["reward/errors"] == 4.0
    watch.observe(failed(3) + [RewardResult(1.0)])  # one call scored: the count starts again
    watch.observe(failed(4))
    watch.observe(failed(4))
    with pytest.raises(RewardFailedError) as info:
        watch.observe(failed(4))
    assert str(info.value) == (
        "every reward call failed in 3 steps in a row (4 calls in the last; last error: raised ValueError: bad 3); "
        f"each failure is in {tmp_path / 'reward_errors.jsonl'}: fix the reward function (reward.name) or the data "
        "it reads.")
    never = RewardErrorWatch(0)
    assert [never.observe(failed(2))["reward/errors"] for _ in range(5)] == [2.0] * 5
