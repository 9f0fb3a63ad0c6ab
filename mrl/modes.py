"""Training modes (trainer.mode): where a step's batch comes from and when the weights go out.

How a step is computed (rewards, log-probs, advantages, update: mrl/trainer.py) is the same in
every mode. A mode is a batch source the loop asks two things:
  next(step)                   the generations step `step` trains on
  after_update(step, trained)  step `step` has trained (or trained nothing): weights go out when due

sync          next(k): sample b_k's prompts, generate with the weights after step k-1, wait, and let
              a colocated engine free its memory; after_update(k): push w_k.
one_step_off  batch k+1 is generated with the weights after step k-1 while step k trains:
                gen(b1, w0); [train 1 on b1 ∥ gen(b2, w0)]; push w1; [train 2 on b2 ∥ gen(b3, w1)]; push w2; …
              next(k): b_k is ready (step k-1 generated it; step 1 generates it here), start b_{k+1};
              after_update(k): wait for b_{k+1}, then push w_k. The engine runs one call at a time,
              so the push is never asked of it before its generation is done.

A checkpoint after step k in one_step_off must hold b_{k+1} (`in_flight()`): it was generated
with w_{k-1}, which a resume cannot recreate; a source built with it (`restored`) trains it first.

Staleness of a sample trained at step k: (k - 1) - the step whose weights generated it, i.e. how
many weight versions the trainer's policy is ahead of the sampling policy (sync 0, one_step_off 1).
No Ray here: a source takes `launch(step)` and `push()` callables (tests pass fakes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Protocol

from mrl.metrics import timer
from mrl.rollout.engine import Generation

# The phases in which the trainer ranks work (a timed phase of the step: timing_s/<name>).
TRAINER_PHASES = ("old_log_prob", "values", "update_critic", "update_actor", "sync_weights")


def policy_step(weight_version: int | None, start_step: int) -> int | None:
    """The trainer step whose weights the engine held at `weight_version`: the run's first sync
    carries the start step's weights, each later sync the step just trained. Version 0 is the
    model the engine loaded at start (no trainer step)."""
    if not weight_version:
        return None
    return start_step + weight_version - 1


@dataclass
class GeneratedBatch:
    """A step's generations as they left the engine (all a checkpoint needs of a batch in flight)."""

    step: int  # the trainer step that trains it
    prompt_indices: list[int]  # into the run's training set, in the sampler's order
    groups: list[list[Generation]]  # per prompt, its samples
    start_step: int  # the run's start step when it was generated: weight_version v held the weights after step start_step + v - 1
    gen_seconds: float  # how long the engine took to generate it
    engine_metrics: dict[str, float] = field(default_factory=dict)  # each engine's throughput (not checkpointed)

    def policy_steps(self) -> list[int | None]:
        """Per sample, the trainer step whose weights generated it (None: the engine's initial weights)."""
        return [policy_step(g.weight_version, self.start_step) for group in self.groups for g in group]

    def to_state(self) -> dict:
        """Plain data (lists, numbers, strings): a checkpoint's common state loads it with weights_only."""
        return {"step": self.step, "prompt_indices": list(self.prompt_indices), "start_step": self.start_step,
                "gen_seconds": self.gen_seconds, "groups": [[asdict(g) for g in group] for group in self.groups]}

    @classmethod
    def from_state(cls, state: dict) -> GeneratedBatch:
        groups = [[Generation(**g) for g in group] for group in state["groups"]]
        return cls(int(state["step"]), [int(i) for i in state["prompt_indices"]], groups, int(state["start_step"]),
                   float(state["gen_seconds"]))


class PendingResult(Protocol):
    """A generation in flight (mrl.launch.fleet.FleetGeneration)."""

    seconds: float | None
    metrics: dict[str, float]  # once result() returned: each engine's throughput

    def result(self) -> list[list[Generation]]: ...


@dataclass
class PendingBatch:
    """A step's batch being generated."""

    step: int
    prompt_indices: list[int]
    generation: PendingResult
    start_step: int

    def result(self) -> GeneratedBatch:
        groups = self.generation.result()
        return GeneratedBatch(self.step, self.prompt_indices, groups, self.start_step, self.generation.seconds or 0.0,
                              self.generation.metrics)


Launch = Callable[[int], PendingBatch]  # sample step's prompts, start generating them with the engine's weights
Push = Callable[[], dict]  # push the actor's weights into the engine; its metrics


