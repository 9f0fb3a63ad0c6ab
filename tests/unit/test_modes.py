"""trainer.mode's batch sources (mrl/modes/) against a fake engine: which weights each batch is
generated with, when the weights go out, that a push never meets a generation in flight, and that
a checkpoint's batches in flight make a resumed run train exactly the same samples; fully_async's
admission control (the staleness bound) and its η = 0 timeline, which is sync's."""

import pytest

from mrl.modes import (AsyncPlan, FullyAsyncSource, GeneratedBatch, OneStepOffSource, PendingBatch,
                       StreamingAsyncSource, SyncSource, overlap_metrics)
from mrl.rollout.engine import Generation

BATCH = 2  # prompts a step


class FakeEngine:
    """One call at a time, like the engine's Ray actor: a push while a generation is in flight fails."""

    def __init__(self, start_step: int = 0):
        self.version, self.in_flight, self.events = 0, 0, []
        self.start_step, self.sampled = start_step, 0
        self.cancel_fails = False  # cancel() raises, as for an engine that died
        self.finished = True  # generations report themselves finished (else still running)

    def launch(self, step: int) -> PendingBatch:
        return self.generate(step, self.sample())

    def sample(self) -> list[int]:
        indices = list(range(self.sampled, self.sampled + BATCH))  # the sampler's next batch
        self.sampled += BATCH
        return indices

    def generate(self, step: int, indices: list[int]) -> PendingBatch:
        self.in_flight += 1
        self.events.append(f"gen b{step} v{self.version}")
        version, engine = self.version, self

        class Pending:
            metrics = {"rollout/engine0/gen_s": 1.5}

            @property
            def seconds(self):  # None: still generating
                return 1.5 if engine.finished else None

            def result(self):
                engine.in_flight -= 1
                return [[Generation([i], [i, 1], "x", [-0.5, -0.25], "stop", version)] for i in indices]

            def cancel(self):
                engine.in_flight -= 1
                engine.events.append(f"cancel b{step} {indices}")
                if engine.cancel_fails:
                    raise RuntimeError("the engine died already")

        return PendingBatch(step, indices, Pending(), self.start_step)

    def push(self) -> dict:
        assert not self.in_flight, "a weight push reached the engine while it was generating"
        self.version += 1
        self.events.append(f"push v{self.version}")
        return {"timing_s/sync_weights": 0.5}

    def release(self) -> None:
        assert not self.in_flight, "the engine was put to sleep while it was generating"
        self.events.append("release")


def _source(mode: str, engine: FakeEngine, steps: int, restored=None):
    """sync's or one_step_off's source over the fake engine."""
    if mode == "sync":
        return SyncSource(engine.launch, engine.push, engine.release, restored)
    return OneStepOffSource(engine.launch, engine.push, steps, restored)


def _plan(engine: FakeEngine, start_step: int, max_staleness: int, sync_every: int, queue_size: int,
          chunk_prompts: int, **more) -> AsyncPlan:
    """fully_async's plan over the fake engine (one sample a prompt)."""
    return AsyncPlan(sample=engine.sample, generate=engine.generate, start_step=start_step,
                     max_staleness=max_staleness, sync_every=sync_every, queue_size=queue_size,
                     chunk_prompts=chunk_prompts, samples_per_prompt=1, **more)


def _train(source, engine: FakeEngine, steps: range, trained: list, metrics_of: dict | None = None) -> None:
    for step in steps:
        metrics = {}
        batch = source.next(step, metrics)
        engine.events.append(f"train {step} on b{batch.step}")
        trained.append((step, batch.prompt_indices, batch.policy_steps()))
        source.after_update(step, True, metrics)
        if metrics_of is not None:
            metrics_of[step] = overlap_metrics(step, batch, metrics | {"timing_s/step": 10.0}, source.engine_seconds)


def _run(mode: str, steps: int = 4):
    engine, trained, metrics = FakeEngine(), [], {}
    engine.push()  # the run's first sync: version 1 holds the start step's (0) weights
    source = _source(mode, engine, steps)
    _train(source, engine, range(1, steps + 1), trained, metrics)
    return engine, trained, metrics


