"""Training modes (trainer.mode): where a step's batch comes from and when the weights go out.

A mode is a batch source the loop asks next(step), after_update(step, trained) and close(); how a
step is computed is the same in every mode. make_source builds it from the run's settings, what its
engines do (Engines) and its prompts (Prompts), so the trainer never sees how a mode is wired.
batch: the records; base: the source, sync and one_step_off; fully_async and streaming: the
rollouter. docs/training-modes.md tells the timelines, the staleness bound and what a checkpoint holds.
"""

from __future__ import annotations

from mrl.config import RunConfig
from mrl.modes.base import BatchSource, Engines, OneStepOffSource, Prompts, SyncSource, generator
from mrl.modes.batch import (TRAINER_PHASES, Generate, GeneratedBatch, Launch, PendingBatch, PendingResult, Push,
                             Restored, overlap_metrics, partial_ratio, policy_step)
from mrl.modes.fully_async import AsyncPlan, FullyAsyncSource, async_plan, continuation_seed, continue_generation
from mrl.modes.streaming import StreamingAsyncSource

__all__ = ["TRAINER_PHASES", "AsyncPlan", "BatchSource", "Engines", "FullyAsyncSource", "Generate", "GeneratedBatch",
           "Launch", "OneStepOffSource", "PendingBatch", "PendingResult", "Prompts", "Push", "Restored",
           "StreamingAsyncSource", "SyncSource", "continuation_seed", "continue_generation", "make_source",
           "overlap_metrics", "partial_ratio", "policy_step"]


def make_source(cfg: RunConfig, engines: Engines, prompts: Prompts, restored: Restored = None) -> BatchSource:
    """trainer.mode's batch source over the run's engines and prompts (`restored`: a checkpoint's
    batches in flight, trained first). Only fully_async builds a plan (and, with
    async.partial_rollout, a continuation and its detokenizer)."""
    mode, last_step, generate = cfg.trainer.mode, cfg.trainer.total_steps, generator(engines, prompts)

    def launch(step: int) -> PendingBatch:  # the sampler's next batch, with the step's seed
        return generate(step, prompts.next_batch())

    if mode == "sync":
        return SyncSource(launch, engines.push, engines.release, restored)
    if mode == "one_step_off":  # never releases the engines: they generate while the actor trains
        return OneStepOffSource(launch, engines.push, last_step, restored)
    if mode == "fully_async":
        source = StreamingAsyncSource if cfg.async_.streaming else FullyAsyncSource
        return source(engines.push, last_step, async_plan(cfg, engines, prompts, generate), restored)
    raise ValueError(f"trainer.mode {mode!r} is not one of sync, one_step_off, fully_async")
