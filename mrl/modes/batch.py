"""A step's batch as it travels between the engines and the trainer, and what it says.

GeneratedBatch is a step's generations as they left the engines (all a checkpoint needs of a batch
in flight); PendingBatch one being generated. A sample's weight version maps to the trainer step
whose weights made it (policy_step), from which the staleness and overlap metrics are read.
The modes that produce batches: docs/training-modes.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from mrl.rollout.engine import Generation

# The phases in which the trainer ranks work (a timed phase of the step: timing_s/<name>).
TRAINER_PHASES = ("old_log_prob", "values", "update_critic", "update_actor", "sync_weights")


def policy_step(weight_version: int | None, start_step: int, sync_every: int = 1) -> int | None:
    """The trainer step whose weights the engine held at `weight_version`: the run's first sync
    carries the start step's weights, each later sync the step just trained (one every
    `sync_every` steps). Version 0 is the model the engine loaded at start (no trainer step)."""
    if not weight_version:
        return None
    return start_step + (weight_version - 1) * sync_every


@dataclass
class GeneratedBatch:
    """A step's generations as they left the engine (all a checkpoint needs of a batch in flight)."""

    step: int  # the trainer step that trains it
    prompt_indices: list[int]  # into the run's training set, in the sampler's order
    groups: list[list[Generation]]  # per prompt, its samples
    start_step: int  # the run's start step when it was generated: weight_version v held the weights after step start_step + v - 1
    gen_seconds: float  # how long the engine took to generate it
    engine_metrics: dict[str, float] = field(default_factory=dict)  # each engine's throughput (not checkpointed)
    sync_every: int = 1  # trainer steps per weight push when it was generated (fully_async: async.sync_every)
    # per group, its run's start step where groups of two runs meet (async.streaming after a resume)
    start_steps: list[int] | None = None

    def policy_steps(self) -> list[int | None]:
        """Per sample, the trainer step whose weights generated it (None: the engine's initial weights)."""
        starts = self.start_steps or [self.start_step] * len(self.groups)
        return [policy_step(g.weight_version, start, self.sync_every)
                for group, start in zip(self.groups, starts, strict=True) for g in group]

    def to_state(self) -> dict:
        """Plain data (lists, numbers, strings): a checkpoint's common state loads it with weights_only."""
        return {"step": self.step, "prompt_indices": list(self.prompt_indices), "start_step": self.start_step,
                "gen_seconds": self.gen_seconds, "sync_every": self.sync_every,
                "groups": [[g.to_state() for g in group] for group in self.groups],
                **({"start_steps": list(self.start_steps)} if self.start_steps else {})}

    @classmethod
    def from_state(cls, state: dict) -> GeneratedBatch:
        # a checkpoint from before token_versions: Generation.versions() derives them from weight_version
        groups = [[Generation.from_state(g) for g in group] for group in state["groups"]]
        starts = state.get("start_steps")
        return cls(int(state["step"]), [int(i) for i in state["prompt_indices"]], groups, int(state["start_step"]),
                   float(state["gen_seconds"]), sync_every=int(state.get("sync_every", 1)),
                   start_steps=[int(s) for s in starts] if starts else None)

    @staticmethod
    def list_from_state(state: dict | list | None) -> list[GeneratedBatch]:
        """A checkpoint's batches in flight: a list of states (one_step_off saved one dict)."""
        if state is None:
            return []
        return [GeneratedBatch.from_state(s) for s in ([state] if isinstance(state, dict) else state)]


class PendingResult(Protocol):
    """A generation in flight (mrl.launch.fleet.FleetGeneration)."""

    seconds: float | None
    metrics: dict[str, float]  # once result() returned: each engine's throughput

    def result(self) -> list[list[Generation]]: ...

    def cancel(self) -> None:
        """Abandon it: the engines drop it if not started; its result is never asked for."""


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
Generate = Callable[[int, list[int]], PendingBatch]  # start generating these prompts with the step's seed
Push = Callable[[], dict]  # push the actor's weights into the engine; its metrics
Restored = GeneratedBatch | list[GeneratedBatch] | None  # a checkpoint's batches in flight, in step order


def partial_ratio(batch: GeneratedBatch) -> float:
    """The share of the batch's samples whose tokens come from more than one weight version."""
    samples = [g for group in batch.groups for g in group]
    return sum(len(set(g.versions())) > 1 for g in samples) / max(len(samples), 1)


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
