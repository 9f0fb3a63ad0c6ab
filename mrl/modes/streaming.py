"""async.streaming: a step takes the first prompt groups to come back, from any started step.

The staleness bound holds by deadlines (a group may be trained up to its launch's weights' step
+ η + 1), earliest deadline first; the rest (admission, pushes, partial rollout) is fully_async's.
Which groups a step trains depends on timing: docs/training-modes.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mrl.metrics import timer
from mrl.modes.batch import GeneratedBatch, Push, Restored, policy_step
from mrl.modes.fully_async import AsyncPlan, FullyAsyncSource, _merge_engine_metrics
from mrl.rollout.engine import Generation


@dataclass
class _Group:
    """A prompt group that came back whole, in async.streaming's pool until a step takes it."""

    step: int  # the step whose prompts it was sampled with
    offset: int  # its prompt's place in that step's batch (the sampler's order)
    index: int  # its prompt, in the training set
    samples: list[Generation]
    start_step: int  # its run's start step, from which its weight versions count
    deadline: int  # the last step that may train it (StreamingAsyncSource)
    span: tuple[float, float] | None = None  # its chunk's launch and return (perf_counter; None: restored)


class StreamingAsyncSource(FullyAsyncSource):
    """async.streaming: a step takes the first `batch_prompts` groups to come back whole, from any
    started step, instead of step k's prompts in the sampler's order. Admission, pushes, partial
    rollout and the queue bound (counted in groups) are FullyAsyncSource's.

    The staleness bound holds by deadlines: a group may be trained up to step d = (the step of the
    engines' weights at its launch, which its stalest token has at most) + η + 1; a group restored
    from a checkpoint: its stalest token's policy step + η + 1. Step k takes the finished groups
    earliest deadline first (then in the order they came back), and only a choice that keeps
    every later deadline D within reach: the groups due by D left behind (finished or still
    generating) must fit in steps k+1..D. When the finished groups allow no such choice, the step
    waits for more. One always
    comes: admission starts step j's prompts only on the weights of step j - η - 1 or later, so at
    most (D - k + 1) steps' worth of groups are due by D at step k.

    Which groups a step trains depends on timing, so two runs differ (not their staleness bound);
    with η = 0 every group is due at the step that sampled it, which is sync's batch. A checkpoint
    drains the engines and saves the pool by the step that sampled each group."""

    POLL_S = 0.005  # how often a waiting step looks for groups that came back

    def __init__(self, push: Push, last_step: int, plan: AsyncPlan, restored: Restored = None):
        batches = [restored] if isinstance(restored, GeneratedBatch) else list(restored or [])
        other = sorted({b.sync_every for b in batches} - {plan.sync_every})
        if other:  # the policy steps of its groups count pushes of another length
            raise RuntimeError(f"the checkpoint's groups in flight were generated with async.sync_every {other[0]}, "
                               f"this run has {plan.sync_every}: resume with async.sync_every {other[0]}")
        super().__init__(push, last_step, plan)
        self.pool: list[_Group] = [
            _Group(b.step, offset, index, samples, start, self._deadline(samples, start))
            for b in batches for offset, (index, samples, start)
            in enumerate(zip(b.prompt_indices, b.groups, b.start_steps or [b.start_step] * len(b.groups)))]
        if batches:  # the checkpoint's last entry is the last step it had started (possibly empty)
            self.next_step = max(b.step for b in batches) + 1
        self.came_back: list[dict[str, float]] = []  # engine metrics of the chunks back since the last step

    def _after_step(self, step: int, metrics: dict) -> None:
        self._collect()  # what came back is no longer on the engines (FullyAsyncSource._busy_seconds)
        super()._after_step(step, metrics)

    def next(self, step: int, metrics: dict) -> GeneratedBatch:
        self.window = time.perf_counter()
        self._refill()
        with timer("gen", metrics):  # the part of the generation the trainer waited for
            groups = self._take(step)
        self._refill()
        starts, spans = [g.start_step for g in groups], [g.span for g in groups if g.span]
        seconds = max(end for _, end in spans) - min(start for start, _ in spans) if spans else 0.0
        batch = GeneratedBatch(step, [g.index for g in groups], [g.samples for g in groups], self.plan.start_step,
                               seconds, _merge_engine_metrics(self.came_back), self.plan.sync_every,
                               starts if set(starts) != {self.plan.start_step} else None)
        self.came_back = []
        metrics.update(self._taken_metrics(batch))
        return batch

    def _queued(self) -> int:
        return len(self.pool)

    def upcoming(self, step: int) -> GeneratedBatch | None:
        return None  # which groups a step takes is known only when it starts

    def in_flight(self) -> list[GeneratedBatch]:
        """The pool after waiting for every chunk in flight, by the step that sampled each group,
        and the last started step's entry (possibly empty: where the sampler is)."""
        for chunks in self.running.values():
            for chunk in chunks:
                self._finish(chunk)
        self._collect()
        batches = []
        for step in sorted({g.step for g in self.pool} | {self.next_step - 1}):
            groups = sorted((g for g in self.pool if g.step == step), key=lambda g: g.offset)
            batches.append(GeneratedBatch(step, [g.index for g in groups], [g.samples for g in groups],
                                          self.plan.start_step, 0.0, sync_every=self.plan.sync_every,
                                          start_steps=[g.start_step for g in groups] or None))
        return batches

    def _room(self) -> bool:
        started = len(self.pool) + sum(len(c.pending.prompt_indices) for cs in self.running.values() for c in cs)
        return started <= (self.plan.queue_size - 1) * self.plan.batch_prompts

    def _take(self, step: int) -> list[_Group]:
        """Step `step`'s groups (the class docstring), in the sampler's order; waits for them, at
        most plan.wait_s for each next group to come back."""
        limit, back = time.perf_counter() + self.plan.wait_s, len(self.pool)
        while True:
            self._collect()
            if len(self.pool) > back:
                limit, back = time.perf_counter() + self.plan.wait_s, len(self.pool)
            chosen = self._choose(step)
            if chosen is not None:
                taken = {id(g) for g in chosen}
                self.pool = [g for g in self.pool if id(g) not in taken]
                return sorted(chosen, key=lambda g: (g.step, g.offset))
            if not self.running:
                raise RuntimeError(f"async.streaming: step {step} needs {self.plan.batch_prompts} groups, {len(self.pool)} "
                                   f"came back and none is generating (the engines hold the weights after step "
                                   f"{self.weights_step}; async.max_staleness {self.plan.max_staleness})")
            if time.perf_counter() > limit:
                raise TimeoutError(f"async.streaming: step {step} waited {self.plan.wait_s:.0f}s for the next group to "
                                   f"come back: none of steps {sorted(self.running)} did")
            time.sleep(self.POLL_S)

    def _choose(self, step: int) -> list[_Group] | None:
        """The finished groups step `step` takes, earliest deadline first, if they keep every
        later deadline within reach; None: wait for more."""
        size = self.plan.batch_prompts
        overdue = [g for g in self.pool if g.deadline < step]
        if overdue:
            raise RuntimeError(f"async.streaming: a group of step {overdue[0].step} was due at step "
                               f"{overdue[0].deadline} and is still untrained at step {step}")
        ordered = sorted(self.pool, key=lambda g: g.deadline)  # stable: the order they came back
        if len(ordered) < size:
            return None
        left = [g.deadline for g in ordered[size:]] + [c.deadline for cs in self.running.values() for c in cs
                                                        for _ in c.pending.prompt_indices]
        if any(sum(d <= due for d in left) > (due - step) * size for due in set(left)):
            return None
        return ordered[:size]

    def _collect(self) -> None:
        """Every chunk that came back whole goes to the pool, group by group, in the order they came back."""
        back = [(c.launched + (c.pending.generation.seconds or 0.0), step, c)
                for step, chunks in self.running.items() for c in chunks if c.finished()]
        for _, step, chunk in sorted(back, key=lambda b: b[0]):
            part = self._finish(chunk)
            if any(g.finish_reason is None for group in part.groups for g in group):
                continue  # interrupted: continued after the push (partial rollout)
            self.running[step].remove(chunk)
            self.came_back.append(part.engine_metrics)
            self.pool += [_Group(step, chunk.offset + p, index, samples, part.start_step, chunk.deadline,
                                 (chunk.launched, chunk.launched + part.gen_seconds))
                          for p, (index, samples) in enumerate(zip(part.prompt_indices, part.groups))]
        self.running = {step: chunks for step, chunks in self.running.items() if chunks}

    def _deadline(self, samples: list[Generation], start_step: int) -> int:
        """The last step that may train restored samples: their stalest token's policy step + η + 1
        (a group of this run keeps its launch's: the engines' weights then, known exactly)."""
        steps = [policy_step(g.weight_version, start_step, self.plan.sync_every) for g in samples]
        stalest = min((start_step if s is None else s for s in steps), default=start_step)
        return stalest + self.plan.max_staleness + 1

