"""trainer.offload_actor_during_rollout on the actor worker (two gloo processes, TP2, tiny qwen3).

Three policy updates with a KL reference, once plainly and once with the driver's offload calls
around each "generation" (grads, optimizer and reference away, then the weights, then all back),
run through the real release/restore path on host storages (`move_host_tensors`: every storage
resized to 0 and refilled from its host copy, as on a GPU). The losses, the log-probs of the actor
and of the reference, and every weight after the three steps must equal the plain run bitwise.
Each rank's reported bytes must equal its parameter, gradient-buffer, optimizer-state and
reference bytes counted here from the model and Adam's state; without `move_host_tensors` (a CPU
run) the same bytes are reported and nothing is freed.
"""

from __future__ import annotations

import torch

from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local

STEPS = 3


def _batch(vocab: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    rows, width = 4, 16
    tokens = torch.randint(3, vocab, (rows, width + 1), generator=generator)
    mask = torch.zeros(rows, width)
    mask[:, 3:] = 1.0
    return {"tokens": tokens, "response_mask": mask,
            "advantages": torch.randn(rows, 1, generator=generator).expand(-1, width) * mask,
            "old_logprobs": -torch.rand(rows, width, generator=generator) * 8,
            "ref_logprobs": -torch.rand(rows, width, generator=generator) * 8}


def _expected_bytes(actor) -> dict:
    """The rank's bytes by part, counted from the model, DDP's grad buffers and Adam's moments."""
    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    chunks, trainable = actor.trainable.built.chunks, actor.trainable
    params = [p for c in chunks for p in c.parameters()]
    moments = [v for o in trainable.optimizer.chained_optimizers for s in o.optimizer.state.values()
               for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    steps = [v for o in trainable.optimizer.chained_optimizers for s in o.optimizer.state.values()
             for k, v in s.items() if k == "step" and torch.is_tensor(v)]
    return {"weights": nbytes(params) + nbytes(b for c in chunks for _, b in c.named_buffers()),
            "grads": nbytes(b.grad_data for d in trainable.ddp_chunks for b in d.buffers + d.expert_parallel_buffers),
            "optimizer": nbytes(moments) + nbytes(steps),
            "reference": nbytes(p for c in actor.reference.chunks for p in c.parameters())
                         + nbytes(b for c in actor.reference.chunks for _, b in c.named_buffers()),
            "moments_vs_params": (nbytes(moments), 2 * nbytes(params))}


def _train(rank: int, world_size: int, hf_dir: str, offload: str | None) -> dict:
    from megatron.core import parallel_state as ps

    from mrl.config.schema import OptimConfig
    from mrl.megatron.parallel import destroy_layout
    from mrl.workers.actor import ActorSetup, MegatronActor

    actor = MegatronActor(rank, world_size)
    try:
        actor.setup(ActorSetup(hf_dir=hf_dir, layout=ParallelLayout(tp=2), reference=True, optim=OptimConfig(lr=1e-3)))
        batch = _batch(actor.trainable.built.spec.vocab_size)
        out = {"losses": [], "logprobs": [], "ref_logprobs": [], "reports": [], "freed": []}
        for _ in range(STEPS):
            metrics = actor.update(batch, {"kl_coef": 0.1})
            out["losses"].append(None if metrics is None else metrics["actor/pg_loss"])
            if offload is not None:  # the driver: push (grads etc. away), generate (weights away too), back
                move = offload == "moved"
                first = actor.offload_state(["grads", "optimizer", "reference"], move)
                second = actor.offload_state(["weights"], move)
                out["freed"].append(sum(p.untyped_storage().nbytes() for c in actor.trainable.built.chunks
                                        for p in c.parameters()))
                back = actor.onload_state()
                out["reports"].append({"off": {**first["by_part"], **second["by_part"]}, "on": back["by_part"],
                                       "moved": (first["moved"], second["moved"], back["moved"])})
            for key, reference in (("logprobs", False), ("ref_logprobs", True)):
                scored = actor.logprobs(batch, reference=reference)
                out[key].append(None if scored is None else scored["logprobs"])
        out["weights"] = {n: p.detach().clone() for c in actor.trainable.built.chunks for n, p in c.named_parameters()}
        out["expected"] = _expected_bytes(actor)
        return out
    finally:
        if ps.model_parallel_is_initialized():
            destroy_layout()


def _three_runs(rank: int, world_size: int, hf_dir: str) -> dict:
    return {offload: _train(rank, world_size, hf_dir, offload) for offload in (None, "moved", "in_place")}


def test_offload_round_trips_leave_training_unchanged(tiny_model_dir):
    per_rank = run_local(_three_runs, 2, str(tiny_model_dir("qwen3")), timeout_s=300)
    for rank, runs in enumerate(per_rank):
        a, b, in_place = runs[None], runs["moved"], runs["in_place"]
        assert a["losses"] == b["losses"], f"rank {rank}: {a['losses']} vs {b['losses']}"
        for key in ("logprobs", "ref_logprobs"):
            for x, y in zip(a[key], b[key]):
                assert (x is None and y is None) or torch.equal(x, y), f"rank {rank}: {key} differ"
        assert sorted(a["weights"]) == sorted(b["weights"])
        differ = [n for n, w in a["weights"].items() if not torch.equal(w, b["weights"][n])]
        assert not differ, f"rank {rank}: weights differ after {STEPS} steps: {differ[:4]}"
        assert in_place["weights"].keys() == a["weights"].keys()
        assert all(torch.equal(w, in_place["weights"][n]) for n, w in a["weights"].items())
        if rank == 0:  # the reporter (TP rank 0); the loss moves over the steps
            assert a["losses"][0] is not None and a["losses"][0] != a["losses"][-1], a["losses"]

        expected = b["expected"]
        moments, params = expected.pop("moments_vs_params")
        assert moments == params > 0  # fp32 Adam: two moments per parameter element
        for run, freed, flags in ((b, 0, (True, True, True)), (in_place, None, (False, False, False))):
            for report, left in zip(run["reports"], run["freed"]):
                assert report["off"] == expected and report["on"] == expected, (rank, report, expected)
                assert report["moved"] == flags, report
                # moved: every parameter's storage is empty while away; in place: all still held
                assert left == (freed if freed is not None else params // 2), (rank, left)
