"""The engine stamps each generation with the weight updates it has finished: the trace's weight
version comes from the engine itself, not from the driver's count."""

from types import SimpleNamespace

from mrl.rollout.engine import SamplingSettings
from mrl.rollout.vllm_engine import VLLMEngine


class FakeCore:
    """vLLM's LLMEngine as VLLMEngine.generate steps it: each request finishes in one step."""

    def __init__(self):
        self.added = []

    def add_request(self, request_id, prompt, params):
        self.added.append(request_id)

    def step(self):
        completion = SimpleNamespace(token_ids=[7], text="7", logprobs=[{7: SimpleNamespace(logprob=-0.5)}],
                                     finish_reason="stop")
        done, self.added = self.added, []
        return [SimpleNamespace(request_id=r, finished=True, prompt_token_ids=[1, 2], outputs=[completion])
                for r in done]

    def has_unfinished_requests(self):
        return bool(self.added)


class FakeLLM:
    def __init__(self):
        self.llm_engine = FakeCore()

    def collective_rpc(self, fn, args=()):
        return [[]]

    def reset_prefix_cache(self):
        pass


def test_generations_carry_the_number_of_finished_weight_updates(monkeypatch):
    monkeypatch.setattr(VLLMEngine, "_params", lambda self, sampling, **extra: SimpleNamespace())
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM: the version bookkeeping is what is tested
    engine.weight_apply = "load_weights"  # the fake LLM has no parameters to plan; bookkeeping is the point
    engine._start_bookkeeping(interruptible=True)  # the stepping path (partial rollout's), tested here
    engine.llm = FakeLLM()
    generate = lambda: engine.generate([[1, 2]], SamplingSettings())[0][0]  # noqa: E731
    assert generate().weight_version == 0  # the weights it started with
    for expected in (1, 2):
        engine.begin_weight_update()
        engine.finish_weight_update()
        assert generate().weight_version == expected
    engine.begin_weight_update()  # an update in progress does not count until it finishes
    assert generate().weight_version == 2


class SlowCore:
    """One token a step, never finished by itself; records aborts."""

    def __init__(self, engine):
        self.engine, self.requests, self.aborted, self.steps = engine, [], [], 0

    def add_request(self, request_id, prompt, params):
        self.requests.append(request_id)

    def step(self):
        self.steps += 1
        if self.steps == 3:
            self.engine.interrupt()  # as RolloutServer.interrupt does from its own thread
        tokens = list(range(self.steps))
        completion = SimpleNamespace(token_ids=tokens, text="?", finish_reason=None,
                                     logprobs=[{t: SimpleNamespace(logprob=-t / 10)} for t in tokens])
        return [SimpleNamespace(request_id=r, finished=False, prompt_token_ids=[1, 2], outputs=[completion])
                for r in self.requests]

    def abort_request(self, request_ids):
        self.aborted += request_ids

    def has_unfinished_requests(self):
        return bool(set(self.requests) - set(self.aborted))


def test_an_interrupted_generate_returns_its_tokens_so_far_until_the_next_weight_update(monkeypatch):
    monkeypatch.setattr(VLLMEngine, "_params", lambda self, sampling, **extra: SimpleNamespace())
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.weight_apply = "load_weights"  # the fake LLM has no parameters to plan; bookkeeping is the point
    engine._start_bookkeeping(interruptible=True)  # the stepping path (partial rollout's), tested here
    engine.llm, engine.weight_version = FakeLLM(), 4
    engine.llm.llm_engine = core = SlowCore(engine)
    engine.llm.get_tokenizer = lambda: SimpleNamespace(decode=lambda ids, skip_special_tokens: f"<{len(ids)}>")
    (a, b), = engine.generate([[1, 2]], SamplingSettings(n=2, seed=3))
    assert core.steps == 3 and sorted(core.aborted) == sorted(core.requests)  # nothing left in vLLM
    assert a.token_ids == [0, 1, 2] and a.logprobs == [0.0, -0.1, -0.2] and a.finish_reason is None
    assert a.token_versions == [4, 4, 4] and a.text == "<3>" and b.token_ids == [0, 1, 2]
    (c,), = engine.generate([[1, 2]], SamplingSettings())  # still interrupted: back at once, untouched
    assert c.token_ids == [] and c.prompt_ids == [1, 2] and c.finish_reason is None and core.steps == 3
    engine.begin_weight_update()
    engine.finish_weight_update()
    assert not engine.interrupted.is_set()  # the new weights: generating again


def test_an_engine_without_partial_rollout_runs_vllms_own_loop_and_refuses_interrupt(monkeypatch):
    """interruptible=False (no async.partial_rollout): one LLM.generate call runs every request to
    its end (faster on CPU than stepping); interrupt() is an error, not a flag nobody reads."""
    monkeypatch.setattr(VLLMEngine, "_params", lambda self, sampling, **extra: SimpleNamespace())
    engine = VLLMEngine.__new__(VLLMEngine)
    engine._start_bookkeeping()
    engine.llm, engine.weight_version = FakeLLM(), 3
    completions = [SimpleNamespace(token_ids=[t], text=str(t), logprobs=[{t: SimpleNamespace(logprob=-t / 10)}],
                                   finish_reason="length") for t in (4, 5)]
    engine.llm.generate = lambda prompts, params, use_tqdm: [
        SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], finished=True, outputs=completions) for p in prompts]
    (a, b), = engine.generate([[1, 2]], SamplingSettings(n=2))
    assert (a.token_ids, b.token_ids, a.logprobs, a.finish_reason) == ([4], [5], [-0.4], "length")
    assert a.prompt_ids == [1, 2] and a.weight_version == 3 and a.token_versions == [3]
    assert engine.llm.llm_engine.added == []  # the stepping path was not taken
    try:
        engine.interrupt()
    except RuntimeError as err:
        assert "interruptible=True" in str(err) and "async.partial_rollout" in str(err)
    else:
        raise AssertionError("interrupt() on an engine that cannot be interrupted passed silently")
