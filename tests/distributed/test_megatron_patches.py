"""Each fix in megatron_patches is necessary and sufficient for the scenario it exists for.

One spawned world per fix runs the smallest scenario that needs it twice, A/B in the same
processes:

1. without the fix: a megatron_patches patch is left out through MRL_SKIP_PATCHES, which the
   worker sets for itself and which every later `megatron_patches.apply()` honours (including the
   one inside `initialize_layout`); for `sdpa_attention` the local layer spec keeps upstream's own
   core attention. Every rank must fail with the upstream error the fix's docstring names, raised
   from the upstream code it names.
2. with the fix: the worker clears the skip and calls `megatron_patches.apply()` again, which now
   applies the missing patch (all of them are applied then), rebuilds Megatron's process groups and
   the model, loads the HF weights and runs the same forward, whose logits must match transformers.

A patch that changes numbers instead of failing (group_routing_top2) is shown the same way by its
logits: off parity with transformers without it, on parity with it.

Re-running in the same processes is safe because every rank fails at the same point, before any
collective could pair up with a rank that went on. The parity suite (test_bridge_parity.py) runs
every architecture and layout with all patches applied from the start.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local
from mrl.bridge.verify import probe_tokens, reference_logits

TOLERANCE = 1e-4  # max |logit difference| to transformers, as in the parity suite


@dataclass(frozen=True)
class Scenario:
    arch: str
    layout: ParallelLayout
    error: str  # upstream's error text, present in every rank's traceback
    where: tuple[str, ...]  # where upstream raises it: file paths / functions in the traceback


SCENARIOS = {
    # model_parallel_cuda_manual_seed (inside initialize_layout) adds CUDA RNG states.
    "cpu_rng_tracker": Scenario(
        "llama", ParallelLayout(), "Torch not compiled with CUDA enabled",
        ("megatron/core/tensor_parallel/random.py", "model_parallel_cuda_manual_seed"),
    ),
    # The first literal CUDA call on the way is the pipeline schedule's token counter.
    "cuda_calls_on_cpu": Scenario(
        "llama", ParallelLayout(), "Torch not compiled with CUDA enabled",
        ("megatron/core/pipeline_parallel/schedules.py", "forward_backward_no_pipelining"),
    ),
    # Tied embeddings with PP2: the embedding copy is moved with weight.data.cuda() at build time.
    "tensor_cuda_method": Scenario(
        "llama", ParallelLayout(pp=2), "Torch not compiled with CUDA enabled",
        ("language_module.py", "setup_embeddings_and_output_layer", "weight.data.cuda()"),
    ),
    # TP2 turns on sequence parallelism, which WrappedTorchNorm refuses.
    "torch_norm_sequence_parallel": Scenario(
        "llama", ParallelLayout(tp=2), "sequence parallel not supported by torch LayerNorm",
        ("megatron/core/transformer/torch_norm.py",),
    ),
    # Any MoE forward: the fp32 router GEMM tests the never-bound te_general_gemm.
    "te_general_gemm_undefined": Scenario(
        "qwen3_moe", ParallelLayout(), "name 'te_general_gemm' is not defined",
        ("megatron/core/transformer/moe/moe_utils.py", "router_gating_linear"),
    ),
    # EP2: the alltoall dispatcher hands tensor split sizes to gloo's all_to_all_single.
    "all_to_all_split_sizes": Scenario(
        "qwen3_moe", ParallelLayout(ep=2), "all_to_all_single(): incompatible function arguments",
        ("megatron/core/tensor_parallel/mappings.py",),
    ),
    # EP2×TP2 (expert TP 2): uneven all-gather over the expert-TP group. The ranks of an expert-TP
    # group must route different tokens for the sizes to differ; the probe batch is the same on
    # every rank, so only sequence parallelism (dense TP2) makes them differ: ETP2 or EP2×ETP2 with
    # TP1 run fine without the patch here.
    "uneven_sequence_collectives": Scenario(
        "qwen3_moe", ParallelLayout(ep=2, tp=2), "ProcessGroupGloo::allgather: invalid tensor size",
        ("megatron/core/tensor_parallel/mappings.py", "_gather_along_first_dim"),
    ),
    # MLA build: isinstance(x, TELinear) with TELinear a MagicMock placeholder.
    "te_placeholders": Scenario(
        "deepseek_v3", ParallelLayout(), "isinstance() arg 2 must be a type",
        ("megatron/core/transformer/multi_latent_attention.py",),
    ),
    # Not a monkeypatch: without SDPACoreAttention the local spec keeps upstream's
    # DotProductAttention, which does not take MLA's k_channels/v_channels.
    "sdpa_attention": Scenario(
        "deepseek_v3", ParallelLayout(),
        "DotProductAttention.__init__() got an unexpected keyword argument 'k_channels'",
        ("megatron/core/transformer/multi_latent_attention.py", "MLASelfAttention"),
    ),
}


def _build_and_forward(hf_dir: str, layout: ParallelLayout) -> torch.Tensor | None:
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.forward import forward_logits
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import destroy_layout, initialize_layout
    from mrl.models.registry import model_spec_from_hf

    try:
        coords = initialize_layout(layout)
        spec = model_spec_from_hf(hf_dir)
        built = build_model(spec, layout)
        load_hf_weights(built, coords, hf_dir)
        logits = forward_logits(built, probe_tokens(spec.vocab_size))
        return logits if coords.tp == 0 and coords.dp == 0 else None
    finally:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            destroy_layout()


def _without_then_with(rank: int, world_size: int, fix: str, hf_dir: str, layout: ParallelLayout) -> dict:
    """Run the scenario without `fix` (expect a failure), then with every fix; report both."""
    import os
    import traceback

    import megatron_patches
    from megatron.core.models.backends import LocalSpecProvider

    from megatron_patches import sdpa_attention

    if fix in megatron_patches.PATCH_MODULES:
        os.environ["MRL_SKIP_PATCHES"] = fix  # honoured by initialize_layout's apply() too
    sdpa = sdpa_attention.SDPACoreAttention
    if fix == "sdpa_attention":  # mrl.megatron.model.layer_specs imports the name at each call
        sdpa_attention.SDPACoreAttention = LocalSpecProvider().core_attention()
    try:
        _build_and_forward(hf_dir, layout)
        failure = None
    except Exception:  # noqa: BLE001 - the failure is the result
        failure = traceback.format_exc()
    without = megatron_patches.applied()

    os.environ.pop("MRL_SKIP_PATCHES", None)
    sdpa_attention.SDPACoreAttention = sdpa
    megatron_patches.apply()
    return {
        "failure": failure,
        "applied_without": without,
        "applied_with": megatron_patches.applied(),
        "logits": _build_and_forward(hf_dir, layout),
    }


@functools.cache
def _reference(hf_dir: str) -> torch.Tensor:
    from mrl.models.registry import model_spec_from_hf

    return reference_logits(hf_dir, probe_tokens(model_spec_from_hf(hf_dir).vocab_size))


@pytest.mark.parametrize("fix", list(SCENARIOS))
def test_fix_is_necessary_and_sufficient(fix, tiny_model_dir):
    import megatron_patches

    scenario = SCENARIOS[fix]
    hf_dir = str(tiny_model_dir(scenario.arch))
    per_rank = run_local(
        _without_then_with, scenario.layout.min_world_size(), fix, hf_dir, scenario.layout, timeout_s=180
    )
    every_patch = sorted(megatron_patches.PATCH_MODULES)
    for rank, result in enumerate(per_rank):
        # Necessary: without the fix, this rank fails with upstream's error, raised where expected.
        failure = result["failure"]
        assert failure is not None, f"rank {rank}: the scenario ran without {fix}: is the patch still needed?"
        assert scenario.error in failure, f"rank {rank}: expected {scenario.error!r}, got:\n{failure[-3000:]}"
        for where in scenario.where:
            assert where in failure, f"rank {rank}: {where!r} not in the traceback:\n{failure[-3000:]}"
        if fix in megatron_patches.PATCH_MODULES:
            assert result["applied_without"] == [p for p in every_patch if p != fix]
        else:
            assert result["applied_without"] == every_patch
        # Sufficient: with it (and every other patch), the same processes run the scenario.
        assert result["applied_with"] == every_patch
    logits = [r["logits"] for r in per_rank if r["logits"] is not None]
    assert logits, f"{fix}: no rank returned logits"
    diff = (logits[0] - _reference(hf_dir)).abs().max().item()
    assert diff <= TOLERANCE, f"{fix}: max |logit diff| to transformers {diff:.3g} > {TOLERANCE}"


def _clip_without_then_with(rank: int, world_size: int, hf_dir: str) -> dict:
    """A clipped Adam step without cpu_grad_clipping (expect upstream's assert), then with it."""
    import os
    import traceback

    import megatron_patches
    from megatron.core import parallel_state as ps

    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import destroy_layout, initialize_layout
    from mrl.megatron.training import OptimConfig, lm_micro_batches, make_trainable, train_step
    from mrl.models.registry import model_spec_from_hf

    def clipped_step():
        try:
            coords = initialize_layout(ParallelLayout())
            spec = model_spec_from_hf(hf_dir)
            built = build_model(spec, ParallelLayout())
            load_hf_weights(built, coords, hf_dir)
            trainable = make_trainable(built, OptimConfig(lr=1e-3, clip_grad=1e-3))  # always clips
            tokens = torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
            return train_step(trainable, lm_micro_batches(tokens, 1))
        finally:
            if ps.model_parallel_is_initialized():
                destroy_layout()

    os.environ["MRL_SKIP_PATCHES"] = "cpu_grad_clipping"
    try:
        clipped_step()
        failure = None
    except Exception:  # noqa: BLE001 - the failure is the result
        failure = traceback.format_exc()
    os.environ.pop("MRL_SKIP_PATCHES", None)
    megatron_patches.apply()
    result = clipped_step()
    return {"failure": failure, "grad_norm": result.grad_norm, "skipped": result.skipped}


def test_cpu_grad_clipping_is_necessary_and_sufficient(tiny_model_dir):
    (result,) = run_local(_clip_without_then_with, 1, str(tiny_model_dir("llama")), timeout_s=120)
    failure = result["failure"]
    assert failure is not None, "a clipped step ran without cpu_grad_clipping: is the patch still needed?"
    assert "megatron/core/optimizer/clip_grads.py" in failure and "AssertionError" in failure, failure[-3000:]
    assert result["skipped"] is False and result["grad_norm"] > 1e-3, result


def _logits_without_then_with(rank: int, world_size: int, fix: str, hf_dir: str, layout: ParallelLayout) -> dict:
    """Logits of the same forward without `fix`, then with every patch (a fix that changes numbers)."""
    import os

    import megatron_patches

    os.environ["MRL_SKIP_PATCHES"] = fix
    without = _build_and_forward(hf_dir, layout)
    applied_without = megatron_patches.applied()
    os.environ.pop("MRL_SKIP_PATCHES")
    megatron_patches.apply()
    return {"without": without, "applied_without": applied_without, "with": _build_and_forward(hf_dir, layout)}


def test_group_routing_top2_is_necessary_and_sufficient(tiny_model_dir):
    """3 experts per token from 2 of 4 groups: Megatron ranks groups by their top 3 // 2 = 1, HF by 2."""
    hf_dir = str(tiny_model_dir("deepseek_v3_groups"))
    (result,) = run_local(
        _logits_without_then_with, 1, "group_routing_top2", hf_dir, ParallelLayout(), timeout_s=180
    )
    assert "group_routing_top2" not in result["applied_without"]
    without = (result["without"] - _reference(hf_dir)).abs().max().item()
    with_fix = (result["with"] - _reference(hf_dir)).abs().max().item()
    assert without > TOLERANCE, f"parity without group_routing_top2 ({without:.3g}): is the patch still needed?"
    assert with_fix <= TOLERANCE, f"max |logit diff| to transformers with the patch {with_fix:.3g} > {TOLERANCE}"


def _grad_norms_without_then_with(rank: int, world_size: int, hf_dir: str) -> dict:
    """Grad norm of one lr-0 update (same batch on every rank): DP2 (the TP1 reference), then TP2
    without mla_rope_key_gradient, then TP2 with every patch."""
    import os

    import megatron_patches
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import destroy_layout, initialize_layout
    from mrl.megatron.training import OptimConfig, lm_micro_batches, make_trainable, train_step
    from mrl.models.registry import model_spec_from_hf

    def grad_norm(layout: ParallelLayout) -> float:
        coords = initialize_layout(layout)
        spec = model_spec_from_hf(hf_dir)
        built = build_model(spec, layout)
        load_hf_weights(built, coords, hf_dir)
        trainable = make_trainable(built, OptimConfig(lr=0.0, clip_grad=0.0))
        tokens = torch.randint(0, spec.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        result = train_step(trainable, lm_micro_batches(tokens, layout.tp))
        destroy_layout()
        return result.grad_norm

    os.environ["MRL_SKIP_PATCHES"] = "mla_rope_key_gradient"
    reference, without = grad_norm(ParallelLayout()), grad_norm(ParallelLayout(tp=2))
    applied_without = megatron_patches.applied()
    os.environ.pop("MRL_SKIP_PATCHES")
    megatron_patches.apply()
    return {"reference": reference, "without": without, "with": grad_norm(ParallelLayout(tp=2)),
            "applied_without": applied_without}


def test_mla_rope_key_gradient_is_necessary_and_sufficient(tiny_model_dir):
    """MLA under TP2 (local spec): the rotary key's gradient must hold every TP rank's heads."""
    (result, _) = run_local(_grad_norms_without_then_with, 2, str(tiny_model_dir("deepseek_v3")), timeout_s=240)
    assert "mla_rope_key_gradient" not in result["applied_without"]
    reference, without, with_fix = result["reference"], result["without"], result["with"]
    assert abs(without - reference) > 1e-5 * reference, (
        f"TP2 grad norm {without} equals TP1's {reference} without mla_rope_key_gradient: is the patch still needed?")
    assert abs(with_fix - reference) <= 1e-5 * reference, f"TP2 grad norm {with_fix} with the patch, TP1 {reference}"


def _replay_fallback_without_then_with(rank: int, world_size: int) -> dict:
    """A replayed target with a row of -1 (a token without a route): upstream gathers at id -1,
    the patch routes that token by the router's own top-k and records it."""
    import os

    import megatron_patches
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    def replay_one_row_missing():
        replay = RouterReplay()
        scores = torch.tensor([[0.1, 0.9, 0.5, 0.3], [0.8, 0.2, 0.7, 0.4]])
        replay.set_target_indices(torch.tensor([[3, 2], [-1, -1]]))
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        if "router_replay_fallback" in megatron_patches.applied():
            from megatron_patches.router_replay_fallback import record_own

            record_own(replay, True)
        try:
            probs, ids = replay.get_replay_topk(scores, 2, default_compute_topk=lambda s, k, **_: torch.topk(s, k, dim=1))
            return {"ids": ids, "probs": probs, "recorded": replay.get_recorded_indices()}
        except RuntimeError as exc:
            return {"error": str(exc)}
        finally:
            RouterReplay.global_router_replay_instances.remove(replay)

    os.environ["MRL_SKIP_PATCHES"] = "router_replay_fallback"
    megatron_patches.apply()
    without = replay_one_row_missing()
    os.environ.pop("MRL_SKIP_PATCHES")
    megatron_patches.apply()
    return {"without": without, "with": replay_one_row_missing()}


def test_router_replay_fallback_is_necessary_and_sufficient():
    (result,) = run_local(_replay_fallback_without_then_with, 1, timeout_s=120)
    assert "index -1 is out of bounds" in result["without"].get("error", ""), result["without"]
    fixed = result["with"]
    assert fixed["ids"].tolist() == [[3, 2], [0, 2]]  # the replayed row, then the router's own top-2
    assert torch.allclose(fixed["probs"], torch.tensor([[0.3, 0.5], [0.8, 0.7]]))
    assert fixed["recorded"].tolist() == [[1, 2], [0, 2]]  # the router's own choice of every token
