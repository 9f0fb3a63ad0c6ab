"""Rewards: rule-based answers, sandboxed custom rewards that fail in every way, a reward model."""

import logging
import textwrap
import threading
import time

import pytest

from mrl.config.schema import RewardConfig
from mrl.registry import UnknownNameError
from mrl.rewards import REWARD_FUNCTIONS, RewardInput, RewardLoadError, RewardResult, SandboxedReward, build_reward
from mrl.rewards.rule_based import answers_equal, boxed_math, exact_answer, last_boxed


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("12+7=19", "19", 1.0),
        ("The answer is 19.", "19", 1.0),
        ("19.0", "19", 1.0),
        ("first 19, then 20", "19", 0.0),  # the last number counts
        ("total: 1,019", "1019", 1.0),
        ("-3", "-3", 1.0),
        ("3", "-3", 0.0),
        ("no number here", "19", 0.0),
        ("  Paris \n", "Paris", 1.0),  # non-numeric truth: the stripped response must equal it
        ("Paris, France", "Paris", 0.0),
    ],
)
def test_exact_answer(response, truth, score):
    assert exact_answer("q", response, truth, {})[0] == score


def test_last_boxed_balances_braces():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\{a, b\}}") == r"\{a, b\}"  # escaped braces pair up too
    assert last_boxed(r"x \fbox{7}") == "7"
    assert last_boxed(r"\boxed{\frac{1}{2}") is None  # cut off: unbalanced
    assert last_boxed("no box") is None


@pytest.mark.parametrize(
    "response, truth, score",
    [
        (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1.0),
        (r"\boxed{0.50}", "1/2", 1.0),
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{ 90^\circ }", "90", 1.0),
        (r"\boxed{50\%}", "50", 1.0),
        (r"\boxed{\text{yes}}", "yes", 1.0),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
        (r"\boxed{x+1}", r"\boxed{x + 1}", 1.0),  # a boxed ground truth is unwrapped
        (r"\boxed{1} and finally \boxed{2}", "2", 1.0),
        (r"\boxed{\sqrt{2}}", r"\sqrt{3}", 0.0),
        (r"\boxed{3}", "4", 0.0),
        ("19", "19", 0.0),  # no box, no score
    ],
)
def test_boxed_math(response, truth, score):
    assert boxed_math("q", response, truth, {})[0] == score


def test_answers_equal_by_value():
    assert answers_equal("-0.25", r"-\frac{1}{4}")
    assert not answers_equal("1/3", "0.33")


def test_registry_and_build_reward_errors():
    assert set(REWARD_FUNCTIONS.names()) >= {"exact_answer", "boxed_math", "math_verify"}
    scores = build_reward(RewardConfig("exact_answer")).score_batch([RewardInput("1+1=", "2", "2"), RewardInput("1+1=", "3", "2")])
    assert [r.score for r in scores] == [1.0, 0.0]
    with pytest.raises(UnknownNameError, match="did you mean 'exact_answer'.*package.module:function"):
        build_reward(RewardConfig("exact_answr"))


USER_REWARD = textwrap.dedent(
    """
    import os, time

    def score(prompt, response, ground_truth, metadata):
        if response == "raise":
            raise RuntimeError("user bug")
        if response == "sleep":
            time.sleep(60)
        if response == "exit":
            os._exit(3)
        if response == "bad":
            return "not a number"
        return float(len(response)), {"prompt": prompt}
    """
)


def test_custom_reward_survives_raise_hang_and_exit(tmp_path, caplog):
    path = tmp_path / "user_reward.py"
    path.write_text(USER_REWARD)
    samples = [RewardInput("p", r) for r in ("ab", "raise", "sleep", "exit", "abcd", "bad", "xyz")]
    with SandboxedReward(f"{path}:score", timeout_s=1.5, workers=2) as reward:
        with caplog.at_level(logging.WARNING, logger="mrl.rewards.sandbox"):
            start = time.monotonic()
            results = reward.score_batch(samples)
            elapsed = time.monotonic() - start
        assert [r.score for r in results] == [2.0, 0.0, 0.0, 0.0, 4.0, 0.0, 3.0]
        assert results[0].info == {"prompt": "p"} and results[0].error is None
        assert "raised RuntimeError: user bug" in results[1].error
        assert results[2].error == "timed out after 1.5s"
        assert results[3].error == "reward worker died (exit code 3)"
        assert "TypeError" in results[5].error
        assert elapsed < 10, f"a hung reward stalled the caller for {elapsed:.1f}s"
        assert reward.replaced == 2  # the hung worker and the dead one
        logged = caplog.text
        assert "timed out" in logged and "died" in logged and "user bug" in logged
        # the pool keeps working after the replacements
        assert [r.score for r in reward.score_batch([RewardInput("p", "hello")])] == [5.0]


