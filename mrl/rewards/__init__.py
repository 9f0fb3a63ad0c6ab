"""Rewards: the reward-function protocol, built-in rule-based rewards, sandboxed custom rewards
and a reward-model scorer. No megatron, no ray; transformers is imported only by the RM scorer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from mrl.registry import UnknownNameError
from mrl.rewards import rule_based  # noqa: F401  (registers the built-ins)
from mrl.rewards.base import REWARD_FUNCTIONS, RewardFn, RewardInput, RewardResult, call_reward
from mrl.rewards.sandbox import RewardLoadError, SandboxedReward

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
    config, which checks reward names against them, so the type is not imported): a built-in reward name, "reward_model" (the HF
    sequence-classification model at cfg.model_path), or a custom "module:function" / "file.py:function"."""
    name = cfg.name
    if name == "reward_model":
        return _reward_model(cfg.model_path)
    if name in REWARD_FUNCTIONS:
        return InProcessReward(REWARD_FUNCTIONS.get(name))
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
    "REWARD_FUNCTIONS", "InProcessReward", "RewardFn", "RewardInput", "RewardLoadError", "RewardResult",
    "SandboxedReward", "build_reward",
]
