"""A slept (colocated) engine wakes on whatever it is asked next: a step that skips the weight sync
(dynamic sampling with no informative group) must not generate on a sleeping engine."""

from types import SimpleNamespace

import pytest

from mrl.rollout.engine import SamplingSettings
from mrl.rollout.vllm_engine import VLLMEngine


class FakeLLM:
    """Records the order of calls; fails a generate or an RPC made while asleep, as CUDA would."""

    def __init__(self):
        self.calls, self.asleep = [], False

    def sleep(self, level):
        self.calls.append("sleep")
        self.asleep = True

    def wake_up(self):
        self.calls.append("wake_up")
        self.asleep = False

    def generate(self, prompts, params, use_tqdm):  # score's path
        assert not self.asleep, "score on a sleeping engine"
        self.calls.append("generate")
        out = SimpleNamespace(prompt_token_ids=[1, 2], prompt_logprobs=[None, {2: SimpleNamespace(logprob=-1.0)}],
                              outputs=[])
        return [out for _ in prompts]

    @property
    def llm_engine(self):  # generate's path: requests added and stepped one by one
        llm = self

        class Engine:
            def add_request(self, request_id, prompt, params):
                assert not llm.asleep, "generate on a sleeping engine"
                llm.calls.append("generate")
                self.out = SimpleNamespace(request_id=request_id, finished=True, prompt_token_ids=[1, 2],
                                           outputs=[SimpleNamespace(token_ids=[], text="", logprobs=[],
                                                                    finish_reason="stop")])

            def step(self):
                return [self.out]

            def has_unfinished_requests(self):
                return False

        return Engine()

    def collective_rpc(self, fn, args=()):
        assert not self.asleep, "weights loaded into a sleeping engine"
        self.calls.append("rpc")
        return [[]]


def slept_engine() -> VLLMEngine:
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM: the sleep/wake bookkeeping is what is tested
    engine.weight_apply = "load_weights"  # the fake LLM has no parameters to plan; bookkeeping is the point
    engine._start_bookkeeping(interruptible=True)  # the stepping path (partial rollout's), tested here
    engine.llm = FakeLLM()
    engine.sleep()
    return engine


@pytest.mark.parametrize("call", ["generate", "score", "begin_weight_update"])
def test_a_slept_engine_wakes_on_its_next_call(call, monkeypatch):
    monkeypatch.setattr(VLLMEngine, "_params", lambda self, sampling, **extra: SimpleNamespace())
    monkeypatch.setattr(VLLMEngine, "supports_sleep", property(lambda self: True))  # as on CUDA
    engine = slept_engine()
    {"generate": lambda: engine.generate([[1, 2]], SamplingSettings()),
     "score": lambda: engine.score([[1, 2]]),
     "begin_weight_update": engine.begin_weight_update}[call]()
    assert engine.llm.calls[:2] == ["sleep", "wake_up"] and not engine.llm.asleep