def test_custom_reward_by_module_path(tmp_path, monkeypatch):
    (tmp_path / "mrl_test_user_rewards.py").write_text(USER_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    with build_reward(RewardConfig("mrl_test_user_rewards:score", timeout_s=5, workers=1)) as reward:
        assert [r.score for r in reward.score_batch([RewardInput("p", "abc")])] == [3.0]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_function_here", "is not an import path"),
        ("missing_file.py:score", "not found"),
        ("{user}:nope", "has no callable 'nope'"),
        ("mrl_no_such_module_xyz:score", "ModuleNotFoundError"),
    ],
)
def test_bad_custom_reward_spec_fails_at_construction(tmp_path, spec, message):
    path = tmp_path / "user_reward.py"
    path.write_text(USER_REWARD)
    with pytest.raises(RewardLoadError, match=message):
        SandboxedReward(spec.format(user=path), workers=1)


def test_reward_model_scorer_batches_like_single_samples(tmp_path, tiny_reward_model, reward_model_scores):
    from mrl.rewards.reward_model import RewardModelScorer

    samples = [RewardInput("What is 2+2? ", "4"), RewardInput("Hello ", "a much longer answer than the others"),
               RewardInput("x", "y")]
    scorer = RewardModelScorer(tiny_reward_model, batch_size=2)
    batched = [r.score for r in scorer.score_batch(samples)]
    assert batched == pytest.approx(reward_model_scores(samples), abs=1e-5)
    assert len(set(round(v, 4) for v in batched)) == 3, "different texts should score differently"
    with pytest.raises(FileNotFoundError, match="config.json"):
        RewardModelScorer(tmp_path / "nothing")


def test_reward_name_reward_model_builds_the_model_at_reward_model_path(tiny_reward_model, reward_model_scores):
    samples = [RewardInput("3+4=", "7"), RewardInput("3+4=", "12</s>")]
    scorer = build_reward(RewardConfig("reward_model", model_path=str(tiny_reward_model)))
    assert [r.score for r in scorer.score_batch(samples)] == pytest.approx(reward_model_scores(samples), abs=1e-5)
    with pytest.raises(ValueError, match="^reward.name 'reward_model' needs reward.model_path: set it to"):
        build_reward(RewardConfig("reward_model"))


# Equivalences boxed_math's normaliser misses, and near misses that must score 0.
MATH_VERIFY_CASES = [
    (r"so \boxed{\frac12}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{x=2}", "2", 1.0),
    (r"\boxed{(1,3]}", "(1,3]", 1.0),
    (r"\boxed{\{3,1,2\}}", r"\{1,2,3\}", 1.0),
    (r"\boxed{\sqrt{8}}", r"2\sqrt2", 1.0),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    (r"\boxed{\pi/2}", r"\frac{\pi}{2}", 1.0),
    (r"\boxed{1,2}", "2,1", 1.0),  # a bare ground truth "2,1" is a set, not the number 2.1
    ("The answer is $\\frac{3}{4}$.", "0.75", 1.0),  # no box: the last expression counts
    (r"\boxed{(1,3)}", "(1,3]", 0.0),  # open where the truth is closed
    (r"\boxed{\{1,2\}}", r"\{1,2,3\}", 0.0),
    (r"\boxed{\sqrt{8}}", r"3\sqrt2", 0.0),
    (r"\boxed{x^2+1}", "(x+1)^2", 0.0),
    (r"\boxed{x=3}", "2", 0.0),
    (r"\boxed{1.5708}", r"\frac{\pi}{2}", 0.0),  # rounded, not equal
    ("I cannot solve this.", "2", 0.0),
]


