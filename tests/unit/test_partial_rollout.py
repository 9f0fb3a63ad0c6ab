"""async.partial_rollout in fully_async (mrl/modes/fully_async.py) against a fake engine that can be
interrupted: at a push the chunks in flight come back unfinished, the push goes out, and each
unfinished sample continues from its prefix on the new weights, in its place in its group and
batch; its tokens keep their versions and engine log-probs, its weight version (the staleness) is
its oldest token's, and async/partial_ratio counts the samples with two versions."""

import pytest

from mrl.modes import (AsyncPlan, FullyAsyncSource, GeneratedBatch, PendingBatch, continuation_seed,
                       continue_generation, overlap_metrics)
from mrl.rollout.detokenize import SampleText
from mrl.rollout.engine import Generation

BATCH, N, LENGTH = 2, 2, 4  # prompts a step, samples a prompt, tokens a sample


def detokenize(prompt_ids: list[int], token_ids: list[int], stop_terminated: bool) -> SampleText:
    """The fake's text ("t" a token) and no stop strings (the real one: tests/unit/test_partial_text.py)."""
    return SampleText("t" * len(token_ids), len(token_ids), None)


def token(sample: int, version: int, position: int) -> int:
    """The fake's token: says which sample (in its group) and which weights made it, and where."""
    return 1000 * sample + 100 * version + position


class InterruptibleEngine:
    """One call at a time: the first call in flight is generating, the others queue behind it. An
    interrupt leaves the generating call with 2 tokens a sample and the queued ones with none; a
    push (which clears the interrupt) while a call is in flight fails."""

    def __init__(self):
        self.version, self.sampled, self.calls, self.events, self.keys = 0, 0, [], [], []

    def sample(self) -> list[int]:
        indices = list(range(self.sampled, self.sampled + BATCH))
        self.sampled += BATCH
        return indices

    def generate(self, step: int, indices: list[int]) -> PendingBatch:
        self.events.append(f"gen b{step} {indices} v{self.version}")
        return PendingBatch(step, indices, self._call([([i], [(s, LENGTH) for s in range(N)]) for i in indices]), 0)

    def resume(self, step: int, partials: list[Generation], keys: list[tuple[int, int]]) -> PendingBatch:
        self.events.append(f"resume b{step} {keys} v{self.version}")
        self.keys += [(step, *key) for key in keys]
        work = [(g.prompt_ids + g.token_ids, [(key % N, LENGTH - len(g.token_ids))]) for g, (key, _) in zip(partials, keys)]
        return PendingBatch(step, [], self._call(work), 0)

    def _call(self, work: list[tuple[list[int], list[tuple[int, int]]]]):
        engine, version = self, self.version
        call = {"stop": None}  # tokens a sample gets when interrupted (None: runs to the end)
        self.calls.append(call)

        class Pending:
            seconds, metrics = 1.0, {}

            def result(self):
                engine.calls.remove(call)
                groups = []
                for prompt, samples in work:
                    group = []
                    for sample, budget in samples:
                        made = budget if call["stop"] is None else min(call["stop"], budget)
                        start = len(prompt) - 1  # the prompt is one token, then the sample's tokens so far
                        ids = [token(sample, version, start + j) for j in range(made)]
                        group.append(Generation(list(prompt), ids, "t" * made, [-(version + j / 10) for j in range(made)],
                                                "length" if made == budget else None, version, [version] * made))
                    groups.append(group)
                return groups

            def cancel(self):
                engine.calls.remove(call)

        return Pending()

    def interrupt(self) -> None:
        self.events.append("interrupt")
        for i, call in enumerate(self.calls):
            call["stop"] = 2 if i == 0 else 0

    def push(self) -> dict:
        assert not self.calls, "a weight push reached the engine while it was generating"
        self.version += 1
        self.events.append(f"push v{self.version}")
        return {}


def _plan(engine: InterruptibleEngine, eta: int, **partial) -> AsyncPlan:
    """fully_async's plan over the fake engine: a prompt a chunk, N samples a prompt (`partial`:
    interrupt, resume and detokenize, for async.partial_rollout)."""
    return AsyncPlan(sample=engine.sample, generate=engine.generate, start_step=0, max_staleness=eta, sync_every=1,
                     queue_size=8, chunk_prompts=1, samples_per_prompt=N, **partial)


def _run(eta: int = 1, steps: int = 3, partial: bool = True):
    engine = InterruptibleEngine()
    engine.push()  # the run's first sync: version 1
    plan = _plan(engine, eta, interrupt=engine.interrupt if partial else None, resume=engine.resume,
                 detokenize=detokenize)
    source = FullyAsyncSource(engine.push, steps, plan)
    batches, metrics = [], {}
    for step in range(1, steps + 1):
        m = {}
        batch = source.next(step, m)
        batches.append(batch)
        source.after_update(step, True, m)
        metrics[step] = m | overlap_metrics(step, batch, m | {"timing_s/step": 10.0}, source.engine_seconds)
    return engine, batches, metrics, source


