"""Optimizer CPU offload (optim.offload_fraction) through megatron-core's HybridDeviceOptimizer.

On CPU, host memory is "the device": the offloaded part still gets its own host copy (the
megatron_patches.cpu_hybrid_optimizer split), its gradients are copied to it, megatron's CPU
sub-optimizer steps it and the result is copied back into the model's parameters, as on a GPU.
Acceptance: three steps with offload_fraction 0.5 and 1.0 give the losses and weights of the run
without offload. Not bitwise: the offload path runs torch's fused AdamW kernel (megatron asks for
fused=True), the plain path torch's loop AdamW; same formula, different rounding, so fp32 weights
agree to 1e-6 (a wrong split or a missed copy-back moves weights by ~lr = 1e-3). Without the patch
the first offloaded step fails with upstream's KeyError. A checkpoint of the offloaded run saves,
and resuming its optimizer on CPU is refused with an error naming the setting (megatron restores
the offload optimizer's state only inside the distributed optimizer, which needs CUDA).
"""

from __future__ import annotations

import torch

from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local

FRACTIONS = (0.0, 0.5, 1.0)
STEPS = 3


def _train(hf_dir: str, fraction: float, checkpoint: str | None = None) -> dict:
    from megatron.core import parallel_state as ps

    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import destroy_layout, initialize_layout
    from mrl.megatron.training import OptimConfig, lm_micro_batches, make_trainable, train_step
    from mrl.models.registry import model_spec_from_hf

    spec = model_spec_from_hf(hf_dir)
    tokens = torch.randint(0, spec.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    try:
        coords = initialize_layout(ParallelLayout())
        built = build_model(spec, ParallelLayout())
        load_hf_weights(built, coords, hf_dir)
        trainable = make_trainable(built, OptimConfig(lr=1e-3, offload_fraction=fraction))
        losses = [train_step(trainable, lm_micro_batches(tokens, 1)).loss for _ in range(STEPS)]
        params = dict(built.chunks[0].named_parameters())
        split = {"copies": 0, "on_device": 0}
        for inner in trainable.optimizer.chained_optimizers:
            hybrid = inner.optimizer
            if type(hybrid).__name__ == "HybridDeviceOptimizer":
                # the offloaded copies are other tensors than the model's parameters
                split["copies"] += sum(c is not p for p, c in hybrid.gpu_params_map_cpu_copy.items())
                split["on_device"] += sum(len(g["params"]) for g in hybrid.gpu_param_groups)
        refused = None
        if checkpoint:  # saving works; resuming the offloaded optimizer on CPU is refused, by name
            from mrl.megatron.checkpoint import load_checkpoint, save_checkpoint

            save_checkpoint(checkpoint, trainable, step=STEPS)
            try:
                load_checkpoint(checkpoint, trainable)
            except ValueError as err:
                refused = str(err)
        return {"losses": losses, "weights": {n: p.detach().clone() for n, p in params.items()}, "split": split,
                "params": len(params), "refused": refused}
    finally:
        if ps.model_parallel_is_initialized():
            destroy_layout()


def _offload_runs(rank: int, world_size: int, hf_dir: str, checkpoint: str) -> dict:
    import os
    import traceback

    import megatron_patches

    os.environ["MRL_SKIP_PATCHES"] = "cpu_hybrid_optimizer"
    try:
        _train(hf_dir, 1.0)
        failure = None
    except Exception:  # noqa: BLE001 - the failure is the result
        failure = traceback.format_exc()
    os.environ.pop("MRL_SKIP_PATCHES")
    megatron_patches.apply()
    return {"failure": failure, "runs": {f: _train(hf_dir, f, checkpoint if f == 1.0 else None) for f in FRACTIONS}}


def test_offload_trains_like_no_offload(tiny_model_dir, tmp_path):
    (result,) = run_local(_offload_runs, 1, str(tiny_model_dir("llama")), str(tmp_path / "ckpt"), timeout_s=300)
    failure = result["failure"]
    assert failure is not None, "offload ran without cpu_hybrid_optimizer: is the patch still needed?"
    assert "hybrid_optimizer.py" in failure and "KeyError" in failure, failure[-2000:]
    runs = result["runs"]
    plain = runs[0.0]
    assert plain["split"] == {"copies": 0, "on_device": 0}, "offload_fraction 0 must not build the hybrid optimizer"
    assert plain["losses"][-1] < plain["losses"][0] - 0.1, plain["losses"]
    for fraction in FRACTIONS[1:]:
        run = runs[fraction]
        split = run["split"]
        assert split["copies"] > 0, f"{fraction}: nothing was offloaded: {split}"
        if fraction == 1.0:
            assert split == {"copies": run["params"], "on_device": 0}, split
        else:
            assert split["on_device"] > 0, f"{fraction}: everything was offloaded: {split}"
        assert max(abs(a - b) for a, b in zip(run["losses"], plain["losses"])) <= 1e-6, (run["losses"], plain["losses"])
        worst = max((run["weights"][n] - plain["weights"][n]).abs().max().item() for n in plain["weights"])
        assert worst <= 1e-6, f"offload_fraction {fraction}: weights differ from no offload by {worst:.3g}"
    assert "offload_fraction > 0 is not supported on CPU" in (runs[1.0]["refused"] or ""), runs[1.0]["refused"]
