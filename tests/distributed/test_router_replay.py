"""MoE routing replay in the Megatron trainer (mrl.megatron.router_replay) on tiny qwen3_moe and (the
matrix) DeepSeek-V3 (first layer dense, group-limited sigmoid routing, a shared expert).

One process per architecture: the routers' choices are read with forward hooks on the routers.
(a) R3: replaying routes unlike the trainer's own (every expert id + 1) makes the routers choose
    exactly them, in the old-log-prob pass and in an update; a sample's last position and padding
    route themselves; the gradient still reaches the router weights (and differs from the one
    without replay); the agreement metrics count the difference.
(b) Replaying the trainer's own routes changes no bit of the log-probs, the loss or the gradient.
(c) R2: the routes recorded in the old-log-prob pass are replayed exactly in an update whose rows
    are re-ordered and re-cut into other micro-batches (a token budget).
(d) A malformed route (an all-zero row) is refused with its sample, MoE layer and token named.
Then a layout: the same routes replayed under TP2×EP2 give the one-process log-probs, gradient and
recorded routes (sequence-parallel slicing and gathering); the matrix adds PP2 with full recompute
(replay in recomputation), CP2 and DeepSeek-V3.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.rollout import ragged_rollout_batch
from fixtures.routes import UsedRoutes
from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local

TIMEOUT_S = 300
LENGTHS, PROMPT = [9, 18, 3, 14, 6], 4  # response tokens of the 5 rows; 4-token prompts


def _batch(vocab: int) -> dict:
    batch = ragged_rollout_batch(vocab, LENGTHS, prompt=PROMPT)
    batch["routes_len"] = torch.tensor([PROMPT + n - 1 for n in LENGTHS])  # the engine's T per sample
    batch["sample_ids"] = torch.arange(10, 15)
    return batch


def _build(hf_dir: str, layout: ParallelLayout, recompute=None):
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.config.schema import Recompute
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import initialize_layout
    from mrl.megatron.training import OptimConfig, make_trainable
    from mrl.models.registry import model_spec_from_hf

    coords = initialize_layout(layout)
    built = build_model(model_spec_from_hf(hf_dir), layout, recompute=recompute or Recompute())
    load_hf_weights(built, coords, hf_dir)
    # lr 0 and (DeepSeek-V3) no expert-bias update: every pass sees the same model and routing
    built.chunks[0].config.moe_router_bias_update_rate = 0.0
    return make_trainable(built, OptimConfig(lr=0.0, clip_grad=0.0))


def _router_grads(built) -> torch.Tensor:
    grads = [p.main_grad.flatten().clone() for chunk in built.chunks for n, p in chunk.named_parameters()
             if n.endswith("router.weight")]
    return torch.cat(grads)


def _one_process(rank: int, world_size: int, hf_dir: str) -> dict:
    from mrl.megatron.parallel import destroy_layout
    from mrl.megatron.policy import compute_logprobs, micro_batches, update_actor
    from mrl.megatron.router_replay import RoutePlan, prepare, route_shape_of, routing_results

    trainable = _build(hf_dir, ParallelLayout())
    built, shape = trainable.built, route_shape_of(trainable.built)
    batch = _batch(built.spec.vocab_size)
    count, length = batch["response_mask"].shape
    old = compute_logprobs(trainable, batch, 1, 1, routes=RoutePlan(record=True))
    own = old["own_routes"]
    given = {**batch, "routes": ((own.clamp(min=0) + 1) % shape.n_experts).to(shape.torch_dtype)}
    out: dict = {"own": own, "given": given["routes"], "plain_logprobs": old["logprobs"]}

    # (a) R3 in the old-log-prob pass: the routers choose the given routes; the rest routes itself.
    inputs, plan = prepare(given, built, "R3", "old")
    used = UsedRoutes(built)
    replayed = compute_logprobs(trainable, inputs, 1, 1, routes=plan)
    used.close()
    out["r3_used"] = used.ids(micro_batches(inputs, 1, 1), count, length, shape.top_k)
    out["r3_own"], out["r3_logprobs"] = replayed["own_routes"], replayed["logprobs"]
    out["r3_metrics"] = routing_results(replayed["own_routes"], given, "R3", shape)

    # ... and in an update (lr 0), whose gradient reaches the routers.
    given["old_logprobs"] = replayed["logprobs"]
    inputs, plan = prepare(given, built, "R3", "update")
    used = UsedRoutes(built)
    out["r3_update"] = update_actor(trainable, inputs, {}, 1, routes=plan)
    used.close()
    out["r3_update_used"] = used.ids(micro_batches(inputs, 1, 1), count, length, shape.top_k)
    out["r3_grads"] = _router_grads(built)
    out["plain_update"] = update_actor(trainable, {**batch, "old_logprobs": replayed["logprobs"]}, {}, 1)
    out["plain_grads"] = _router_grads(built)

    # (b) replaying the trainer's own routes: not a bit changes.
    mine = {**batch, "routes": own.clamp(min=0).to(shape.torch_dtype), "old_logprobs": old["logprobs"]}
    out["own_replayed_logprobs"] = compute_logprobs(trainable, mine, 1, 1, routes=prepare(mine, built, "R3", "old")[1])["logprobs"]
    out["own_metrics"] = routing_results(own, mine, "none", shape)
    out["own_update"] = update_actor(trainable, mine, {}, 1, routes=prepare(mine, built, "R3", "update")[1])
    out["own_plain_update"] = update_actor(trainable, mine, {}, 1)

    # (c) R2: the old pass's routes (micro-batches of 1 row) replayed in a mini-batch of re-ordered
    # rows cut by a token budget of 2 rows.
    r2 = routing_results(own, batch, "R2", shape)
    part = {k: v[[3, 0, 4]] for k, v in {**batch, **r2, "old_logprobs": old["logprobs"]}.items()}
    inputs, plan = prepare(part, built, "R2", "update")
    used = UsedRoutes(built)
    update_actor(trainable, inputs, {}, 1, max_tokens=2 * 24, routes=plan)
    used.close()
    out["r2_routes"], out["r2_len"] = r2["routes"], r2["routes_len"]
    out["r2_used"] = used.ids(micro_batches(inputs, 1, 1, 2 * 24), 3, length, shape.top_k)

    # (d) a malformed route
    broken = {**given, "routes": given["routes"].clone()}
    broken["routes"][2, 5, 1] = 0  # sample 12, MoE layer 1, token 5: both ids 0
    try:
        prepare(broken, built, "R3", "old")
        out["refused"] = None
    except ValueError as exc:
        out["refused"] = str(exc)
    destroy_layout()
    return out


# DeepSeek-V3 in the matrix only (make test keeps one architecture of this per-process case)
@pytest.fixture(scope="module", params=["qwen3_moe", pytest.param("deepseek_v3", marks=pytest.mark.matrix)])
def one_process(request, tiny_model_dir):
    hf_dir = str(tiny_model_dir(request.param))
    return request.param, hf_dir, run_local(_one_process, 1, hf_dir, timeout_s=TIMEOUT_S)[0]


def _sets(ids: torch.Tensor) -> torch.Tensor:
    return ids.long().sort(dim=-1).values


def test_replay_routes_to_the_given_experts(one_process):
    arch, _, r = one_process
    lengths = _batch(1000)["routes_len"]
    positions = torch.arange(r["own"].shape[1]).unsqueeze(0)
    routed, forwarded = positions < lengths.unsqueeze(1), r["own"][:, :, 0, 0] >= 0
    assert not torch.equal(_sets(r["given"])[routed], _sets(r["own"])[routed])  # unlike the trainer's own
    for used in ("r3_used", "r3_update_used"):
        assert torch.equal(_sets(r[used])[routed], _sets(r["given"])[routed]), f"{arch}: {used} is not the given routes"
    fallback = forwarded & ~routed  # last position and padding: the router's own choice under replay
    assert fallback.any() and torch.equal(_sets(r["r3_used"])[fallback], _sets(r["r3_own"])[fallback]), arch
    assert (r["r3_logprobs"] - r["plain_logprobs"]).abs().max() > 1e-3, f"{arch}: replay changed nothing"
    # The metrics compare the trainer's own top-k (here: under replay) with the given routes.
    from mrl.routes import agreement, agreement_from_counts

    counts = r["r3_metrics"]["routing_counts"]
    assert agreement_from_counts(counts) == agreement(r["r3_own"], r["given"], routed & forwarded)
    assert counts[0] == 0 and counts[-2] == routed.sum(), counts  # the first MoE layer sees unchanged inputs


def test_gradients_reach_the_router_under_replay(one_process):
    arch, _, r = one_process
    grads, plain = r["r3_grads"], r["plain_grads"]
    assert torch.isfinite(grads).all() and grads.abs().sum() > 0, f"{arch}: no router gradient under replay"
    assert not torch.allclose(grads, plain), f"{arch}: replay left the router gradient as without it"
    assert r["r3_update"]["actor/grad_norm"] > 0


def test_replaying_the_own_routes_changes_nothing(one_process):
    arch, _, r = one_process
    assert torch.equal(r["own_replayed_logprobs"], r["plain_logprobs"]), arch
    assert r["own_update"] == r["own_plain_update"], f"{arch}: {r['own_update']} vs {r['own_plain_update']}"
    from mrl.routes import agreement_from_counts

    assert agreement_from_counts(r["own_metrics"]["routing_counts"]) == {
        "rollout/routing_agreement": 1.0, "rollout/routing_agreement_min_layer": 1.0,
        "rollout/routing_tokens_any_diff": 0.0}


def test_r2_replays_the_recorded_routes_in_recut_micro_batches(one_process):
    arch, _, r = one_process
    recorded = r["r2_routes"][[3, 0, 4]]
    used = r["r2_used"]
    forwarded = used[:, :, 0, 0] >= 0
    assert r["r2_len"].unique().numel() == 1 and forwarded.sum() > 0
    assert torch.equal(_sets(used)[forwarded], _sets(recorded)[forwarded]), arch


def test_a_malformed_route_is_refused_by_name(one_process):
    arch, _, r = one_process
    assert r["refused"] is not None and r["refused"].startswith("sample 12, MoE layer 1, token 5: expert ids"), r["refused"]
    assert "all-zero row" in r["refused"]


def _layout_replay(rank: int, world_size: int, hf_dir: str, layout: ParallelLayout, given: torch.Tensor,
                   recompute, rows: int) -> dict | None:
    """The one-process case's R3 routes replayed in `layout` through the actor's own methods (the
    driver's calls): R3 log-probs and update, then (R2) the routes the old pass records."""
    from mrl.config.schema import OptimConfig, Recompute
    from mrl.megatron.parallel import destroy_layout
    from mrl.workers.actor import ActorSetup, MegatronActor

    actor = MegatronActor(rank, world_size)
    actor.setup(ActorSetup(hf_dir=hf_dir, layout=layout, recompute=recompute or Recompute(), router_replay="R3",
                           optim=OptimConfig(lr=0.0, clip_grad=0.0, micro_batch_size=1)))
    actor.trainable.built.chunks[0].config.moe_router_bias_update_rate = 0.0
    batch = {k: v[:rows] for k, v in {**_batch(actor.trainable.built.spec.vocab_size), "routes": given}.items()}
    old = actor.logprobs(batch)
    logprobs = [None] if old is None else [old["logprobs"]]
    torch.distributed.broadcast_object_list(logprobs, src=world_size - 1 if layout.pp > 1 else 0)
    update = actor.update({**batch, "old_logprobs": logprobs[0]}, {})
    actor.setup_args.router_replay = "R2"  # the same model recording its own routes
    recorded = actor.logprobs({k: v for k, v in batch.items() if k not in ("routes", "routes_len")})
    destroy_layout()
    return None if old is None else {"old": old, "update": update, "recorded": recorded}


# name → (layout, recompute, rows of the batch)
LAYOUTS = {
    "TP2xEP2": (ParallelLayout(tp=2, ep=2, etp=1), None, 5),
    "PP2 full recompute": (ParallelLayout(pp=2), "full", 5),
    "CP2": (ParallelLayout(cp=2), None, 5),
    # 4 micro-batches (the interleaved schedule wants a multiple of PP); DeepSeek-V3's first chunk is one dense layer
    "PP2xVPP2 full recompute": (ParallelLayout(pp=2, vpp=2), "full", 4),
}


def _check_layout(one_process, name):
    from mrl.config.schema import Recompute

    arch, hf_dir, r = one_process
    from mrl.routes import agreement_counts

    layout, recompute, rows = LAYOUTS[name]
    ranks = run_local(_layout_replay, 2, hf_dir, layout, r["given"],
                      Recompute(recompute, num_layers=1) if recompute else None, rows, timeout_s=TIMEOUT_S)
    (result,) = [one for one in ranks if one is not None]  # the reporter (last stage, TP and CP rank 0)
    mask = _batch(1000)["response_mask"].bool()[:rows]
    old, recorded = result["old"], result["recorded"]
    assert (old["logprobs"] - r["r3_logprobs"][:rows])[mask].abs().max() <= 1e-5, f"{arch} {name}: log-probs differ"
    both = (r["r3_own"][:rows, :, 0, 0] >= 0) & (torch.arange(mask.shape[1]) < _batch(1000)["routes_len"][:rows, None])
    expected = agreement_counts(r["r3_own"][:rows], r["given"][:rows].long(), both)
    assert torch.equal(old["routing_counts"], expected), f"{arch} {name}"
    if rows == 5:  # the one-process update's batch
        assert result["update"]["actor/grad_norm"] == pytest.approx(r["r3_update"]["actor/grad_norm"], rel=1e-4)
    own = r["own"][:rows]
    forwarded = own[:, :, 0, 0] >= 0
    assert torch.equal(recorded["routes"][forwarded], own[forwarded].to(recorded["routes"].dtype)), \
        f"{arch} {name}: recorded routes differ from one process's"
    assert recorded["routes_len"].tolist() == [int(forwarded[0].sum())] * rows and "routing_counts" not in recorded


@pytest.mark.parametrize("name", ["TP2xEP2"])
def test_replay_in_a_layout(one_process, name):
    if one_process[0] != "qwen3_moe":
        pytest.skip("one architecture in make test; the matrix runs DeepSeek-V3")
    _check_layout(one_process, name)


@pytest.mark.matrix
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replay_in_every_layout(one_process, name):
    _check_layout(one_process, name)