def test_sync_generates_then_trains_then_pushes():
    engine, trained, metrics = _run("sync", 3)
    assert engine.events == ["push v1",
                             "gen b1 v1", "release", "train 1 on b1", "push v2",
                             "gen b2 v2", "release", "train 2 on b2", "push v3",
                             "gen b3 v3", "release", "train 3 on b3", "push v4"]
    assert [policy for _, _, policies in trained for policy in set(policies)] == [0, 1, 2]  # step k: w_{k-1}
    assert {m["async/staleness_max"] for m in metrics.values()} == {0.0}
    # The trainer works in sync_weights only here (0.5 s of 10); so does the engine, apart from the
    # generation the driver waited for (sync mode times it on the driver: an instant here).
    assert metrics[2]["trainer/idle_ratio"] == pytest.approx(0.95)
    assert metrics[2]["rollouter/idle_ratio"] == pytest.approx(0.95, abs=1e-3)


def test_one_step_off_generates_the_next_batch_while_a_step_trains():
    engine, trained, metrics = _run("one_step_off", 4)
    assert engine.events == ["push v1",
                             "gen b1 v1", "gen b2 v1", "train 1 on b1", "push v2",
                             "gen b3 v2", "train 2 on b2", "push v3",
                             "gen b4 v3", "train 3 on b3", "push v4",
                             "train 4 on b4", "push v5"]  # nothing generated for a step 5
    # b1 and b2 with w0, then b_k with w_{k-2}: step 1 is on-policy, every later one a version behind.
    assert [sorted(set(policies)) for _, _, policies in trained] == [[0], [0], [1], [2]]
    assert [metrics[s]["async/staleness_max"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert metrics[3]["async/staleness_mean"] == 1.0
    assert metrics[1]["rollouter/idle_ratio"] == pytest.approx(1 - (1.5 + 1.5 + 0.5) / 10)  # b1 and b2
    assert metrics[4]["rollouter/idle_ratio"] == pytest.approx(1 - 0.5 / 10)  # the last step generates nothing
    assert [indices for _, indices, _ in trained] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # every prompt once


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_a_resume_from_a_one_step_off_checkpoint_trains_the_saved_batch_first(mode):
    """A checkpoint after step 2 holds b3 (generated with w1, which the resumed engine never has);
    resumed, the run trains the same samples with the same policy tags as the uninterrupted one,
    and samples each prompt once (the saved sampler already counted b3's)."""
    _, uninterrupted, _ = _run("one_step_off", 4)
    engine, trained = FakeEngine(), []
    engine.push()
    source = _source("one_step_off", engine, 4)
    _train(source, engine, range(1, 3), trained)
    (saved_batch,), sampled = source.in_flight(), engine.sampled
    saved = saved_batch.to_state()
    assert saved["step"] == 3 and saved["prompt_indices"] == [4, 5]

    resumed = FakeEngine(start_step=2)  # a new engine: its version 1 holds the step-2 weights
    resumed.sampled = sampled
    resumed.push()
    source = _source(mode, resumed, 4, GeneratedBatch.from_state(saved))
    _train(source, resumed, range(3, 5), trained)
    if mode == "one_step_off":
        assert trained == uninterrupted
        assert resumed.events == ["push v1", "gen b4 v1", "train 3 on b3", "push v2", "train 4 on b4", "push v3"]
    else:  # a sync run resumed from it still trains the saved batch first; then on-policy
        assert trained[:3] == uninterrupted[:3] and trained[3][1:] == ([6, 7], [3, 3])


def test_a_saved_batch_for_another_step_is_refused():
    engine = FakeEngine()
    batch = GeneratedBatch(5, [0], [[Generation([0], [1], "x", [-1.0], "stop", 1)]], 0, 1.0)
    source = _source("one_step_off", engine, 8, batch)
    with pytest.raises(RuntimeError, match="batch in flight is for step 5 but the resumed run starts at step 3"):
        source.next(3, {})


def test_a_generated_batch_round_trips_through_plain_data():
    import torch

    batch = GeneratedBatch(3, [7, 2], [[Generation([1, 2], [3], "a", [-0.1], "length", 2)],
                                       [Generation([4], [], "", [], "stop", None)]], 1, 0.25)
    state = batch.to_state()
    assert GeneratedBatch.from_state(state) == batch
    assert batch.policy_steps() == [2, None]

    import io
    buffer = io.BytesIO()
    torch.save(state, buffer)  # what a checkpoint's common state does; it loads with weights_only
    buffer.seek(0)
    assert GeneratedBatch.from_state(torch.load(buffer, weights_only=True)) == batch


def _async_run(eta: int, steps: int, sync_every: int = 1, chunk: int = BATCH, queue: int = 8,
               engine: FakeEngine | None = None, restored=None, first: int = 1, trained=None):
    engine = engine or FakeEngine()
    if engine.version == 0:
        engine.push()
    plan = _plan(engine, start_step=first - 1, max_staleness=eta, sync_every=sync_every, queue_size=queue,
                 chunk_prompts=chunk)
    source = FullyAsyncSource(engine.push, steps, plan, restored)
    trained, metrics = [] if trained is None else trained, {}
    for step in range(first, steps + 1):
        step_metrics = {}
        batch = source.next(step, step_metrics)
        engine.events.append(f"train {step} on b{batch.step}")
        trained.append((step, batch.prompt_indices, batch.policy_steps()))
        source.after_update(step, True, step_metrics)
        metrics[step] = step_metrics | overlap_metrics(step, batch, step_metrics | {"timing_s/step": 10.0},
                                                       source.engine_seconds)
    return engine, trained, metrics, source


def test_fully_async_with_staleness_0_is_sync():
    """η = 0 admits a step's prompts only once the previous step's weights are on the engine:
    the same generations, with the same weights, in the same order as sync mode."""
    sync_engine, sync_trained, _ = _run("sync", 4)
    engine, trained, metrics, _ = _async_run(0, 4)
    assert trained == sync_trained
    assert engine.events == [e for e in sync_engine.events if e != "release"]
    assert {m["async/staleness_max"] for m in metrics.values()} == {0.0}
    assert {m["async/dropped_samples"] for m in metrics.values()} == {0.0}


@pytest.mark.parametrize("chunk", [1, BATCH])
def test_fully_async_never_starts_more_than_the_staleness_bound_admits(chunk):
    """η = 1: with the engine at version v (the weights after step v - 1), prompts of steps up to
    v + 1 may start; every trained sample is at most one version behind, most exactly one, each
    prompt is trained once in the sampler's order, and no push met a generation (FakeEngine)."""
    engine, trained, metrics, _ = _async_run(1, 5, chunk=chunk)
    version = 0
    for event in engine.events:
        if event.startswith("push"):
            version = int(event.split("v")[1])
        if event.startswith("gen"):
            assert int(event.split()[1][1:]) <= (version - 1) + 1 + 1, engine.events  # step <= weights' step + η + 1
    assert [indices for _, indices, _ in trained] == [[2 * k, 2 * k + 1] for k in range(5)]
    staleness = [step - 1 - p for step, _, policies in trained for p in policies]
    assert max(staleness) == 1 and staleness.count(1) == 8  # steps 2-5: a version behind; step 1 on-policy
    assert [metrics[s]["async/staleness_max"] for s in range(1, 6)] == [0.0, 1.0, 1.0, 1.0, 1.0]
    # the fake engine's work and pushes take milliseconds of each (pretended) 10 s step, never none of it
    assert all(0.9 < m["rollouter/idle_ratio"] < 1.0 and "async/queue_size" in m for m in metrics.values()), metrics
    if chunk == 1:  # a step's prompts go out in chunks of one prompt
        assert engine.events[:3] == ["push v1", "gen b1 v1", "gen b1 v1"]


def test_fully_async_pushes_every_sync_every_steps_within_the_bound():
    """sync_every 2 with η = 1: pushes after steps 2 and 4 (and the last); a step's samples are at
    most one version behind, and the policy steps read from the tags count pushes of two steps."""
    engine, trained, metrics, _ = _async_run(1, 5, sync_every=2)
    assert [e for e in engine.events if e.startswith("push")] == ["push v1", "push v2", "push v3", "push v4"]
    assert [sorted(set(policies)) for _, _, policies in trained] == [[0], [0], [2], [2], [4]]
    assert max(m["async/staleness_max"] for m in metrics.values()) == 1.0


def test_the_queue_bounds_how_far_the_rollouter_runs_ahead():
    engine, trained, _, _ = _async_run(5, 4, queue=1)
    # η = 5 would admit every step at once; a queue of one step starts the next only once the
    # trainer took the previous one.
    assert engine.events[:4] == ["push v1", "gen b1 v1", "gen b2 v1", "train 1 on b1"]
    assert [sorted(set(p)) for _, _, p in trained] == [[0], [0], [1], [2]]


def test_a_fully_async_checkpoint_resumes_the_sample_stream_exactly():
    """A checkpoint after step 2 (η = 2) drains and saves every started, untrained step; the
    resumed run trains the same prompts with the same policy tags, each once."""
    _, uninterrupted, _, _ = _async_run(2, 6)
    engine, trained = FakeEngine(), []
    engine.push()
    plan = _plan(engine, start_step=0, max_staleness=2, sync_every=1, queue_size=8, chunk_prompts=BATCH)
    source = FullyAsyncSource(engine.push, 6, plan)
    for step in (1, 2):
        batch = source.next(step, {})
        trained.append((step, batch.prompt_indices, batch.policy_steps()))
        source.after_update(step, True, {})
    saved = [b.to_state() for b in source.in_flight()]
    assert [s["step"] for s in saved] == [3, 4, 5] and engine.in_flight == 0  # drained
    resumed = FakeEngine(start_step=2)
    resumed.sampled = engine.sampled
    _async_run(2, 6, engine=resumed, restored=GeneratedBatch.list_from_state(saved), first=3, trained=trained)
    assert trained == uninterrupted
    assert [e for e in resumed.events if e.startswith("gen")] == ["gen b6 v2"]  # steps 3-5 came from the checkpoint
    with pytest.raises(RuntimeError, match=r"batches in flight are for steps \[4, 5\] but the resumed run needs"):
        _async_run(2, 6, restored=GeneratedBatch.list_from_state(saved[1:]), first=3)


def test_chunks_engine_metrics_add_up_per_engine():
    from mrl.modes.fully_async import _merge_engine_metrics

    merged = _merge_engine_metrics([
        {"rollout/engine0/gen_s": 1.0, "rollout/engine0/tokens_per_s": 10.0},
        {"rollout/engine0/gen_s": 3.0, "rollout/engine0/tokens_per_s": 30.0,
         "rollout/engine1/gen_s": 2.0, "rollout/engine1/tokens_per_s": 5.0}])
    assert merged == {"rollout/engine0/gen_s": 4.0, "rollout/engine0/tokens_per_s": 25.0,  # 100 tokens in 4 s
                      "rollout/engine1/gen_s": 2.0, "rollout/engine1/tokens_per_s": 5.0}


def test_the_rollouter_is_busy_while_any_chunk_is_on_the_engines_within_the_step():
    """Overlapping chunks (one queued behind another) count once; time before the step does not;
    a chunk back and not yet collected counts until it came back."""
    from types import SimpleNamespace

    from mrl.modes.fully_async import _Chunk

    _, _, _, source = _async_run(1, 1)
    source.window, source.running = 10.0, {}
    source.busy = [(8.0, 11.0), (10.5, 12.0), (11.5, 12.5), (14.0, 15.0), (2.0, 3.0)]
    assert source._busy_seconds(16.0) == pytest.approx((12.5 - 10.0) + (15.0 - 14.0))
    # chunks not collected yet: one came back after 0.5 s (busy until then, not until now), one runs
    source.window, source.busy = 10.0, []
    source.running = {2: [_Chunk(PendingBatch(2, [0], SimpleNamespace(seconds=seconds), 0), launched)
                          for launched, seconds in ((11.0, 0.5), (13.0, None))]}
    assert source._busy_seconds(16.0) == pytest.approx(0.5 + 3.0)


@pytest.mark.parametrize("cancel_fails", [False, True])
def test_closing_a_one_step_off_source_abandons_the_batch_in_flight(cancel_fails):
    """A run that fails (or is interrupted) while step 1 trains has b2 in flight: close() cancels
    it, waits for nothing, and leaves nothing to collect; a second close() does nothing."""
    engine = FakeEngine()
    engine.push()
    engine.cancel_fails = cancel_fails
    source = _source("one_step_off", engine, 4)
    source.next(1, {})
    source.close()
    source.close()
    assert engine.events == ["push v1", "gen b1 v1", "gen b2 v1", "cancel b2 [2, 3]"] and engine.in_flight == 0
    assert source.in_flight() == []


@pytest.mark.parametrize("cancel_fails", [False, True])
def test_closing_the_rollouter_cancels_every_chunk_in_flight_and_starts_nothing(cancel_fails):
    """fully_async, η = 2, chunks of one prompt: while step 1 trains, the chunks of steps 2 and 3
    (η = 2 admits up to step 3 on the step-0 weights) are queued on the engine; close() cancels each (one whose engine died already does not stop the others)
    and the rollouter starts nothing more."""
    engine = FakeEngine()
    engine.push()
    engine.cancel_fails = cancel_fails
    plan = _plan(engine, start_step=0, max_staleness=2, sync_every=1, queue_size=8, chunk_prompts=1)
    source = FullyAsyncSource(engine.push, 6, plan)
    source.next(1, {})
    source.close()
    source.close()
    cancelled = [e for e in engine.events if e.startswith("cancel")]
    assert cancelled == ["cancel b2 [2]", "cancel b2 [3]", "cancel b3 [4]", "cancel b3 [5]"]
    assert engine.in_flight == 0
    source.after_update(1, True, {})  # the weights after step 1 would admit step 4: closed, nothing starts
    assert [e for e in engine.events if e.startswith("gen")] == ["gen b1 v1", "gen b1 v1", "gen b2 v1", "gen b2 v1",
                                                                "gen b3 v1", "gen b3 v1"]
    assert source.in_flight() == []


def test_the_next_batch_is_upcoming_once_generated_and_then_handed_over_unchanged():
    """fully_async: once the next step's chunks are all back, upcoming() gives its batch (its
    rewards can then be scored ahead) and next() hands over that very batch; before, None. The
    other modes never offer one."""
    engine = FakeEngine()
    engine.push()
    plan = _plan(engine, start_step=0, max_staleness=1, sync_every=1, queue_size=8, chunk_prompts=1)
    source = FullyAsyncSource(engine.push, 3, plan)
    engine.finished = False
    first = source.next(1, {})
    assert source.upcoming(2) is None and source.upcoming(3) is None  # step 2 running, step 3 not admitted
    engine.finished = True
    upcoming = source.upcoming(2)
    assert upcoming is not None and upcoming.step == 2 and source.upcoming(2) is upcoming
    source.after_update(1, True, {})
    assert source.next(2, {}) is upcoming and first.step == 1
    for mode in ("sync", "one_step_off"):
        engine = FakeEngine()
        other = _source(mode, engine, 3)
        other.next(1, {})
        assert other.upcoming(2) is None, mode


@pytest.mark.parametrize("mode, streaming, kind", [("sync", False, SyncSource), ("one_step_off", False, OneStepOffSource),
                                               ("fully_async", False, FullyAsyncSource),
                                               ("fully_async", True, StreamingAsyncSource)])
def test_make_source_wires_a_mode_from_the_runs_settings_engines_and_prompts(mode, streaming, kind):
    """The trainer hands over its engines' calls and its prompts: each step's prompts go out with
    their token ids and a seed each from the step's settings; only sync releases the engines; only
    fully_async gets a plan (chunks from the settings, no continuation without partial rollout)."""
    from dataclasses import replace

    from mrl.config import RunConfig
    from mrl.modes import Engines, Prompts, make_source
    from mrl.rollout.engine import SamplingSettings, seeded_per_prompt

    cfg = RunConfig()
    cfg = replace(cfg, trainer=replace(cfg.trainer, mode=mode, total_steps=3),
                  async_=replace(cfg.async_, max_staleness=0, streaming=streaming),
                  data=replace(cfg.data, batch_size=BATCH), rollout=replace(cfg.rollout, n_samples_per_prompt=1))
    calls, events = [], []

    class Done:
        seconds, metrics = 0.5, {}

        def __init__(self, prompt_ids):
            self.prompt_ids = prompt_ids

        def result(self):
            return [[Generation(ids, [1], "x", [-0.5], "stop", 1)] for ids in self.prompt_ids]

    def generate(prompt_ids, settings):
        calls.append((prompt_ids, settings))
        return Done(prompt_ids)

    engines = Engines(generate=generate, push=lambda: events.append("push") or {},
                      release=lambda: events.append("release"), interrupt=lambda: events.append("interrupt"),
                      generate_timeout_s=7.0)
    prompts = Prompts(next_batch=lambda: [3, 5], prompt=lambda i: [i, i],
                      sampling=lambda step: SamplingSettings(n=1, seed=step), start_step=2)
    source = make_source(cfg, engines, prompts)
    assert type(source) is kind
    batch = source.next(3, {})
    assert (batch.step, batch.prompt_indices, batch.start_step) == (3, [3, 5], 2)
    settings = seeded_per_prompt(SamplingSettings(n=1, seed=3), [3, 5])
    if streaming:  # a prompt a call
        assert calls == [([[3, 3]], settings[:1]), ([[5, 5]], settings[1:])]
    else:
        assert calls == [([[3, 3], [5, 5]], settings)]
    assert events == (["release"] if mode == "sync" else [])
    if mode == "fully_async":
        plan = source.plan
        assert (plan.chunk_prompts, plan.batch_prompts, plan.wait_s, plan.start_step) == (1 if streaming else BATCH,
                                                                                           BATCH, 7.0, 2)
        assert plan.interrupt is plan.resume is plan.detokenize is None
    else:
        assert not hasattr(source, "plan")


# --- async.streaming: the first groups to come back, within the staleness bound ---------------


class HeldEngine(FakeEngine):
    """FakeEngine whose chunks holding a prompt of `held` do not report themselves back (a long
    generation) until released; result() still answers (the driver waiting it out)."""

    def __init__(self, start_step: int = 0, held=()):
        super().__init__(start_step)
        self.held = set(held)

    def generate(self, step: int, indices: list[int]) -> PendingBatch:
        pending = super().generate(step, indices)
        inner, engine = pending.generation, self

        class Held:
            metrics = inner.metrics

            @property
            def seconds(self):
                return None if engine.held & set(indices) else inner.seconds

            def result(self):
                return inner.result()

            def cancel(self):
                inner.cancel()

        return PendingBatch(step, indices, Held(), self.start_step)


def _streaming_run(eta: int, steps: int, engine: HeldEngine, restored=None, first: int = 1, trained=None,
                   queue: int = 8, until: int | None = None):
    """Steps first..(until or steps) of a streaming fully_async run, chunks of one prompt; the source too."""
    if engine.version == 0:
        engine.push()
    plan = _plan(engine, start_step=first - 1, max_staleness=eta, sync_every=1, queue_size=queue, chunk_prompts=1,
                 batch_prompts=BATCH, wait_s=5.0)
    source = StreamingAsyncSource(engine.push, steps, plan, restored)
    trained = [] if trained is None else trained
    for step in range(first, (until or steps) + 1):
        metrics = {}
        batch = source.next(step, metrics)
        engine.events.append(f"train {step}")
        trained.append((step, batch.prompt_indices, batch.policy_steps()))
        source.after_update(step, True, metrics)
    return trained, source


def test_streaming_trains_the_first_groups_to_come_back_within_the_bound():
    """η = 1: step 1 may take any of steps 1 and 2's prompts (all due by step 2); prompt 0 is still
    generating, so step 1 trains prompts 1 and 2, and prompt 0 (back at the push's drain) goes to
    step 2 with prompt 3. Every prompt is trained once, none more than one version behind."""
    engine = HeldEngine(held={0})
    trained, _ = _streaming_run(1, 4, engine)
    assert [indices for _, indices, _ in trained] == [[1, 2], [0, 3], [4, 5], [6, 7]]
    staleness = [step - 1 - p for step, _, policies in trained for p in policies]
    assert max(staleness) == 1 and min(staleness) == 0


def test_streaming_with_staleness_0_is_sync():
    """η = 0: every group is due at the step that sampled it, so a step waits for all of its own
    (here for prompt 0, released while it waits) and trains sync's batch."""
    import threading

    _, sync_trained, _ = _run("sync", 4)
    engine = HeldEngine(held={0})
    threading.Timer(0.05, engine.held.clear).start()
    trained, _ = _streaming_run(0, 4, engine)
    assert trained == sync_trained


def test_streaming_waits_rather_than_take_groups_that_would_make_a_later_step_miss_its_bound():
    """Step 2, two groups a step: three groups due by step 3 are still generating, two due at step 4
    have come back. Taking those two would leave three for step 3: the step waits; once one of the
    three is back it takes it and one of the later two; once two are back, those two."""
    from mrl.modes.fully_async import _Chunk
    from mrl.modes.streaming import _Group

    engine = HeldEngine()
    engine.push()
    plan = _plan(engine, start_step=0, max_staleness=2, sync_every=1, queue_size=8, chunk_prompts=1, batch_prompts=2,
                 wait_s=5.0)
    source = StreamingAsyncSource(engine.push, 6, plan)
    engine.held = {10, 11, 12}
    source.running = {3: [_Chunk(engine.generate(3, [i]), 0.0, i - 10, 3) for i in (10, 11, 12)]}
    source.pool = [_Group(4, i, 20 + i, [], 0, 4) for i in (0, 1)]
    assert source._choose(2) is None
    engine.held = {11, 12}
    source._collect()
    assert [g.index for g in source._choose(2)] == [10, 20]
    engine.held = {12}
    source._collect()
    assert [g.index for g in source._choose(2)] == [10, 11]


def test_a_streaming_checkpoint_resumes_with_every_untrained_group_and_none_twice():
    """A checkpoint after step 2 (η = 2, prompt 1 held through step 1) saves the pool by the step
    that sampled each group, and the last started step; the resumed run trains every other prompt
    once, within the bound (its policy steps count from each group's own run)."""
    engine = HeldEngine(held={1})
    trained, source = _streaming_run(2, 6, engine, until=2)
    engine.held.clear()
    saved = [b.to_state() for b in source.in_flight()]
    assert engine.in_flight == 0 and saved[-1]["step"] == source.next_step - 1
    resumed = HeldEngine(start_step=2)
    resumed.sampled = engine.sampled
    _streaming_run(2, 6, resumed, GeneratedBatch.list_from_state(saved), first=3, trained=trained)
    prompts = [i for _, indices, _ in trained for i in indices]
    assert sorted(prompts) == list(range(12)) and [step for step, _, _ in trained] == [1, 2, 3, 4, 5, 6]
    assert all(step - 1 - p <= 2 for step, _, policies in trained for p in policies)
    assert any(step >= 3 and min(policies) < 2 for step, _, policies in trained)  # a group from before the resume


def test_streaming_with_pushes_every_two_steps_keeps_the_bound():
    """sync_every 2, η = 1, prompts 0 and 5 slow (back after 0.3 s): the groups are taken out of
    the sampler's order, each once, none more than one version behind; step 2 waits for prompt 0,
    due then (no push after step 1 drains it)."""
    import threading

    engine = HeldEngine(held={0, 5})
    threading.Timer(0.3, engine.held.clear).start()
    plan = _plan(engine, start_step=0, max_staleness=1, sync_every=2, queue_size=8, chunk_prompts=1,
                 batch_prompts=BATCH, wait_s=5.0)
    engine.push()
    source = StreamingAsyncSource(engine.push, 6, plan)
    trained = []
    for step in range(1, 7):
        batch = source.next(step, {})
        trained.append((step, batch.prompt_indices, batch.policy_steps()))
        source.after_update(step, True, {})
    assert sorted(i for _, indices, _ in trained for i in indices) == list(range(12))
    assert [indices for _, indices, _ in trained][:2] == [[1, 2], [0, 3]]
    assert all(step - 1 - p <= 1 for step, _, policies in trained for p in policies)


def test_a_streaming_checkpoint_is_refused_without_streaming_or_with_another_sync_every():
    engine = HeldEngine(held={1})
    _, source = _streaming_run(2, 6, engine, until=2)
    engine.held.clear()
    saved = GeneratedBatch.list_from_state([b.to_state() for b in source.in_flight()])
    for streaming, sync_every, message in [(False, 1, "are not whole: a streaming run"),
                                           (True, 2, "generated with async.sync_every 1, this run has 2")]:
        plan = _plan(engine, start_step=2, max_staleness=2, sync_every=sync_every, queue_size=8, chunk_prompts=1,
                     batch_prompts=BATCH)
        with pytest.raises(RuntimeError, match=message):
            (StreamingAsyncSource if streaming else FullyAsyncSource)(engine.push, 6, plan, saved)


# --- a step that trains nothing (dynamic sampling kept no group) -------------------------------


class WeighingEngine(HeldEngine):
    """HeldEngine that knows which weights it holds, as the actor's count of updates when they were
    pushed (`updates`: the actor's count now), and which weights generated each prompt."""

    def __init__(self):
        super().__init__()
        self.updates, self.holds, self.made_with = 0, 0, {}

    def push(self) -> dict:
        self.holds = self.updates
        return super().push()

    def generate(self, step: int, indices: list[int]) -> PendingBatch:
        self.made_with.update({i: self.holds for i in indices})
        return super().generate(step, indices)


@pytest.mark.parametrize("mode, eta", [("sync", 0), ("one_step_off", 1), ("fully_async", 1), ("streaming", 1)])
def test_a_step_that_trains_nothing_still_pushes_and_every_tag_stays_exact(mode, eta):
    """Step 3 of 5 trains nothing. Its weights (the step-2 ones) go out all the same, so an
    engine's weight version still counts trainer steps: one push a step, and every later sample's
    policy step names weights equal to those that generated it. The staleness is then what the
    mode promises (sync 0; one_step_off and fully_async with η = 1: 1 from step 2 on, never
    more), and the updates a sample is behind are never more than its steps behind. Skipping the
    push instead tagged every sample after step 3 a step older than the weights that made it
    (sync: staleness 1 from step 4 on; one_step_off: 2 at step 5)."""
    engine, steps = WeighingEngine(), 5
    engine.push()  # the run's first sync: version 1 holds the start step's (0) weights
    if mode in ("sync", "one_step_off"):
        source = _source(mode, engine, steps)
    else:
        plan = _plan(engine, start_step=0, max_staleness=eta, sync_every=1, queue_size=8,
                     chunk_prompts=1 if mode == "streaming" else BATCH, batch_prompts=BATCH, wait_s=5.0)
        source = (StreamingAsyncSource if mode == "streaming" else FullyAsyncSource)(engine.push, steps, plan)
    weights_after, staleness, metrics = {0: 0}, [], {}
    for step in range(1, steps + 1):
        step_metrics = {}
        batch = source.next(step, step_metrics)
        trained = step != 3
        engine.updates += trained
        weights_after[step] = engine.updates
        source.after_update(step, trained, step_metrics)
        for index, p in zip(batch.prompt_indices, batch.policy_steps(), strict=True):  # one sample a prompt
            assert weights_after[p] == engine.made_with[index], (step, index, p, engine.events)
            staleness.append((step, step - 1 - p, weights_after[step - 1] - engine.made_with[index]))
        metrics[step] = step_metrics | overlap_metrics(step, batch, step_metrics | {"timing_s/step": 10.0},
                                                       source.engine_seconds)
    assert [e for e in engine.events if e.startswith("push")] == [f"push v{v}" for v in range(1, steps + 2)]
    assert [metrics[s]["actor/empty_step"] for s in range(1, steps + 1)] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert [metrics[s]["async/staleness_max"] for s in range(1, steps + 1)] == [0.0] + [float(eta)] * (steps - 1)
    assert all(behind <= steps_behind <= eta for _, steps_behind, behind in staleness), staleness
    if eta:  # the step after the empty one trains the weights it was generated with: a version, no update, behind
        assert {behind for step, _, behind in staleness if step == 4} == {0}
