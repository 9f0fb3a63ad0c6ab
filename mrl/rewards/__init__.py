"""Rewards: the reward-function protocol, built-in rule-based rewards, math-verify's symbolic
equivalence (scored in sandbox workers), sandboxed custom rewards and a reward-model scorer. No
megatron, no ray; transformers is imported only by the RM scorer, math-verify only by its workers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from mrl.registry import UnknownNameError
from mrl.rewards import rule_based  # noqa: F401  (registers the built-ins)
from mrl.rewards.base import REWARD_FUNCTIONS, RewardFn, RewardInput, RewardResult, call_reward
from mrl.rewards.sandbox import InWorkers, RewardLoadError, SandboxedReward
from mrl.rewards.watch import RewardErrorWatch, RewardFailedError

# sympy can run unbounded on a pathological answer, and math-verify's timeouts need a main thread.
REWARD_FUNCTIONS.register("math_verify")(
    InWorkers("mrl.rewards.math_verify_reward:math_verify", "math_verify", "pip install math-verify==0.9.0"))
# The built-ins that compare a response with data.answer_key: every record must have one.
NEEDS_ANSWER = frozenset({"exact_answer", "boxed_math", "math_verify"})

if TYPE_CHECKING:
    from mrl.rewards.reward_model import RewardModelScorer


class InProcessReward:
    """Scores samples with a trusted built-in reward function in the calling process."""

    def __init__(self, fn: RewardFn) -> None:
        self.fn = fn

    def score_batch(self, samples: Sequence[RewardInput]) -> list[RewardResult]:
        return [call_reward(self.fn, s) for s in samples]

    def close(self) -> None:
        pass


def build_reward(cfg: Any) -> InProcessReward | SandboxedReward | RewardModelScorer:
    """The scorer of a run's reward section (mrl.config.schema.RewardConfig: rewards sit below the
    config, which checks reward names against them, so the type is not imported): a built-in reward name
    (in this process, or in sandbox workers for an InWorkers one), "reward_model" (the HF
    sequence-classification model at cfg.model_path), or a custom "module:function" / "file.py:function"."""
    name = cfg.name
    if name == "reward_model":
        return _reward_model(cfg.model_path)
    builtin = REWARD_FUNCTIONS.get(name) if name in REWARD_FUNCTIONS else None
    if isinstance(builtin, InWorkers):
        return SandboxedReward(builtin.spec, timeout_s=cfg.timeout_s, workers=cfg.workers)
    if builtin is not None:
        return InProcessReward(builtin)
    if ":" in name:
        return SandboxedReward(name, timeout_s=cfg.timeout_s, workers=cfg.workers)
    raise UnknownNameError(
        REWARD_FUNCTIONS.unknown_message(name)
        + " Or 'reward_model' with reward.model_path, or a custom reward as 'package.module:function'."
    )


def _reward_model(path: str | None) -> RewardModelScorer:
    from mrl.rewards.reward_model import RewardModelScorer, reward_model_problem  # torch and transformers: on use

    problem = reward_model_problem(path)
    if problem:
        raise ValueError(problem)
    return RewardModelScorer(path)


__all__ = [
    "NEEDS_ANSWER", "REWARD_FUNCTIONS", "InProcessReward", "InWorkers", "RewardErrorWatch", "RewardFailedError",
    "RewardFn", "RewardInput", "RewardLoadError", "RewardResult", "SandboxedReward", "build_reward",
]
