"""MoE routes from mrl's capture in real vLLM-CPU (fp32, pooled engines) are the experts that
transformers' own routers choose for the same prompt + response tokens, in the route contract's
shape and dtype, for every sample of a prompt, prefix-cache hits included; switched off (the
default) the capture leaves no hook in vLLM and samples carry no routes."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from mrl.models.registry import model_spec_from_hf
from mrl.rollout.engine import SamplingSettings
from mrl.routes import check_routes, route_dtype

ray = pytest.importorskip("ray")
# 140 prompt tokens: more than a KV block (128 on vLLM-CPU for Qwen3-MoE), so its 2nd and 3rd samples
# are served the first block from vLLM's prefix cache; sampled (temperature 1), their responses differ.
PROMPTS = [list(range(10, 150)), list(range(500, 520))]
SAMPLING = SamplingSettings(temperature=1.0, max_tokens=6, n=3, seed=7, ignore_eos=True)
OFF = {"on": False, "wrapped_forward": False, "router_callbacks": 0, "requests": 0, "copied_rows": 0}


@functools.lru_cache(maxsize=2)
def transformers_model(path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def transformers_routes(path, sequences: list[list[int]]) -> list[np.ndarray]:
    """Per sequence (all of one length), [T, MoE layers, K]: the ids transformers' routers choose
    (its MoE blocks' `gate` returns logits, weights, ids), its MoE layers in order."""
    model = transformers_model(path)
    chosen: list[torch.Tensor] = []
    gates = [module for name, module in model.named_modules() if name.endswith("mlp.gate")]
    hooks = [gate.register_forward_hook(lambda _m, _i, out: chosen.append(out[2])) for gate in gates]
    with torch.no_grad():
        model(torch.tensor(sequences))
    for hook in hooks:
        hook.remove()
    ids = torch.stack(chosen, dim=1).reshape(len(sequences), len(sequences[0]), len(gates), -1)
    return list(ids.numpy())


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_captured_routes_are_transformers_routes(arch, tiny_model_dir, engine_pool):
    path = tiny_model_dir(arch)
    spec = model_spec_from_hf(path)
    hf = spec.hf_config
    n_experts, top_k = spec.num_experts, hf["num_experts_per_tok"]
    layers = hf["num_hidden_layers"] - hf.get("first_k_dense_replace", 0)  # DeepSeek-V3's dense layer 0 has none
    with engine_pool.borrow(arch) as actor:
        call = lambda f: ray.get(actor.__ray_call__.remote(f), timeout=120)  # noqa: E731
        assert call(lambda server: server.engine.route_capture_state()) == OFF  # the default: nothing in vLLM
        plain = ray.get(actor.generate.remote(PROMPTS[:1], SAMPLING), timeout=120)
        try:
            call(lambda server: server.engine.set_return_routes(True))
            groups = ray.get(actor.generate.remote(PROMPTS, SAMPLING), timeout=120)
            state = call(lambda server: server.engine.route_capture_state())
        finally:
            call(lambda server: server.engine.set_return_routes(False))
        assert call(lambda server: server.engine.route_capture_state()) == OFF
    assert all(g.routed_experts is None for g in plain[0])
    assert groups[0][0].token_ids == plain[0][0].token_ids  # capturing changes no token
    assert state["requests"] == 0  # every request's rows were taken
    if arch == "qwen3_moe":  # vLLM-CPU turns prefix caching off for MLA (DeepSeek-V3)
        assert state["copied_rows"] == 2 * 128  # samples 2 and 3 of the long prompt: one cached block each
    for p, group in enumerate(groups):
        sequences = [g.prompt_ids + g.token_ids[:-1] for g in group]  # the tokens the engine forwarded
        for i, (sample, expected) in enumerate(zip(group, transformers_routes(path, sequences))):
            routes = check_routes(sample.routed_experts, tokens=len(sequences[i]), layers=layers, top_k=top_k,
                                  n_experts=n_experts, sample=(p, i))
            assert routes.dtype == route_dtype(n_experts)
            same = (np.sort(routes, -1) == np.sort(expected, -1)).all(-1)  # [T, L]: top-k sets
            # fp32 in both and the logits spread (tiny zoo): no near-tie flips a choice. Measured: all equal.
            assert same.all(), f"prompt {p} sample {i}: {same.mean():.4f} of decisions agree, first differing " \
                               f"(token, layer) {tuple(np.argwhere(~same)[0])}"


def test_an_interrupted_sample_and_its_continuation_keep_their_routes(tiny_model_dir, engine_pool):
    """async.partial_rollout's path on the real engine: samples interrupted mid-way carry the rows of
    the tokens they have; continued (here on the same weights), the joined routes are the whole
    sample's, as transformers routes it."""
    from mrl.modes import continue_generation
    from mrl.rollout.detokenize import SampleText

    path = tiny_model_dir("qwen3_moe")
    sampling = SamplingSettings(temperature=1.0, max_tokens=200, n=2, seed=3, ignore_eos=True)

    def interrupted(server):  # in the actor: generate on a thread, interrupt once a sample has 2 tokens
        import threading
        import time

        engine = server.engine
        engine.interruptible = True
        engine.set_return_routes(True)
        result = []
        worker = threading.Thread(target=lambda: result.append(engine.generate(PROMPTS[1:], sampling)))
        worker.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(len(o.outputs[0].token_ids) >= 2
                                                                  for o in list(engine._latest.values())):
            time.sleep(0.001)
        engine.interrupt()
        worker.join(60)
        engine.interrupted.clear()  # (a weight update clears it in a run)
        rest = engine.generate([g.prompt_ids + g.token_ids for g in result[0][0]],
                               [SamplingSettings(temperature=1.0, max_tokens=4, seed=5, ignore_eos=True)] * 2)
        engine.set_return_routes(False)
        engine.interruptible = False
        return result[0][0], [group[0] for group in rest]

    with engine_pool.borrow("qwen3_moe") as actor:
        prefixes, rests = ray.get(actor.__ray_call__.remote(interrupted), timeout=180)
    assert all(p.finish_reason is None and 2 <= len(p.token_ids) < 200 for p in prefixes)  # cut mid-way
    whole = [continue_generation(p, r, lambda _p, tokens, stop_terminated: SampleText("", len(tokens), None))
             for p, r in zip(prefixes, rests)]
    for sample in prefixes + whole:
        (expected,) = transformers_routes(path, [sample.prompt_ids + sample.token_ids[:-1]])
        assert sample.routed_experts.shape == expected.shape
        assert (np.sort(sample.routed_experts, -1) == np.sort(expected, -1)).all()
