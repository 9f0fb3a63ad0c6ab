"""The reward-function protocol, its result type and the registry of built-in rewards.

A reward function scores one sample:
    fn(prompt: str, response: str, ground_truth: str | None, metadata: dict) -> float | (float, dict)
The optional dict carries details for logs (what was extracted, why it failed).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from mrl.registry import Registry


class RewardInput(NamedTuple):
    """One sample to score (a NamedTuple so it pickles cheaply into reward worker processes)."""

    prompt: str
    response: str
    ground_truth: str | None = None
    metadata: dict | None = None


@dataclass
class RewardResult:
    """A score and what explains it; `error` is set when the reward function failed (score 0)."""

    score: float
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class RewardLoadError(ValueError):
    """A custom reward spec that cannot be loaded; the message names the spec and the fix."""


class RewardFn(Protocol):
    def __call__(
        self, prompt: str, response: str, ground_truth: str | None, metadata: dict
    ) -> float | tuple[float, dict]: ...


REWARD_FUNCTIONS: Registry = Registry("reward function")


def to_result(value: Any) -> RewardResult:
    """Normalise what a reward function returned; raise TypeError/ValueError on anything else."""
    info: dict = {}
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        value, info = value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"a reward function must return a float or (float, dict), got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"a reward function returned a non-finite score {value}")
    return RewardResult(float(value), dict(info))


def call_reward(fn: RewardFn, sample: RewardInput) -> RewardResult:
    """Call `fn` on one sample and normalise its result."""
    return to_result(fn(sample.prompt, sample.response, sample.ground_truth, dict(sample.metadata or {})))
