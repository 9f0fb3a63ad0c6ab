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
    results, returned = {}, {}

    def call(name, length):
        results[name] = engine.generate([[length]], SamplingSettings(n=2))
        returned[name] = time.perf_counter()

    long = threading.Thread(target=call, args=("long", 30))
    long.start()
    while not engine.llm.llm_engine.active:  # the long call's requests are in the batch
        time.sleep(0.001)
    short = threading.Thread(target=call, args=("short", 3))
    short.start()
    short.join(timeout=10)
    assert "short" in results and "long" not in results, "the short call waited for the long one"
    with pytest.raises(RuntimeError, match="requests were generating: the driver must wait for"):
        engine.begin_weight_update()  # the long call is still in flight
    long.join(timeout=10)
    assert [len(g.token_ids) for g in results["short"][0]] == [3, 3]
    assert [len(g.token_ids) for g in results["long"][0]] == [30, 30]
    assert all(g.finish_reason == "length" for r in results.values() for g in r[0])
    assert max(engine.llm.llm_engine.batch_sizes) == 4  # both calls' samples in one step
    assert engine._latest == {}  # every call took its outputs with it
