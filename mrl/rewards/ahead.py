"""A run's reward scorer, able to score a batch ahead of the step that needs it.

In trainer.mode fully_async the next step's batch is often generated before this step learns; a
reward function that takes real time (math_verify's sympy in worker processes, a sandboxed
verifier, a reward model) would otherwise hold up the next step while the trainer ranks idle.
`submit` scores such a batch in a thread while the driver waits for the trainer; `take` hands the
result to the step that trains it (or scores now when nothing was submitted, or the samples differ).
Every call to the underlying scorer, ahead or now (the held-out evaluation's too), runs one at a
time: no scorer has to be thread-safe.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Hashable, Sequence

from mrl.rewards.base import RewardInput, RewardResult


class ScoresAhead:
    """Wraps a scorer (score_batch, close) with scoring ahead (module docstring)."""

    def __init__(self, scorer: Any):
        self.scorer = scorer
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mrl-rewards-ahead")
        self._ahead: dict[Hashable, tuple[list[RewardInput], Future]] = {}

    def score_batch(self, samples: Sequence[RewardInput]) -> list[RewardResult]:
        """The scorer's own call, now (after any call in flight)."""
        with self._lock:
            return self.scorer.score_batch(samples)

    def submit(self, key: Hashable, samples: Sequence[RewardInput]) -> None:
        """Start scoring `samples` in the background, for `take(key, ...)` (once per key)."""
        if key not in self._ahead:
            samples = list(samples)
            self._ahead[key] = samples, self._pool.submit(self.score_batch, samples)

    def take(self, key: Hashable, samples: Sequence[RewardInput]) -> tuple[list[RewardResult], bool]:
        """The scores of `samples` and whether they were computed ahead: the submitted result for
        `key` when it scored these very samples, else scored now."""
        submitted = self._ahead.pop(key, None)
        if submitted is not None and submitted[0] == list(samples):
            return submitted[1].result(), True  # the scorer's error, if it raised, surfaces here
        return self.score_batch(samples), False  # (after a submission in flight: the lock orders them)

    def close(self) -> None:
        """Wait for a batch being scored, then close the scorer. The wait is bounded by the
        scorer's own per-sample timeouts (reward.timeout_s in a SandboxedReward): a batch cannot be
        abandoned half way without its workers respawning behind the close."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._ahead.clear()
        self.scorer.close()