class BatchSource:
    """The mode's side of the loop (module docstring). `engine_seconds`: how long the engine
    generated for the batches this step waited for (the rollouter's busy time)."""

    def __init__(self, launch: Launch, push: Push, restored: GeneratedBatch | None = None):
        self.launch, self.push, self.restored = launch, push, restored
        self.engine_seconds = 0.0

    def next(self, step: int, metrics: dict) -> GeneratedBatch:
        raise NotImplementedError

    def after_update(self, step: int, trained: bool, metrics: dict) -> None:
        if trained:  # nothing trained (dynamic sampling kept no group): the engine has these weights
            metrics.update(self.push())

    def in_flight(self) -> GeneratedBatch | None:
        """What a checkpoint taken now must save to resume exactly: a generated batch not yet trained."""
        return None

    def _take_restored(self, step: int) -> GeneratedBatch | None:
        batch, self.restored = self.restored, None
        if batch is not None and batch.step != step:
            raise RuntimeError(f"the checkpoint's batch in flight is for step {batch.step} but the resumed run "
                               f"starts at step {step}: the checkpoint is inconsistent; resume an earlier one")
        return batch


class SyncSource(BatchSource):
    """Generate, then train, then push: every sample is on-policy (staleness 0)."""

    def __init__(self, launch: Launch, push: Push, release: Callable[[], None],
                 restored: GeneratedBatch | None = None):
        super().__init__(launch, push, restored)
        self.release = release

    def next(self, step: int, metrics: dict) -> GeneratedBatch:
        self.engine_seconds = 0.0
        batch = self._take_restored(step)  # a one_step_off checkpoint's batch: its prompts are sampled already
        if batch is not None:
            return batch
        with timer("gen", metrics) as gen:
            batch = self.launch(step).result()
        self.release()  # colocated: free the engine's memory for the actor's turn
        self.engine_seconds = gen.elapsed
        return replace(batch, gen_seconds=gen.elapsed)  # the driver waited for all of it


class OneStepOffSource(BatchSource):
    """Generate batch k+1 while step k trains (module docstring)."""

    def __init__(self, launch: Launch, push: Push, last_step: int, restored: GeneratedBatch | None = None):
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
        if step < self.last_step:
            self.pending = self.launch(step + 1)  # with the weights after step - 1, while this step trains
        return batch

    def after_update(self, step: int, trained: bool, metrics: dict) -> None:
        if self.pending is not None:
            self.ready = self._wait(metrics)  # the engine is idle from here: the push cannot meet a generation
        super().after_update(step, trained, metrics)

    def in_flight(self) -> GeneratedBatch | None:
        return self.ready

    def _wait(self, metrics: dict) -> GeneratedBatch:
        with timer("gen", metrics):  # the part of the generation the driver (and the actor) waited for
            batch = self.pending.result()
        self.pending = None
        self.engine_seconds += batch.gen_seconds
        return batch


def make_source(mode: str, launch: Launch, push: Push, release: Callable[[], None], last_step: int,
                restored: GeneratedBatch | None = None) -> BatchSource:
    """The batch source of trainer.mode."""
    if mode == "sync":
        return SyncSource(launch, push, release, restored)
    if mode == "one_step_off":  # never releases the engine: it generates while the actor trains
        return OneStepOffSource(launch, push, last_step, restored)
    raise ValueError(f"trainer.mode {mode!r} is not one of sync, one_step_off")


def overlap_metrics(step: int, batch: GeneratedBatch, metrics: dict[str, Any], engine_seconds: float) -> dict[str, float]:
    """Staleness of the trained batch and how long each side waited for the other this step
    (verl's names): trainer/idle_ratio, the step's share the trainer ranks had no work (waiting
    for generation, rewards); rollouter/idle_ratio, the share the engine neither generated nor
    took weights."""
    out = {}
    staleness = [step - 1 - p for p in batch.policy_steps() if p is not None]
    if staleness:
        out["async/staleness_mean"] = sum(staleness) / len(staleness)
        out["async/staleness_max"] = float(max(staleness))
    total = metrics["timing_s/step"]
    trainer = sum(metrics.get(f"timing_s/{phase}", 0.0) for phase in TRAINER_PHASES)
    engine = engine_seconds + metrics.get("timing_s/sync_weights", 0.0)
    out["trainer/idle_ratio"] = min(1.0, max(0.0, 1.0 - trainer / total))
    out["rollouter/idle_ratio"] = min(1.0, max(0.0, 1.0 - engine / total))
    return out
