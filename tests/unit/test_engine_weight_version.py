"""The engine stamps each generation with the weight updates it has finished: the trace's weight
version comes from the engine itself, not from the driver's count."""

from types import SimpleNamespace

from mrl.rollout.engine import SamplingSettings
from mrl.rollout.vllm_engine import VLLMEngine


class FakeLLM:
    def generate(self, prompts, params, use_tqdm):
        completion = SimpleNamespace(token_ids=[7], text="7", logprobs=[{7: SimpleNamespace(logprob=-0.5)}],
                                     finish_reason="stop")
        return [SimpleNamespace(prompt_token_ids=[1, 2], outputs=[completion]) for _ in prompts]

    def collective_rpc(self, fn, args=()):
        return [[]]

    def reset_prefix_cache(self):
        pass


def test_generations_carry_the_number_of_finished_weight_updates(monkeypatch):
    monkeypatch.setattr(VLLMEngine, "_params", lambda self, sampling, **extra: None)
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM: the version bookkeeping is what is tested
    engine.llm, engine._sleeping, engine.weight_version = FakeLLM(), False, 0
    generate = lambda: engine.generate([[1, 2]], SamplingSettings())[0][0]  # noqa: E731
    assert generate().weight_version == 0  # the weights it started with
    for expected in (1, 2):
        engine.begin_weight_update()
        engine.finish_weight_update()
        assert generate().weight_version == expected
    engine.begin_weight_update()  # an update in progress does not count until it finishes
    assert generate().weight_version == 2
