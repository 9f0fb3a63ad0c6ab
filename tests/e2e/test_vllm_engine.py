"""mrl's vLLM engine in its Ray actor: sampling settings pass through, and scores agree with sampling."""

from __future__ import annotations

import pytest

from mrl.rollout.engine import SamplingSettings

ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20)
PROMPTS = ["12+7=", "3*4="]


@pytest.fixture(scope="module")
def actor(ray_local, tiny_model_dir):
    from mrl.launch.rollout_actor import start_rollout_actor

    handle = start_rollout_actor(str(tiny_model_dir("qwen3")), ENGINE)
    yield lambda method, *args: ray_local.get(getattr(handle, method).remote(*args), timeout=120)
    ray_local.kill(handle)


def test_greedy_is_deterministic_and_sized(actor):
    greedy = SamplingSettings(max_tokens=6, ignore_eos=True)
    first, second = actor("generate", PROMPTS, greedy), actor("generate", PROMPTS, greedy)
    assert [g[0].token_ids for g in first] == [g[0].token_ids for g in second]
    assert all(len(g[0].token_ids) == 6 == len(g[0].logprobs) for g in first)
    top1 = actor("generate", PROMPTS, SamplingSettings(max_tokens=6, ignore_eos=True, temperature=1.0, top_k=1))
    assert [g[0].token_ids for g in top1] == [g[0].token_ids for g in first]


def test_n_samples_and_seed(actor):
    sampled = SamplingSettings(max_tokens=8, ignore_eos=True, temperature=1.0, n=4, seed=3)
    a, b = actor("generate", PROMPTS, sampled), actor("generate", PROMPTS, sampled)
    assert [len(per_prompt) for per_prompt in a] == [4, 4]
    assert [[g.token_ids for g in p] for p in a] == [[g.token_ids for g in p] for p in b]  # seeded
    assert len({tuple(g.token_ids) for g in a[0]}) > 1  # n samples, not n copies


def test_stop_string(actor):
    full = actor("generate", PROMPTS[:1], SamplingSettings(max_tokens=12, ignore_eos=True))[0][0]
    stop = full.text[len(full.text) // 2 :][:2]
    assert stop.strip(), f"greedy text {full.text!r} has no usable stop string"
    stopped = actor("generate", PROMPTS[:1], SamplingSettings(max_tokens=12, ignore_eos=True, stop=(stop,)))[0][0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert full.text.startswith(stopped.text)


def test_scores_equal_sampling_logprobs(actor):
    out = actor("generate", PROMPTS, SamplingSettings(max_tokens=6, ignore_eos=True, temperature=1.0, seed=1))
    sequences = [g[0].prompt_ids + g[0].token_ids for g in out]
    scores = actor("score", sequences)
    for g, s in zip(out, scores):
        assert s[-6:] == pytest.approx(g[0].logprobs, abs=1e-5)
