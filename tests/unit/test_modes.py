"""trainer.mode's batch sources (mrl/modes.py) against a fake engine: which weights each batch is
generated with, when the weights go out, that a push never meets a generation in flight, and that
a one_step_off checkpoint's batch in flight makes a resumed run train exactly the same samples."""

import pytest

from mrl.modes import GeneratedBatch, PendingBatch, make_source, overlap_metrics
from mrl.rollout.engine import Generation

BATCH = 2  # prompts a step


class FakeEngine:
    """One call at a time, like the engine's Ray actor: a push while a generation is in flight fails."""

    def __init__(self, start_step: int = 0):
        self.version, self.in_flight, self.events = 0, 0, []
        self.start_step, self.sampled = start_step, 0

    def launch(self, step: int) -> PendingBatch:
        indices = list(range(self.sampled, self.sampled + BATCH))  # the sampler's next batch
        self.sampled += BATCH
        self.in_flight += 1
        self.events.append(f"gen b{step} v{self.version}")
        version, engine = self.version, self

        class Pending:
            seconds = 1.5
            metrics = {"rollout/engine0/gen_s": 1.5}

            def result(self):
                engine.in_flight -= 1
                return [[Generation([i], [i, 1], "x", [-0.5, -0.25], "stop", version)] for i in indices]

        return PendingBatch(step, indices, Pending(), self.start_step)

    def push(self) -> dict:
        assert not self.in_flight, "a weight push reached the engine while it was generating"
        self.version += 1
        self.events.append(f"push v{self.version}")
        return {"timing_s/sync_weights": 0.5}

    def release(self) -> None:
        assert not self.in_flight, "the engine was put to sleep while it was generating"
        self.events.append("release")


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
    source = make_source(mode, engine.launch, engine.push, engine.release, steps)
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
    source = make_source("one_step_off", engine.launch, engine.push, engine.release, 4)
    _train(source, engine, range(1, 3), trained)
    saved, sampled = source.in_flight().to_state(), engine.sampled
    assert saved["step"] == 3 and saved["prompt_indices"] == [4, 5]

    resumed = FakeEngine(start_step=2)  # a new engine: its version 1 holds the step-2 weights
    resumed.sampled = sampled
    resumed.push()
    source = make_source(mode, resumed.launch, resumed.push, resumed.release, 4, GeneratedBatch.from_state(saved))
    _train(source, resumed, range(3, 5), trained)
    if mode == "one_step_off":
        assert trained == uninterrupted
        assert resumed.events == ["push v1", "gen b4 v1", "train 3 on b3", "push v2", "train 4 on b4", "push v3"]
    else:  # a sync run resumed from it still trains the saved batch first; then on-policy
        assert trained[:3] == uninterrupted[:3] and trained[3][1:] == ([6, 7], [3, 3])


def test_a_saved_batch_for_another_step_is_refused():
    engine = FakeEngine()
    batch = GeneratedBatch(5, [0], [[Generation([0], [1], "x", [-1.0], "stop", 1)]], 0, 1.0)
    source = make_source("one_step_off", engine.launch, engine.push, engine.release, 8, batch)
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
