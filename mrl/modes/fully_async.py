"""fully_async: a rollouter that keeps the engines ahead of the trainer within a staleness bound.

A step's prompts start only while the engines hold weights at most η + 1 steps older
(async.max_staleness η); under async.partial_rollout a push interrupts the generations in flight
and continues each unfinished sample on the new weights, every token keeping its own version.
The timeline and its guarantees: docs/training-modes.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

from mrl.config import RunConfig
from mrl.metrics import timer
from mrl.modes.base import BatchSource, Engines, Prompts
from mrl.modes.batch import Generate, GeneratedBatch, PendingBatch, Push, Restored, partial_ratio
from mrl.rollout.detokenize import Detokenizer
from mrl.rollout.engine import Generation, join_routes

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
    it are dropped, as vLLM drops them. An agent's episode (`agent` set) came back whole: `rest`
    is the episode gone on from all of `prefix` (mrl.agent.runner)."""
    if prefix.agent is not None:
        if rest.prompt_ids != prefix.prompt_ids or rest.token_ids[:len(prefix.token_ids)] != prefix.token_ids:
            raise RuntimeError("a continued episode does not begin with the interrupted one's tokens: it continues "
                               "another episode")
        return rest
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
                      min(versions) if versions else rest.weight_version, versions, join_routes(prefix, rest, kept))


def continuation_seed(seed: int | None, sample: int, count: int) -> int | None:
    """The seed of a sample's `count`-th continuation (`sample`: its index in the step's batch,
    prompt-major): deterministic, and distinct per sample and continuation."""
    if seed is None:
        return None
    return ((seed * 1_000_003 + sample) * 1_009 + count) % (1 << 62)


@dataclass(kw_only=True)
class AsyncPlan:
    """What fully_async needs beyond push (the async config section, resolved: async_plan)."""

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
    batch_prompts: int = 0  # groups a step takes (data.batch_size; 0: unchecked)
    wait_s: float = 1200.0  # async.streaming: the longest a step waits for the next group to come back

    def __post_init__(self):
        if self.interrupt is not None and (self.resume is None or self.detokenize is None):
            raise ValueError("AsyncPlan: interrupt (async.partial_rollout) needs resume and detokenize, which continue "
                             "an interrupted sample and give it the text and stop of one uninterrupted request")


def async_plan(cfg: RunConfig, engines: Engines, prompts: Prompts, generate: Generate) -> AsyncPlan:
    """fully_async's plan from the run's `async` section; with async.partial_rollout, the engines'
    interrupt, the continuation of the samples it cut and their detokenizer."""
    a = cfg.async_
    # a continued sample's text and stop strings (the merge), and which stop strings vLLM may check in a continuation
    detokenize = Detokenizer(prompts.tokenizer, tuple(cfg.rollout.stop)) if a.partial_rollout else None
    return AsyncPlan(sample=prompts.next_batch, generate=generate, start_step=prompts.start_step,
                     max_staleness=a.max_staleness, sync_every=a.sync_every, queue_size=a.queue_size,
                     chunk_prompts=a.chunk_prompts or (1 if a.streaming else cfg.data.batch_size),
                     samples_per_prompt=cfg.rollout.n_samples_per_prompt,
                     interrupt=engines.interrupt if a.partial_rollout else None,
                     resume=continuation(engines, prompts, detokenize) if a.partial_rollout else None,
                     detokenize=detokenize, batch_prompts=cfg.data.batch_size, wait_s=engines.generate_timeout_s)


def continuation(engines: Engines, prompts: Prompts, detokenize: Detokenizer) -> Resume:
    """async.partial_rollout: each interrupted sample goes on from its prompt and tokens so far,
    for the rest of its token budget, with a seed of its own per continuation; an agent's episode
    goes on as itself (the Generation for a prompt: mrl.agent.runner), each turn's budget its own."""

    def resume(step: int, partials: list[Generation], keys: list[tuple[int, int]]) -> PendingBatch:
        base = prompts.sampling(step)
        settings = [replace(base, n=1, seed=continuation_seed(base.seed, sample, count)) if g.agent is not None else
                    replace(base, n=1, max_tokens=base.max_tokens - len(g.token_ids),
                            seed=continuation_seed(base.seed, sample, count),
                            stop=detokenize.continuation_stop(g.prompt_ids + g.token_ids))
                    for g, (sample, count) in zip(partials, keys)]
        pending = engines.generate([g if g.agent is not None else g.prompt_ids + g.token_ids for g in partials],
                                   settings)
        return PendingBatch(step, [], pending, prompts.start_step)

    return resume


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
    """A rollouter on the driver that keeps the engines ahead of the trainer (docs/training-modes.md).

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

    def _after_step(self, step: int, metrics: dict) -> None:
        if step % self.plan.sync_every == 0 or step == self.last_step:
            partial = self.plan.interrupt is not None
            if partial and any(c.done is None or c.resumed is not None for cs in self.running.values() for c in cs):
                self.plan.interrupt()  # the chunks in flight (and queued) come back at once, unfinished
            with timer("drain", metrics):  # the push never meets a generation: every chunk is back
                for chunks in self.running.values():
                    for chunk in chunks:
                        self._finish(chunk)
            metrics.update(self.push())  # even if nothing trained: a version is a step (BatchSource.after_update)
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

