"""Activation recomputation (model.recompute) gives the update of a run without it.

One training step of a tiny llama (dense) and a tiny DeepSeek-V3 (MLA + MoE with a shared expert)
with model.recompute none, selective (Megatron's default, core attention; every submodule the
architecture has, one at a time and all together) and full (blocks of 1 and 2 layers). The loss
must equal the no-recompute run bitwise, and so must every gradient, except where the "layernorm"
submodule is recomputed: Megatron's CheckpointWithoutOutput reruns the norm in its own
autograd.backward and hands the input's gradient back, so the residual's two contributions are
added in another order: fp32 rounding, measured at most 1e-6 of each gradient's largest entry
(allowed: 4e-6). A wrong recomputed input or a lost gradient path is off by O(1) of it.
Without megatron_patches.checkpoint_without_te, "layernorm" recompute fails without TE.
"""

from __future__ import annotations

import pytest
import torch

from mrl.config.schema import Recompute
from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local

MODES = {
    "none": Recompute(),
    "selective default": Recompute("selective"),
    "full 1": Recompute("full", num_layers=1),
    "full 2": Recompute("full", num_layers=2),
}
ALL_MODULES = {"llama": ("core_attn", "layernorm", "mlp"),
               "deepseek_v3": ("core_attn", "layernorm", "mlp", "moe", "shared_experts", "mla_up_proj")}


def _one_step(hf_dir: str, recompute: Recompute) -> dict:
    from megatron.core import parallel_state as ps

    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import destroy_layout, initialize_layout
    from mrl.megatron.training import OptimConfig, lm_micro_batches, make_trainable, train_step
    from mrl.models.registry import model_spec_from_hf

    spec = model_spec_from_hf(hf_dir)
    tokens = torch.randint(0, spec.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    try:
        coords = initialize_layout(ParallelLayout())
        built = build_model(spec, ParallelLayout(), transformer_impl="local", recompute=recompute)
        load_hf_weights(built, coords, hf_dir)
        trainable = make_trainable(built, OptimConfig(lr=1e-3))
        grads, step = {}, trainable.optimizer.step

        def capture_then_step():  # the gradients the optimizer is about to apply
            for name, param in built.chunks[0].named_parameters():
                grads[name] = param.main_grad.detach().clone()
            return step()

        trainable.optimizer.step = capture_then_step
        result = train_step(trainable, lm_micro_batches(tokens, 1, micro_batch_size=2))
        return {"loss": result.loss, "grads": grads}
    finally:
        if ps.model_parallel_is_initialized():
            destroy_layout()


def _all_modes(rank: int, world_size: int, hf_dir: str, arch: str) -> dict:
    import os
    import traceback

    import megatron_patches

    os.environ["MRL_SKIP_PATCHES"] = "checkpoint_without_te"
    try:
        _one_step(hf_dir, Recompute("selective", ("layernorm",)))
        failure = None
    except Exception:  # noqa: BLE001 - the failure is the result
        failure = traceback.format_exc()
    os.environ.pop("MRL_SKIP_PATCHES")
    megatron_patches.apply()
    modes = dict(MODES, **{f"selective {m}": Recompute("selective", (m,)) for m in ALL_MODULES[arch]})
    modes["selective all"] = Recompute("selective", ALL_MODULES[arch])
    return {"failure": failure, "runs": {name: _one_step(hf_dir, recompute) for name, recompute in modes.items()}}


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_recompute_gives_the_same_gradients(arch, tiny_model_dir):
    (result,) = run_local(_all_modes, 1, str(tiny_model_dir(arch)), arch, timeout_s=400)
    failure = result["failure"]
    assert failure is not None, "layernorm recompute ran without checkpoint_without_te: is the patch still needed?"
    assert "FP8GlobalStateManager" in failure, failure[-2000:]
    runs = result["runs"]
    reference = runs.pop("none")
    assert any(g.abs().max() > 0 for g in reference["grads"].values())
    for name, run in runs.items():
        assert run["loss"] == reference["loss"], f"{arch} {name}: loss {run['loss']} vs {reference['loss']}"
        assert sorted(run["grads"]) == sorted(reference["grads"])
        if "layernorm" in name or name == "selective all":
            worst = max(((run["grads"][n] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item()
                        for n, g in reference["grads"].items())
            assert worst <= 4e-6, f"{arch} {name}: gradients differ by {worst:.3g} of their largest entry"
        else:
            differ = [n for n, g in reference["grads"].items() if not torch.equal(run["grads"][n], g)]
            assert not differ, f"{arch} {name}: gradients differ for {differ[:4]}"


def _actor_setup(rank: int, world_size: int, hf_dir: str) -> dict:
    from megatron.core import parallel_state as ps

    from mrl.config.schema import OptimConfig
    from mrl.megatron.parallel import destroy_layout
    from mrl.workers.actor import ActorSetup, MegatronActor

    actor = MegatronActor(rank, world_size)
    try:
        actor.setup(ActorSetup(hf_dir=hf_dir, layout=ParallelLayout(), recompute=Recompute("full", num_layers=2),
                               optim=OptimConfig(offload_fraction=1.0)))
        config = actor.trainable.built.chunks[0].config
        inner = [type(o.optimizer).__name__ for o in actor.trainable.optimizer.chained_optimizers]
        return {"recompute": (config.recompute_granularity, config.recompute_method, config.recompute_num_layers),
                "optimizers": inner}
    finally:
        if ps.model_parallel_is_initialized():
            destroy_layout()


def test_the_actor_worker_builds_with_both_settings(tiny_model_dir):
    """What a Ray actor rank does with launch's ActorSetup (mrl.config.derived.recompute_of, optim_for)."""
    (result,) = run_local(_actor_setup, 1, str(tiny_model_dir("llama")), timeout_s=120)
    assert result["recompute"] == ("full", "uniform", 2), result
    assert result["optimizers"] == ["HybridDeviceOptimizer"], result
