"""Training modes (trainer.mode): where a step's batch comes from and when the weights go out.

A mode is a batch source the loop asks next(step), after_update(step, trained) and close(); how a
step is computed is the same in every mode. batch: the records; base: the source and the sync and
one_step_off modes; fully_async and streaming: the rollouter. docs/training-modes.md tells the
timelines, the staleness bound and what a checkpoint holds.
"""

from __future__ import annotations

from typing import Callable

from mrl.modes.base import BatchSource, OneStepOffSource, SyncSource
from mrl.modes.batch import (TRAINER_PHASES, Generate, GeneratedBatch, Launch, PendingBatch, PendingResult, Push,
                             Restored, overlap_metrics, partial_ratio, policy_step)
from mrl.modes.fully_async import AsyncPlan, FullyAsyncSource, continuation_seed, continue_generation
from mrl.modes.streaming import StreamingAsyncSource

__all__ = ["TRAINER_PHASES", "AsyncPlan", "BatchSource", "FullyAsyncSource", "Generate", "GeneratedBatch", "Launch",
           "OneStepOffSource", "PendingBatch", "PendingResult", "Push", "Restored", "StreamingAsyncSource",
           "SyncSource", "continuation_seed", "continue_generation", "make_source", "overlap_metrics",
           "partial_ratio", "policy_step"]


def make_source(mode: str, launch: Launch, push: Push, release: Callable[[], dict | None], last_step: int,
                restored: Restored = None, plan: AsyncPlan | None = None) -> BatchSource:
    """The batch source of trainer.mode (`plan`: fully_async's settings and callables)."""
    if mode == "sync":
        return SyncSource(launch, push, release, restored)
    if mode == "one_step_off":  # never releases the engine: it generates while the actor trains
        return OneStepOffSource(launch, push, last_step, restored)
    if mode == "fully_async":
        if plan is None:
            raise ValueError("trainer.mode fully_async needs its AsyncPlan")
        return (StreamingAsyncSource if plan.streaming else FullyAsyncSource)(push, last_step, plan, restored)
    raise ValueError(f"trainer.mode {mode!r} is not one of sync, one_step_off, fully_async")