def test_a_push_interrupts_the_chunks_in_flight_and_continues_them_on_the_new_weights():
    engine, batches, metrics, _ = _run()
    assert engine.events[:9] == [
        "push v1", "gen b1 [0] v1", "gen b1 [1] v1", "gen b2 [2] v1", "gen b2 [3] v1",  # η = 1: steps 1 and 2
        "interrupt", "push v2",  # after step 1: b2's chunks come back unfinished, the push goes out
        "resume b2 [(0, 1), (1, 1)] v2", "resume b2 [(2, 1), (3, 1)] v2"]  # every sample of b2 continues
    assert [b.prompt_indices for b in batches] == [[0, 1], [2, 3], [4, 5]]  # the sampler's order
    for batch in batches:
        for index, group in zip(batch.prompt_indices, batch.groups):
            for s, g in enumerate(group):  # each sample in its place, whole, its tokens its own
                assert g.prompt_ids == [index] and len(g.token_ids) == LENGTH == len(g.logprobs)
                assert g.finish_reason == "length" and [t // 1000 for t in g.token_ids] == [s] * LENGTH
                assert [t % 100 for t in g.token_ids] == list(range(LENGTH))
                assert g.token_versions == [t % 1000 // 100 for t in g.token_ids]  # the version that made it
    b2 = batches[1]
    generating, queued = b2.groups  # prompt 2 was generating at the interrupt, prompt 3 queued behind it
    assert [g.token_versions for g in generating] == [[1, 1, 2, 2]] * N
    assert [g.logprobs for g in generating] == [[-1.0, -1.1, -2.0, -2.1]] * N  # each token's own engine log-prob
    assert [g.token_versions for g in queued] == [[2, 2, 2, 2]] * N  # nothing made on v1: all new
    assert [g.weight_version for g in generating + queued] == [1, 1, 2, 2]  # the oldest token's
    assert [metrics[s]["async/partial_ratio"] for s in (1, 2, 3)] == [0.0, 0.5, 0.5]
    assert [metrics[s]["async/continued_samples"] for s in (1, 2)] == [4.0, 4.0]  # b2's, then b3's
    for step, batch in enumerate(batches, 1):  # the oldest token is within the bound
        assert max(step - 1 - p for p in batch.policy_steps()) <= 1
    assert [metrics[s]["async/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert not engine.calls


def test_a_sample_interrupted_twice_continues_twice_with_its_own_seed_keys():
    """η = 2: step 3's chunks are queued at the first interrupt (after step 1: no token yet) and
    their continuations are interrupted again after step 2; each continuation counts up its key."""
    engine, batches, metrics, _ = _run(eta=2, steps=3)
    assert engine.events[7:] == [
        "interrupt", "push v2", "resume b2 [(0, 1), (1, 1)] v2", "resume b2 [(2, 1), (3, 1)] v2",
        "resume b3 [(0, 1), (1, 1)] v2", "resume b3 [(2, 1), (3, 1)] v2",
        "interrupt", "push v3", "resume b3 [(0, 2), (1, 2)] v3", "resume b3 [(2, 2), (3, 2)] v3", "push v4"]
    assert [g.token_versions for group in batches[2].groups for g in group] == [[2, 2, 3, 3]] * 2 + [[3] * 4] * 2
    assert len({continuation_seed(7, key, count) for _, key, count in engine.keys}) == 8  # 4 samples, twice
    assert [metrics[s]["async/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]  # ≤ η = 2


def test_without_partial_rollout_the_push_waits_and_nothing_is_continued():
    engine, batches, metrics, _ = _run(partial=False)
    assert "interrupt" not in engine.events and not engine.keys
    assert {metrics[s]["async/partial_ratio"] for s in (1, 2, 3)} == {0.0}
    assert all(len(set(g.token_versions)) == 1 for b in batches for group in b.groups for g in group)


def test_a_checkpoint_waits_for_the_continuations_and_round_trips_token_versions():
    engine = InterruptibleEngine()
    engine.push()
    plan = _plan(engine, 1, interrupt=engine.interrupt, resume=engine.resume, detokenize=detokenize)
    source = FullyAsyncSource(engine.push, 3, plan)
    source.next(1, {})
    source.after_update(1, True, {})  # b2 interrupted, continued on v2
    saved, _ = source.in_flight()  # steps 2 and 3 (η = 1 admits step 3 on v2)
    assert not engine.calls and saved.step == 2
    assert [g.token_versions for g in saved.groups[0]] == [[1, 1, 2, 2]] * N
    state = saved.to_state()
    assert GeneratedBatch.from_state(state) == saved
    for group in state["groups"]:  # a checkpoint from before token_versions still loads
        for g in group:
            del g["token_versions"]
    old = GeneratedBatch.from_state(state)
    assert old.groups[0][0].token_versions is None and old.groups[0][0].versions() == [1] * LENGTH


def test_a_continuation_must_continue_its_own_sample():
    prefix = Generation([5], [7, 8], "ab", [-0.1, -0.2], None, 1, [1, 1])
    rest = Generation([5, 7, 8], [9], "c", [-0.3], "stop", 2, [2])
    merged = continue_generation(prefix, rest, detokenize)
    assert (merged.token_ids, merged.text, merged.logprobs, merged.token_versions, merged.weight_version,
            merged.finish_reason) == ([7, 8, 9], "ttt", [-0.1, -0.2, -0.3], [1, 1, 2], 1, "stop")
    with pytest.raises(RuntimeError, match="continues another sample"):
        continue_generation(prefix, Generation([5, 7], [9], "c", [-0.3], "stop", 2, [2]), detokenize)


def test_partial_rollout_without_its_detokenizer_is_refused():
    engine = InterruptibleEngine()
    with pytest.raises(ValueError, match="needs resume and detokenize"):
        _plan(engine, 1, interrupt=engine.interrupt, resume=engine.resume)


def test_continuation_seeds_differ_per_sample_and_continuation():
    seeds = {continuation_seed(42, sample, count) for sample in range(50) for count in range(1, 4)}
    # pinned: a resumed run recomputes the seeds its first run drew (a changed formula would not)
    assert len(seeds) == 150 and continuation_seed(42, 3, 1) == 42378130162
    assert continuation_seed(None, 3, 1) is None
