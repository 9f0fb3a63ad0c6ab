"""The batch source the trainer's loop asks for a step's generations, and the two plain modes.

sync generates a step's batch, trains, then pushes; one_step_off generates batch k+1 with the
weights after step k-1 while step k trains. Their timelines: docs/training-modes.md. A source is
given what the run owns: its engines' calls (Engines) and its prompts (Prompts); no Ray here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from mrl.metrics import timer
from mrl.modes.batch import Generate, GeneratedBatch, Launch, PendingBatch, PendingResult, Push, Restored
from mrl.rollout.engine import SamplingSettings, Task, seeded_per_prompt


@dataclass(frozen=True)
class Engines:
    """What a batch source asks of the run's engines (the trainer passes mrl.launch.cluster.Cluster's
    methods; tests pass fakes)."""

    generate: Callable[[list[list[int]], list[SamplingSettings]], PendingResult]  # start: prompts' ids, one setting each
    push: Push  # the actor's weights into the engines; the push's metrics
    release: Callable[[], dict | None]  # sync mode, after a generation: colocated engines free their memory
    interrupt: Callable[[], None]  # async.partial_rollout: the generations in flight come back at once
    generate_timeout_s: float  # the longest a generate call may take (async.streaming waits this for a group)


@dataclass(frozen=True)
class Prompts:
    """The run's prompts as a batch source draws them, and where the run starts."""

    next_batch: Callable[[], list[int]]  # the sampler's next batch: indices into the training set
    prompt: Callable[[int], list[int] | Task]  # a training prompt: its token ids, or a Task (agent runs)
    sampling: Callable[[int], SamplingSettings]  # a step's sampling settings (seeded per step)
    start_step: int  # the trainer step whose weights the engines hold as the source starts
    tokenizer: Any = None  # async.partial_rollout: a continued sample's text and stop (mrl.rollout.detokenize)


def generator(engines: Engines, prompts: Prompts) -> Generate:
    """Start generating some of a step's prompts with the step's sampling settings, each prompt
    with a seed of its own (seeded_per_prompt: the same samples whichever engine or chunk)."""

    def generate(step: int, indices: list[int]) -> PendingBatch:
        pending = engines.generate([prompts.prompt(i) for i in indices],
                                   seeded_per_prompt(prompts.sampling(step), indices))
        return PendingBatch(step, indices, pending, prompts.start_step)

    return generate


class BatchSource:
    """The mode's side of the loop (docs/training-modes.md). `engine_seconds`: how long the engine
    generated for the batches this step waited for (the rollouter's busy time)."""

    def __init__(self, launch: Launch, push: Push, restored: Restored = None):
        self.launch, self.push = launch, push
        self.restored = [restored] if isinstance(restored, GeneratedBatch) else list(restored or [])
        self.engine_seconds = 0.0

    def next(self, step: int, metrics: dict) -> GeneratedBatch:
        raise NotImplementedError

    def after_update(self, step: int, trained: bool, metrics: dict) -> None:
        """Step `step` has trained, or trained nothing (`trained` False: dynamic sampling kept no
        group). Either way its weights go out when the mode's push is due, unchanged ones too: an
        engine's weight versions then count trainer steps, as policy_step reads them, in every mode
        (docs/training-modes.md, "A step that trains nothing")."""
        metrics["actor/empty_step"] = float(not trained)
        self._after_step(step, metrics)

    def _after_step(self, step: int, metrics: dict) -> None:
        """The mode's work once a step is done: push the weights after it (when due)."""
        metrics.update(self.push())

    def in_flight(self) -> list[GeneratedBatch]:
        """What a checkpoint taken now must save to resume exactly: generated batches not yet trained."""
        return []

    def upcoming(self, step: int) -> GeneratedBatch | None:
        """Step `step`'s batch if it is generated already and can no longer change (its rewards
        may then be scored ahead, while an earlier step learns); None otherwise."""
        return None

    def close(self) -> None:
        """The run stops (finished, failed or interrupted): abandon every generation in flight, so
        nothing is waited for on the way out and the engines are not kept busy with work nobody
        will train (close() again: a no-op)."""
        for pending in self._pending():
            try:
                pending.generation.cancel()
            except Exception:  # noqa: BLE001 - an engine that died already: its work is gone anyway
                pass
        self._forget()

    def _pending(self) -> list[PendingBatch]:
        """The generations started and not yet collected."""
        return []

    def _forget(self) -> None:
        """Drop the references to the generations in flight (after close)."""

    def _take_restored(self, step: int) -> GeneratedBatch | None:
        """The checkpoint's next batch in flight, which must be this step's (None: none left)."""
        batch = self.restored.pop(0) if self.restored else None
        if batch is not None and batch.step != step:
            raise RuntimeError(f"the checkpoint's batch in flight is for step {batch.step} but the resumed run "
                               f"starts at step {step}: the checkpoint is inconsistent; resume an earlier one")
        return batch


class SyncSource(BatchSource):
    """Generate, then train, then push: every sample is on-policy (staleness 0)."""

    def __init__(self, launch: Launch, push: Push, release: Callable[[], dict | None], restored: Restored = None):
        super().__init__(launch, push, restored)
        self.release = release

    def next(self, step: int, metrics: dict) -> GeneratedBatch:
        self.engine_seconds = 0.0
        batch = self._take_restored(step)  # a one_step_off checkpoint's batch: its prompts are sampled already
        if batch is not None:
            return batch
        with timer("gen", metrics) as gen:
            batch = self.launch(step).result()
        metrics.update(self.release() or {})  # colocated: free the engine's memory for the actor's turn
        self.engine_seconds = gen.elapsed
        return replace(batch, gen_seconds=gen.elapsed)  # the driver waited for all of it


class OneStepOffSource(BatchSource):
    """Generate batch k+1 while step k trains (docs/training-modes.md)."""

    def __init__(self, launch: Launch, push: Push, last_step: int, restored: Restored = None):
        super().__init__(launch, push, restored)
        self.last_step = last_step
        self.pending: PendingBatch | None = None
        self.ready: GeneratedBatch | None = None

    def next(self, step: int, metrics: dict) -> GeneratedBatch:
        self.engine_seconds = 0.0
        if self.ready is None:
            self.ready = self._take_restored(step)
        if self.ready is None:  # the first step, or a resume from a checkpoint with nothing in flight
            self.pending = self.launch(step)
            self.ready = self._wait(metrics)
        batch, self.ready = self.ready, None
        if batch.step != step:
            raise RuntimeError(f"one_step_off: step {step} was handed the batch of step {batch.step}")
        if step < self.last_step and not self.restored:  # (a fully_async checkpoint may hold step + 1 already)
            self.pending = self.launch(step + 1)  # with the weights after step - 1, while this step trains
        return batch

    def _after_step(self, step: int, metrics: dict) -> None:
        if self.pending is not None:
            self.ready = self._wait(metrics)  # the engine is idle from here: the push cannot meet a generation
        super()._after_step(step, metrics)

    def in_flight(self) -> list[GeneratedBatch]:
        return [self.ready] if self.ready is not None else []

    def _pending(self) -> list[PendingBatch]:
        return [self.pending] if self.pending is not None else []

    def _forget(self) -> None:
        self.pending = None

    def _wait(self, metrics: dict) -> GeneratedBatch:
        with timer("gen", metrics):  # the part of the generation the driver (and the actor) waited for
            batch = self.pending.result()
        self.pending = None
        self.engine_seconds += batch.gen_seconds
        return batch

