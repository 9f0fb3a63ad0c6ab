"""A streaming engine (async.streaming) runs several generate calls at once on one vLLM engine:
their requests share the running batch, whichever call steps the engine steps them all, and each
call returns when its own requests end, not when the others' do."""

import threading
import time
from types import SimpleNamespace

import pytest

from mrl.rollout.engine import SamplingSettings
from mrl.rollout.vllm_engine import VLLMEngine


class LengthCore:
    """vLLM's LLMEngine as VLLMEngine steps it: a request's prompt [n] asks for n tokens, one a
    step for every request in the batch; records how many requests each step advanced."""

    def __init__(self):
        self.active, self.batch_sizes, self.lock = {}, [], threading.Lock()

    def add_request(self, request_id, prompt, params):
        with self.lock:
            self.active[request_id] = (prompt["prompt_token_ids"], [])

    def step(self):
        time.sleep(0.002)
        with self.lock:
            assert self.active, "stepped with no request in the batch"
            self.batch_sizes.append(len(self.active))
            outs = []
            for request_id, (prompt, tokens) in list(self.active.items()):
                tokens.append(len(tokens))
                finished = len(tokens) == prompt[0]
                completion = SimpleNamespace(token_ids=list(tokens), text="t", finish_reason="length" if finished else None,
                                             logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in tokens])
                outs.append(SimpleNamespace(request_id=request_id, finished=finished, prompt_token_ids=prompt,
                                            outputs=[completion]))
                if finished:
                    del self.active[request_id]
            return outs

    def abort_request(self, request_ids):
        with self.lock:
            for r in request_ids:
                self.active.pop(r, None)

    def has_unfinished_requests(self):
        return bool(self.active)

    def get_num_unfinished_requests(self):
        return len(self.active)


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setattr(VLLMEngine, "_params", lambda self, sampling, **extra: SimpleNamespace())
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM: the stepping is what is tested
    engine._start_bookkeeping(streaming=True)
    engine.llm = SimpleNamespace(llm_engine=LengthCore(), collective_rpc=lambda fn, args=(): [[]])
    engine.weight_apply = "load_weights"
    return engine


def test_concurrent_generates_share_the_batch_and_each_returns_when_its_own_requests_end(engine):
    """Eight long calls (60 tokens) step the engine; a short one (3 tokens) joins their batch and
    returns within a few steps of its own, not after theirs (nor starved of its turn)."""
    core, results, steps_at = engine.llm.llm_engine, {}, {}

    def call(name, length):
        results[name] = engine.generate([[length]], SamplingSettings(n=2))
        steps_at[name] = len(core.batch_sizes)

    longs = [threading.Thread(target=call, args=(f"long{i}", 60)) for i in range(8)]
    for thread in longs:
        thread.start()
    while len(core.batch_sizes) < 5:  # the long calls are stepping
        time.sleep(0.001)
    started = len(core.batch_sizes)
    short = threading.Thread(target=call, args=("short", 3))
    short.start()
    short.join(timeout=30)
    assert "short" in results and steps_at["short"] - started <= 3 + 4, (started, steps_at)
    with pytest.raises(RuntimeError, match="requests were generating: the driver must wait for"):
        engine.begin_weight_update()  # the long calls are still in flight
    for thread in longs:
        thread.join(timeout=30)
    assert [len(g.token_ids) for g in results["short"][0]] == [3, 3]
    assert all([len(g.token_ids) for g in results[f"long{i}"][0]] == [60, 60] for i in range(8))
    assert all(g.finish_reason == "length" for r in results.values() for g in r[0])
    assert max(core.batch_sizes) == 18  # every call's samples in one step
    assert len(core.batch_sizes) <= 60 + 8  # one step advances them all
    assert engine._latest == {}  # every call took its outputs with it
