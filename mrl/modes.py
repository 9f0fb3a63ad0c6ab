"""Training modes (trainer.mode): where a step's batch comes from and when the weights go out.

How a step is computed (rewards, log-probs, advantages, update: mrl/trainer.py) is the same in
every mode. A mode is a batch source the loop asks two things:
  next(step)                   the generations step `step` trains on
  after_update(step, trained)  step `step` has trained (or trained nothing): weights go out when due
  close()                      the run stops (done, failed, Ctrl-C): cancel the generations in flight

sync          next(k): sample b_k's prompts, generate with the weights after step k-1, wait, and let
              a colocated engine free its memory; after_update(k): push w_k.
one_step_off  batch k+1 is generated with the weights after step k-1 while step k trains:
                gen(b1, w0); [train 1 on b1 ∥ gen(b2, w0)]; push w1; [train 2 on b2 ∥ gen(b3, w1)]; push w2; …
              next(k): b_k is ready (step k-1 generated it; step 1 generates it here), start b_{k+1};
              after_update(k): wait for b_{k+1}, then push w_k. The engine runs one call at a time,
              so the push is never asked of it before its generation is done.

fully_async   a rollouter (driven by this loop: it starts work at step boundaries, and chunks queue
              on the engines' actors) starts b_j's prompts, in the sampler's order and with step
              j's seed, while the engines hold w_v with j <= v + η + 1 (async.max_staleness η: no
              trained sample more than η versions behind) and the queue has room; the trainer
              takes b_k whole; after every async.sync_every steps the chunks in flight are waited
              for, then w_k is pushed. η = 0 is sync's timeline exactly.
              async.partial_rollout: instead of waiting for them, the push interrupts the engines
              (the chunks in flight come back at once with the tokens they have, and so do the
              chunks queued behind them), pushes, and continues each unfinished sample from its
              prefix on the new weights (its place in its group and batch kept; a seed per sample
              and continuation). Every token keeps the weight version that sampled it and its
              engine log-prob (Generation.token_versions, .logprobs); a sample's weight_version,
              which the staleness counts, is its oldest token's, so admission still bounds it by η.
              async/partial_ratio: the share of a step's samples with tokens of two or more versions;
              async/continued_samples: how many samples a push interrupted and continued.
              async.streaming: instead of b_k whole, step k takes the first groups to come back
              from any started step, earliest deadline first within the staleness bound
              (StreamingAsyncSource); the engines run their generate calls at once.

A checkpoint after step k in one_step_off must hold b_{k+1} (`in_flight()`): it was generated
with w_{k-1}, which a resume cannot recreate; a source built with it (`restored`) trains it first.
In fully_async it holds every started step's batch (the chunks in flight waited for).

Staleness of a sample trained at step k: (k - 1) - the step whose weights generated it (its oldest
token's, under partial rollout), i.e. how many weight versions the trainer's policy is ahead of the
sampling policy (sync 0, one_step_off 1).
No Ray here: a source takes `launch(step)` and `push()` callables (tests pass fakes).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Protocol

from mrl.metrics import timer
from mrl.rollout.detokenize import Detokenizer
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
                "groups": [[asdict(g) for g in group] for group in self.groups],
                **({"start_steps": list(self.start_steps)} if self.start_steps else {})}

    @classmethod
    def from_state(cls, state: dict) -> GeneratedBatch:
        # a checkpoint from before token_versions: Generation.versions() derives them from weight_version
        groups = [[Generation(**g) for g in group] for group in state["groups"]]
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
# async.partial_rollout: continue these unfinished samples of step `step` (one prompt each:
# prompt + tokens so far), each with its (sample key, continuation count) for its seed
Resume = Callable[[int, list[Generation], list[tuple[int, int]]], PendingBatch]


def continue_generation(prefix: Generation, rest: Generation, detokenize: Detokenizer) -> Generation:
    """A sample interrupted at a weight update (`prefix`, finish_reason None) followed by its
    continuation (`rest`, generated from prompt + prefix's tokens, possibly on newer weights): the
    whole sample, each token with its own version and engine log-prob; its weight_version is the
    oldest token's (the staleness of the sample is that of its stalest token). Its text and stop are
    those of one uninterrupted request (`detokenize`): the engine saw the continuation alone, so a
    stop string that began before the cut ends the sample here, and tokens after the one completing
    it are dropped, as vLLM drops them."""
    if rest.prompt_ids != prefix.prompt_ids + prefix.token_ids:
        raise RuntimeError(f"a continuation's prompt ({len(rest.prompt_ids)} tokens) is not the interrupted sample's "
                           f"prompt and tokens ({len(prefix.prompt_ids)} + {len(prefix.token_ids)}): it continues "
                           "another sample")
    tokens = prefix.token_ids + rest.token_ids
    stop_token = rest.finish_reason == "stop" and bool(rest.token_ids)  # an EOS (or a stop string: detokenize tells)
    sample = detokenize(prefix.prompt_ids, tokens, stop_terminated=stop_token)
    kept = sample.kept
    versions = (prefix.versions() + rest.versions())[:kept]
    return Generation(prefix.prompt_ids, tokens[:kept], sample.text, (prefix.logprobs + rest.logprobs)[:kept],
                      "stop" if sample.stop is not None else rest.finish_reason,
                      min(versions) if versions else rest.weight_version, versions)


def continuation_seed(seed: int | None, sample: int, count: int) -> int | None:
    """The seed of a sample's `count`-th continuation (`sample`: its index in the step's batch,
    prompt-major): deterministic, and distinct per sample and continuation."""
    if seed is None:
        return None
    return ((seed * 1_000_003 + sample) * 1_009 + count) % (1 << 62)


class BatchSource:
    """The mode's side of the loop (module docstring). `engine_seconds`: how long the engine
    generated for the batches this step waited for (the rollouter's busy time)."""

    def __init__(self, launch: Launch, push: Push, restored: Restored = None):
        self.launch, self.push = launch, push
        self.restored = [restored] if isinstance(restored, GeneratedBatch) else list(restored or [])
        self.engine_seconds = 0.0

    def next(self, step: int, metrics: dict) -> GeneratedBatch:
        raise NotImplementedError

    def after_update(self, step: int, trained: bool, metrics: dict) -> None:
        if trained:  # nothing trained (dynamic sampling kept no group): the engine has these weights
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
    """Generate batch k+1 while step k trains (module docstring)."""

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

    def after_update(self, step: int, trained: bool, metrics: dict) -> None:
        if self.pending is not None:
            self.ready = self._wait(metrics)  # the engine is idle from here: the push cannot meet a generation
        super().after_update(step, trained, metrics)

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


@dataclass
class AsyncPlan:
    """What fully_async needs beyond push (the async config section, resolved)."""

    sample: Callable[[], list[int]]  # the sampler's next batch of prompt indices
    generate: Generate
    start_step: int  # the trainer step whose weights the engines hold when the source starts
    max_staleness: int  # η
    sync_every: int
    queue_size: int  # steps started and not yet handed to the trainer
    chunk_prompts: int  # prompts per generate call
    samples_per_prompt: int
    interrupt: Callable[[], None] | None = None  # async.partial_rollout: stop the engines' generations now
    resume: Resume | None = None  # async.partial_rollout: continue unfinished samples
    detokenize: Detokenizer | None = None  # async.partial_rollout: a continued sample's text and stop
    streaming: bool = False  # async.streaming: a step takes the first groups to come back (StreamingAsyncSource)
    batch_prompts: int = 0  # async.streaming: groups a step takes (data.batch_size)
    wait_s: float = 1200.0  # async.streaming: the longest a step waits for the next group to come back

    def __post_init__(self):
        if self.interrupt is not None and (self.resume is None or self.detokenize is None):
            raise ValueError("AsyncPlan: interrupt (async.partial_rollout) needs resume and detokenize, which continue "
                             "an interrupted sample and give it the text and stop of one uninterrupted request")


@dataclass
class _Resumed:
    """A chunk's unfinished samples, being continued on newer weights."""

    slots: list[tuple[int, int]]  # (prompt in the chunk, sample in its group)
    pending: PendingBatch
    launched: float


@dataclass
class _Chunk:
    """Some of a step's prompts, being generated (or done)."""

    pending: PendingBatch
    launched: float  # time.perf_counter() at launch
    offset: int = 0  # its first prompt's index in the step's batch
    deadline: int = 0  # the last step that may train it: the engines' weights' step at launch + η + 1
    done: GeneratedBatch | None = None  # its generations so far (merged with continuations once collected)
    resumed: _Resumed | None = None  # partial rollout: its unfinished samples' continuations in flight
    continued: dict[tuple[int, int], int] = field(default_factory=dict)  # (prompt, sample) → continuations

    def finished(self) -> bool:
        first = self.done is not None or self.pending.generation.seconds is not None
        return first and (self.resumed is None or self.resumed.pending.generation.seconds is not None)

    def result(self) -> GeneratedBatch:
        if self.done is None:
            self.done = self.pending.result()
        return self.done


class FullyAsyncSource(BatchSource):
    """A rollouter on the driver that keeps the engines ahead of the trainer (module docstring).

    Step j's prompts are sampled and launched (in chunks of `chunk_prompts`) only while
      j <= weights_step + η + 1   (admission: the staleness bound) and
      fewer than queue_size steps are started and not yet handed to the trainer,
    where weights_step is the trainer step whose weights the engines hold. Chunks queue on the
    engines' actors, so the engines generate back to back while the trainer trains. A push waits
    for every chunk in flight, then admission moves on; with partial rollout (plan.interrupt) it
    interrupts them first and continues their unfinished samples after the push."""

    def __init__(self, push: Push, last_step: int, plan: AsyncPlan, restored: Restored = None):
        super().__init__(self._no_launch, push, restored)  # steps start in chunks (plan.generate)
        self.plan, self.last_step = plan, last_step
        self.weights_step = plan.start_step
        self.ready: dict[int, GeneratedBatch] = {b.step: b for b in self.restored}  # generated, not trained
        self.restored = []
        expected = list(range(plan.start_step + 1, plan.start_step + 1 + len(self.ready)))
        partial = [b.step for b in self.ready.values() if plan.batch_prompts and len(b.groups) != plan.batch_prompts]
        if partial:
            raise RuntimeError(f"the checkpoint's batches in flight for steps {partial} are not whole: a streaming run "
                               "(async.streaming) saved them; resume it with async.streaming: true")
        if sorted(self.ready) != expected:
            raise RuntimeError(f"the checkpoint's batches in flight are for steps {sorted(self.ready)} but the resumed "
                               f"run needs steps {expected}: the checkpoint is inconsistent; resume an earlier one")
        self.running: dict[int, list[_Chunk]] = {}  # started, not all collected
        self.next_step = plan.start_step + 1 + len(self.ready)  # the next step whose prompts to start
        self.busy: list[tuple[float, float]] = []  # finished chunks' (launch, finish) on the engines
        self.window = 0.0

    def next(self, step: int, metrics: dict) -> GeneratedBatch:
        self.window = time.perf_counter()
        self._refill()
        if step not in self.ready and step not in self.running:
            raise RuntimeError(f"fully_async: step {step}'s prompts were never started (the engines hold the weights "
                               f"after step {self.weights_step}; async.max_staleness {self.plan.max_staleness} admits "
                               f"steps up to {self.weights_step + self.plan.max_staleness + 1}; async.queue_size "
                               f"{self.plan.queue_size}): a staleness bound below sync_every - 1 deadlocks")
        if step in self.ready:
            batch = self.ready.pop(step)
        else:
            with timer("gen", metrics):  # the part of the generation the trainer waited for
                batch = self._collect(step)
        self._refill()  # this step left the queue: room for one more
        metrics.update(self._taken_metrics(batch))
        return batch

    def _taken_metrics(self, batch: GeneratedBatch) -> dict[str, float]:
        """async/queue_size (groups back and not trained), async/dropped_samples and
        async/partial_ratio of the batch a step takes."""
        return {"async/queue_size": float(self._queued()),
                "async/dropped_samples": float(len(batch.prompt_indices) * self.plan.samples_per_prompt
                                               - sum(len(group) for group in batch.groups)),
                "async/partial_ratio": partial_ratio(batch)}

    def _queued(self) -> int:
        """Prompt groups generated and not yet trained."""
        return sum(len(b.groups) for b in self.ready.values()) + sum(
            len(c.pending.prompt_indices) for chunks in self.running.values() for c in chunks if c.finished())

    def after_update(self, step: int, trained: bool, metrics: dict) -> None:
        if step % self.plan.sync_every == 0 or step == self.last_step:
            partial = self.plan.interrupt is not None
            if partial and any(c.done is None or c.resumed is not None for cs in self.running.values() for c in cs):
                self.plan.interrupt()  # the chunks in flight (and queued) come back at once, unfinished
            with timer("drain", metrics):  # the push never meets a generation: every chunk is back
                for chunks in self.running.values():
                    for chunk in chunks:
                        self._finish(chunk)
            metrics.update(self.push())  # even if nothing trained: the versions count pushes
            self.weights_step = step
            if partial:
                metrics["async/continued_samples"] = float(self._continue_unfinished())
        self._refill()
        self.engine_seconds = self._busy_seconds(time.perf_counter())

    def upcoming(self, step: int) -> GeneratedBatch | None:
        """Step `step`'s batch once every chunk of it (and every continuation of its samples) came
        back: collected now, so next(step) hands over this very batch."""
        if step not in self.ready:
            chunks = self.running.get(step)
            if not chunks or not all(c.finished() for c in chunks):
                return None
            self.ready[step] = self._collect(step)
        return self.ready[step]

    def in_flight(self) -> list[GeneratedBatch]:
        """Every started step's batch, waiting for the chunks in flight (a checkpoint drains)."""
        for step in sorted(self.running):
            self.ready[step] = self._collect(step)
        return [self.ready[step] for step in sorted(self.ready)]

    def _pending(self) -> list[PendingBatch]:
        chunks = [c for chunks in self.running.values() for c in chunks]
        return ([c.pending for c in chunks if c.done is None]
                + [c.resumed.pending for c in chunks if c.resumed is not None])

    def _forget(self) -> None:
        self.running = {}
        self.next_step = self.last_step + 1  # a closed rollouter starts nothing more

    @staticmethod
    def _no_launch(step: int) -> PendingBatch:
        raise RuntimeError(f"fully_async starts step {step}'s prompts in chunks, never as one launch")

    def _refill(self) -> None:
        """Start every step the staleness bound and the queue admit."""
        p = self.plan
        deadline = self.weights_step + p.max_staleness + 1
        while self.next_step <= self.last_step and self.next_step <= deadline and self._room():
            step, indices = self.next_step, p.sample()
            self.running[step] = [_Chunk(p.generate(step, indices[i:i + p.chunk_prompts]), time.perf_counter(), i,
                                         deadline) for i in range(0, len(indices), p.chunk_prompts)]
            self.next_step += 1

    def _room(self) -> bool:
        """Whether the queue takes one more step's prompts."""
        return len(self.ready) + len(self.running) < self.plan.queue_size

    def _collect(self, step: int) -> GeneratedBatch:
        """Step `step`'s batch: its chunks' generations in the sampler's order."""
        chunks = self.running.pop(step)
        parts = [self._finish(chunk) for chunk in chunks]
        launched = min(c.launched for c in chunks)
        span = max(c.launched + part.gen_seconds for c, part in zip(chunks, parts)) - launched
        return GeneratedBatch(step, [i for part in parts for i in part.prompt_indices],
                              [g for part in parts for g in part.groups], parts[0].start_step, span,
                              _merge_engine_metrics([part.engine_metrics for part in parts]), self.plan.sync_every)

    def _finish(self, chunk: _Chunk) -> GeneratedBatch:
        """The chunk's generations, waiting for it and for its samples' continuations in flight."""
        if chunk.done is None:
            chunk.result()
            self.busy.append((chunk.launched, chunk.launched + chunk.done.gen_seconds))
        if chunk.resumed is not None:
            resumed, chunk.resumed = chunk.resumed, None
            rest = resumed.pending.result()
            groups = [list(group) for group in chunk.done.groups]
            for (p, s), (generation,) in zip(resumed.slots, rest.groups, strict=True):
                groups[p][s] = continue_generation(groups[p][s], generation, self.plan.detokenize)
            end = resumed.launched + rest.gen_seconds
            self.busy.append((resumed.launched, end))
            chunk.done = replace(chunk.done, groups=groups, gen_seconds=end - chunk.launched,
                                 engine_metrics=_merge_engine_metrics([chunk.done.engine_metrics, rest.engine_metrics]))
        return chunk.done

    def _continue_unfinished(self) -> int:
        """After a push: start every interrupted sample's continuation on the new weights (one
        prompt per sample: its prompt and tokens so far), seeded per sample and continuation.
        Returns how many samples were continued."""
        n, continued = self.plan.samples_per_prompt, 0
        for step, chunks in self.running.items():
            for chunk in chunks:
                slots = [(p, s) for p, group in enumerate(chunk.done.groups)
                         for s, g in enumerate(group) if g.finish_reason is None]
                if not slots:
                    continue
                keys = []
                for slot in slots:
                    chunk.continued[slot] = chunk.continued.get(slot, 0) + 1
                    keys.append(((chunk.offset + slot[0]) * n + slot[1], chunk.continued[slot]))
                partials = [chunk.done.groups[p][s] for p, s in slots]
                chunk.resumed = _Resumed(slots, self.plan.resume(step, partials, keys), time.perf_counter())
                continued += len(slots)
        return continued

    def _busy_seconds(self, now: float) -> float:
        """How long since the step began at least one chunk was on the engines (queued behind
        another counts: that engine was busy). A chunk back but not yet collected was busy until
        it came back."""
        chunks = [c for step_chunks in self.running.values() for c in step_chunks]
        spans = (self.busy + [(c.launched, _ended(c, now)) for c in chunks if c.done is None]
                 + [(c.resumed.launched, _ended(c.resumed, now)) for c in chunks if c.resumed is not None])
        spans = sorted((max(a, self.window), min(b, now)) for a, b in spans if b > self.window)
        self.busy = [(a, b) for a, b in self.busy if b > self.window]
        total, end = 0.0, self.window
        for a, b in spans:
            if b > end:
                total += b - max(a, end)
                end = b
        return total


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

    def after_update(self, step: int, trained: bool, metrics: dict) -> None:
        self._collect()  # what came back is no longer on the engines (FullyAsyncSource._busy_seconds)
        super().after_update(step, trained, metrics)

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
        """Step `step`'s groups (module docstring), in the sampler's order; waits for them, at
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


def _ended(run: _Chunk | _Resumed, now: float) -> float:
    """When a chunk's (or its continuations') generation came back (`now` while it runs)."""
    seconds = run.pending.generation.seconds
    return now if seconds is None else run.launched + seconds


def _merge_engine_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Per engine over several chunks: generate seconds add up, tokens/s is their tokens over them."""
    seconds, tokens = {}, {}
    for metrics in parts:
        for key, value in metrics.items():
            if key.endswith("/gen_s"):
                engine = key[:-len("/gen_s")]
                seconds[engine] = seconds.get(engine, 0.0) + value
                tokens[engine] = tokens.get(engine, 0.0) + value * metrics.get(f"{engine}/tokens_per_s", 0.0)
    out = {}
    for engine, s in seconds.items():
        out[f"{engine}/gen_s"] = s
        out[f"{engine}/tokens_per_s"] = tokens[engine] / max(s, 1e-9)
    return out


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
