"""Rewards: the reward-function protocol, built-in rule-based rewards, sandboxed custom rewards
and a reward-model scorer. No megatron, no ray; transformers is imported only by the RM scorer."""

from __future__ import annotations

from typing import Sequence

from mrl.registry import UnknownNameError
from mrl.rewards import rule_based  # noqa: F401  (registers the built-ins)
from mrl.rewards.base import REWARD_FUNCTIONS, RewardFn, RewardInput, RewardResult, call_reward
from mrl.rewards.sandbox import RewardLoadError, SandboxedReward


class InProcessReward:
    """Scores samples with a trusted built-in reward function in the calling process."""

    def __init__(self, fn: RewardFn) -> None:
        self.fn = fn

    def score_batch(self, samples: Sequence[RewardInput]) -> list[RewardResult]:
        return [call_reward(self.fn, s) for s in samples]

    def close(self) -> None:
        pass


def build_reward(name: str, timeout_s: float = 10.0, workers: int = 2) -> InProcessReward | SandboxedReward:
    """A scorer for a built-in reward name or a custom "module:function" / "file.py:function"."""
    if name in REWARD_FUNCTIONS:
        return InProcessReward(REWARD_FUNCTIONS.get(name))
    if ":" in name:
        return SandboxedReward(name, timeout_s=timeout_s, workers=workers)
    raise UnknownNameError(
        REWARD_FUNCTIONS.unknown_message(name) + " Or give a custom reward as 'package.module:function'."
    )


__all__ = [
    "REWARD_FUNCTIONS", "InProcessReward", "RewardFn", "RewardInput", "RewardLoadError", "RewardResult",
    "SandboxedReward", "build_reward",
]