def test_math_verify_finds_equivalences_boxed_math_misses():
    from mrl.rewards.math_verify_reward import math_verify

    got = [(response, truth, math_verify("q", response, truth, {})[0]) for response, truth, _ in MATH_VERIFY_CASES]
    assert got == MATH_VERIFY_CASES
    missed = [(r, t) for r, t, score in MATH_VERIFY_CASES[:9] if boxed_math("q", r, t, {})[0] != score]
    assert len(missed) >= 6, missed  # what the library adds over the normaliser
    assert math_verify("q", r"\boxed{x=2}", "2", {})[1] == {"extracted": "x=2"}


def test_math_verify_refuses_a_missing_ground_truth_and_threads():
    from mrl.rewards.math_verify_reward import math_verify

    with pytest.raises(ValueError, match="data.answer_key"):
        math_verify("q", r"\boxed{1}", None, {})
    failure = []
    thread = threading.Thread(target=lambda: failure.append(pytest.raises(RuntimeError, math_verify, "q", "1", "1", {})))
    thread.start()
    thread.join()
    assert "main thread" in str(failure[0].value)


PATHOLOGICAL = r"\boxed{9^{9^{9^{9}}}}"  # unbounded, math-verify compares it with 3 for over 10 minutes


@pytest.mark.parametrize("timeout_s, error", [(30.0, "math-verify comparing the answer took over 2s"),
                                               (1.0, "timed out after 1s")])
def test_math_verify_runs_in_sandbox_workers_and_a_pathological_answer_is_bounded(timeout_s, error):
    """The sandbox's workers call it in their main thread: math-verify's own alarm ends the slow
    comparison (the worker lives on); a reward.timeout_s below that alarm kills the worker instead."""
    with build_reward(RewardConfig("math_verify", timeout_s=timeout_s, workers=1)) as reward:
        assert isinstance(reward, SandboxedReward)
        start = time.monotonic()
        (slow,) = reward.score_batch([RewardInput("q", PATHOLOGICAL, "3")])
        elapsed = time.monotonic() - start
        assert slow.score == 0.0 and slow.error is not None and error in slow.error, slow
        assert elapsed < 30, elapsed  # a killed worker's replacement (spawn, imports) counts here too
        assert reward.replaced == (1 if timeout_s < 2 else 0)
        if timeout_s > 2:  # the pool still scores
            assert [r.score for r in reward.score_batch([RewardInput("q", r"\boxed{\frac12}", "0.5")])] == [1.0]


class _SlowScorer:
    """Scores a sample by its response's length, slowly; records how many calls overlapped."""

    def __init__(self, seconds: float = 0.05):
        self.seconds, self.calls, self.running, self.most, self.closed = seconds, 0, 0, 0, False
        self._lock = threading.Lock()

    def score_batch(self, samples):
        with self._lock:
            self.calls += 1
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(self.seconds)
        with self._lock:
            self.running -= 1
        return [RewardResult(float(len(s.response))) for s in samples]

    def close(self):
        self.closed = True


def test_scores_ahead_hands_over_the_batch_scored_in_the_background():
    from mrl.rewards.ahead import ScoresAhead

    scorer = _SlowScorer()
    rewards = ScoresAhead(scorer)
    batch = [RewardInput("1+1=", "2"), RewardInput("1+1=", "22")]
    rewards.submit(7, batch)
    rewards.submit(7, batch)  # once per key
    # the held-out evaluation scores meanwhile: never at the same time as the batch ahead
    evaluation = threading.Thread(target=rewards.score_batch, args=([RewardInput("2+2=", "4")],))
    evaluation.start()
    results, ahead = rewards.take(7, batch)
    evaluation.join()
    assert ahead and [r.score for r in results] == [1.0, 2.0]
    assert scorer.calls == 2 and scorer.most == 1
    # nothing submitted for the key, or other samples than submitted: scored now
    assert rewards.take(8, batch)[1] is False
    rewards.submit(9, batch)
    other = [RewardInput("1+1=", "333")]
    results, ahead = rewards.take(9, other)
    assert not ahead and [r.score for r in results] == [3.0]
    rewards.submit(10, batch)
    rewards.close()  # waits for the batch being scored, then closes the scorer
    assert scorer.running == 0 and scorer.closed
