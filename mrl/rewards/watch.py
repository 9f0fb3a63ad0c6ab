"""Counts a step's failed reward calls, and stops a run whose reward function fails every call.

A reward call that raises, hangs or kills its worker scores 0 and is logged (reward_errors.jsonl):
one such sample is noise, but a step in which every call failed trains on nothing but zeros. The
watch reports each step's failures as metrics and, after `max_failing_steps` such steps in a row,
raises RewardFailedError, which `mrl train` prints as one line (exit 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from mrl.rewards.base import RewardResult


class RewardFailedError(RuntimeError):
    """Every reward call failed in N steps in a row; the message names N, the last error and the log."""


class RewardErrorWatch:
    """observe(results) once a step; max_failing_steps 0: report only, never stop."""

    def __init__(self, max_failing_steps: int, error_log: str | Path = "reward_errors.jsonl") -> None:
        if max_failing_steps < 0:
            raise ValueError(f"max_failing_steps must be >= 0 (0: never stop), got {max_failing_steps}")
        self.max_failing_steps, self.error_log = max_failing_steps, Path(error_log)
        self.failing_steps = 0  # consecutive steps in which every reward call failed

    def observe(self, results: Sequence[RewardResult]) -> dict[str, float]:
        """This step's {"reward/errors", "reward/error_fraction"}; raises RewardFailedError on the
        max_failing_steps-th step in a row whose every call failed."""
        failed = [r.error for r in results if r.error]
        if results:  # an empty step says nothing either way
            self.failing_steps = self.failing_steps + 1 if len(failed) == len(results) else 0
        if self.max_failing_steps and self.failing_steps >= self.max_failing_steps:
            last = " ".join(failed[-1].split())
            raise RewardFailedError(
                f"every reward call failed in {self.failing_steps} steps in a row ({len(results)} calls in the last; "
                f"last error: {last[:300]}{'…' if len(last) > 300 else ''}); each failure is in {self.error_log}: "
                "fix the reward function (reward.name) or the data it reads.")
        fraction = len(failed) / len(results) if results else 0.0
        return {"reward/errors": float(len(failed)), "reward/error_fraction": fraction}
