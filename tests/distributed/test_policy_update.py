"""The Megatron actor update (mrl.megatron.policy) on 2 gloo processes.

(a) Vocab-parallel log-probs and entropy under TP2 equal a full-vocabulary log_softmax of the
    gathered logits, values and gradients; with the real vocabulary size given, padded rows (in
    the last shard) get no probability and no gradient.
(b) The first update: compute_logprobs then update_actor with the same micro-batching gives
    ppo_kl == 0 and ratio_mean == 1 exactly, a positive grad norm and moved weights, under TP2 and
    PP2 (tiny qwen3, token-budget micro-batching with a filler row; then one SFT step) and EP2 (tiny
    qwen3_moe, KL and entropy terms on). Metrics are the same on every rank (broadcast from the last
    stage).
"""

from __future__ import annotations

import pytest
import torch

from fixtures.rollout import ragged_rollout_batch
from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local
from mrl.megatron.parallel import from_last_stage

TIMEOUT_S = 240


def _vocab_parallel_parity(rank: int, world_size: int, real: int | None) -> dict:
    from megatron.core import parallel_state as ps

    from mrl.megatron.parallel import destroy_layout, initialize_layout
    from mrl.megatron.vocab_parallel import vocab_parallel_entropy, vocab_parallel_logprobs

    initialize_layout(ParallelLayout(tp=2))
    generator = torch.Generator().manual_seed(0)
    vocab, shard = 256, 128
    full = torch.randn(3, 5, vocab, generator=generator, dtype=torch.float64).float() * 4
    labels = torch.randint(0, real or vocab, (3, 5), generator=generator)
    w_logp, w_ent = torch.randn(3, 5, generator=generator), torch.randn(3, 5, generator=generator)
    start = ps.get_tensor_model_parallel_rank() * shard

    local = full[..., start : start + shard].clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs(local, labels, real), vocab_parallel_entropy(local, real)
    untouched = torch.equal(local.detach(), full[..., start : start + shard])
    ((logp * w_logp).sum() + (entropy * w_ent).sum()).backward()

    reference = full.clone().requires_grad_(True)
    log_softmax = reference[..., : real or vocab].log_softmax(-1)
    ref_logp = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    ((ref_logp * w_logp).sum() + (ref_entropy * w_ent).sum()).backward()
    destroy_layout()
    return {
        "logp": (logp - ref_logp).abs().max().item(),
        "entropy": (entropy - ref_entropy).abs().max().item(),
        # Rows past `real` are not read by the reference: their gradient is 0 there and must be here.
        "grad": (local.grad - reference.grad[..., start : start + shard]).abs().max().item(),
        "grad_norm": local.grad.norm().item(),
        "untouched": untouched,
    }


@pytest.mark.parametrize("real", [None, 200], ids=["all rows", "padded rows past 200"])
def test_vocab_parallel_logprobs_and_entropy_tp2(real):
    for rank, result in enumerate(run_local(_vocab_parallel_parity, 2, real, timeout_s=TIMEOUT_S)):
        assert result["untouched"], f"rank {rank}: the logits were modified in place"
        assert result["logp"] <= 1e-6 and result["entropy"] <= 1e-6, f"rank {rank}: {result}"
        assert result["grad"] <= 1e-6 and result["grad_norm"] > 0, f"rank {rank}: {result}"


# name → (arch, layout, micro_batch_size, token budget, algo)
CASES = {
    "qwen3 TP2": ("qwen3", ParallelLayout(tp=2), 2, None, {}),
    "qwen3 PP2": ("qwen3", ParallelLayout(pp=2), 1, 2 * 24, {}),
    "qwen3_moe EP2": ("qwen3_moe", ParallelLayout(ep=2), 2, None,
                      {"kl_coef": 0.1, "entropy_coef": 0.01, "aggregation": "seq-mean-token-mean"}),
}


def _rollout_batch(vocab: int) -> dict:
    """5 sequences: 4-token prompts and responses of 3..18 tokens, right-padded to 24 tokens."""
    generator = torch.Generator().manual_seed(0)
    batch = ragged_rollout_batch(vocab, [9, 18, 3, 14, 6], generator=generator)
    return batch | {"ref_logprobs": -torch.rand(5, 24, generator=generator) * 8}


def _first_updates(rank: int, world_size: int, dirs: dict) -> dict:
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import destroy_layout, initialize_layout
    from mrl.megatron.policy import compute_logprobs, update_actor, update_sft
    from mrl.megatron.training import OptimConfig, make_trainable
    from mrl.models.registry import model_spec_from_hf

    results = {}
    for name, (arch, layout, size, budget, algo) in CASES.items():
        coords = initialize_layout(layout)
        spec = model_spec_from_hf(dirs[arch])
        built = build_model(spec, layout)
        load_hf_weights(built, coords, dirs[arch])
        trainable = make_trainable(built, OptimConfig(lr=1e-3))
        batch = _rollout_batch(spec.vocab_size)
        before = {n: p.detach().clone() for chunk in built.chunks for n, p in chunk.named_parameters()}
        scored = compute_logprobs(trainable, batch, layout.tp, size, with_entropy=True, max_tokens=budget)
        # The trainer would gather this from the last stage; here the batch is the same on all ranks.
        logprobs = from_last_stage(scored["logprobs"] if scored else None)
        metrics = update_actor(trainable, {**batch, "old_logprobs": logprobs}, algo, size, max_tokens=budget)
        after = {n: p.detach() for chunk in built.chunks for n, p in chunk.named_parameters()}
        unchanged = [n for n in before if torch.equal(before[n], after[n])]
        # SFT shares the micro-batching: one step on the same batch, response tokens only.
        sft = update_sft(trainable, batch, size, max_tokens=budget) if name == "qwen3 PP2" else None
        results[name] = {
            "metrics": metrics, "unchanged": unchanged, "params": len(before), "sft": sft,
            "logprobs": logprobs, "entropy": None if scored is None else scored["entropy"],
        }
        destroy_layout()
    return results


def test_first_update_has_exact_unit_ratio(tiny_model_dir):
    dirs = {arch: str(tiny_model_dir(arch)) for arch in ("qwen3", "qwen3_moe")}
    per_rank = run_local(_first_updates, 2, dirs, timeout_s=TIMEOUT_S)
    mask = _rollout_batch(1000)["response_mask"]
    for name in CASES:
        result = per_rank[0][name]
        metrics = result["metrics"]
        other = per_rank[1][name]["metrics"]
        if "EP" in name:
            # EP2 ranks are two data-parallel replicas that each compute their own metrics, and
            # their experts see the tokens in a different order: equal up to float rounding.
            assert metrics.keys() == other.keys() and all(
                metrics[k] == pytest.approx(other[k], rel=1e-6, abs=1e-9) for k in metrics), f"{name}: {metrics} {other}"
        else:  # TP ranks compute the same values; PP ranks receive the last stage's broadcast
            assert metrics == other, f"{name}: ranks report different metrics"
        assert metrics["actor/ppo_kl"] == 0.0, f"{name}: first-step ppo_kl {metrics['actor/ppo_kl']}"
        assert metrics["actor/ratio_mean"] == 1.0, f"{name}: first-step ratio {metrics['actor/ratio_mean']}"
        assert metrics["actor/pg_clipfrac"] == 0.0, name
        assert metrics["actor/grad_norm"] > 0 and metrics["actor/skipped"] == 0.0, f"{name}: {metrics}"
        assert metrics["actor/lr"] == 1e-3 and metrics["actor/entropy"] > 0, f"{name}: {metrics}"
        assert ("actor/kl_loss" in metrics) == (name == "qwen3_moe EP2"), f"{name}: {sorted(metrics)}"
        if "actor/kl_loss" in metrics:
            assert metrics["actor/kl_loss"] > 0, f"{name}: {metrics}"
        logprobs = result["logprobs"]
        assert (logprobs[mask.bool()] < 0).all() and (logprobs[:, 21:] == 0).all(), name
        if name.startswith("qwen3 "):
            assert result["unchanged"] == [], f"{name}: weights not updated: {result['unchanged']}"
        else:  # experts no token was routed to keep their weights
            moved = result["params"] - len(result["unchanged"])
            assert not [n for n in result["unchanged"] if "experts" not in n], f"{name}: {result['unchanged']}"
            assert moved > result["params"] // 2, f"{name}: only {moved} of {result['params']} tensors moved"
    sft = per_rank[0]["qwen3 PP2"]["sft"]
    assert sft == per_rank[1]["qwen3 PP2"]["sft"], "SFT metrics differ between ranks"
    # Response tokens are random: their mean NLL is near ln(vocab) ≈ 6.9 (the update moved little).
    assert 5.0 < sft["sft/loss"] < 9.0 and sft["sft/grad_norm"] > 0 and sft["sft/skipped"] == 0.0, sft
    # Every layout scores the same qwen3 (fp32; reduction orders differ by layout).
    tp2, pp2 = per_rank[0]["qwen3 TP2"]["logprobs"], per_rank[0]["qwen3 PP2"]["logprobs"]
    assert (tp2 - pp2).abs().max() <= 1e-4


GLOBAL_MEAN_CASES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "sft")


def _gradient_norms(rank: int, world_size: int, hf_dir: str) -> dict:
    """Grad norm and loss of one update per aggregation (lr 0: the weights stay) on this rank's DP
    share of one ragged batch: rank 0 holds short answers, rank 1 long ones."""
    from megatron.core import parallel_state as ps

    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import destroy_layout, initialize_layout
    from mrl.megatron.policy import compute_logprobs, data_parallel_rows, update_actor, update_sft
    from mrl.megatron.training import OptimConfig, make_trainable
    from mrl.models.registry import model_spec_from_hf

    layout = ParallelLayout()
    coords = initialize_layout(layout)
    built = build_model(model_spec_from_hf(hf_dir), layout)
    load_hf_weights(built, coords, hf_dir)
    trainable = make_trainable(built, OptimConfig(lr=0.0, clip_grad=0.0))
    whole = _rollout_batch(built.spec.vocab_size)
    whole = {k: v[[2, 4, 1, 3]] for k, v in whole.items()}  # 3 + 6 tokens on DP rank 0, 18 + 14 on rank 1
    batch = data_parallel_rows(whole, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    batch["old_logprobs"] = compute_logprobs(trainable, batch, 1, 1)["logprobs"]
    results = {}
    for case in GLOBAL_MEAN_CASES:
        if case == "sft":
            metrics = update_sft(trainable, batch, 1)
            results[case] = (metrics["sft/grad_norm"], metrics["sft/loss"])
        else:
            metrics = update_actor(trainable, batch, {"aggregation": case}, 1)
            results[case] = (metrics["actor/grad_norm"], metrics["actor/pg_loss"])
    destroy_layout()
    return results


def test_loss_means_are_over_the_global_batch_under_dp2(tiny_model_dir):
    """The same ragged batch on one rank and split over two DP ranks gives the same gradient: the
    token-mean divides by the global token count, the sequence means by the global sequence count."""
    hf_dir = str(tiny_model_dir("qwen3"))
    single = run_local(_gradient_norms, 1, hf_dir, timeout_s=TIMEOUT_S)[0]
    split = run_local(_gradient_norms, 2, hf_dir, timeout_s=TIMEOUT_S)
    for case in GLOBAL_MEAN_CASES:
        (norm1, loss1), (norm2a, loss2a), (norm2b, loss2b) = single[case], split[0][case], split[1][case]
        assert norm2a == pytest.approx(norm1, rel=1e-5) and norm2b == norm2a, f"{case}: DP1 {norm1}, DP2 {norm2a}"
        assert (loss2a + loss2b) / 2 == pytest.approx(loss1, rel=1e-5, abs=1e-7), f"{case}: {loss1} vs {loss2a}, {loss2b}"


# name → (algo, how the engine's log-probs relate to the trainer's: "same" or "drift")
CORRECTION_CASES = {
    "none": ({}, None),
    "tis, engine = trainer": ({"rollout_correction": "tis"}, "same"),
    "decoupled_ppo, engine = trainer": ({"policy_loss": "decoupled_ppo", "behav_imp_weight_cap": 3.0}, "same"),
    "tis, drift": ({"rollout_correction": "tis", "rollout_is_cap": 1.5}, "drift"),
    # a product over up to 18 tokens: the default [0.5, 2] would mask every sequence here
    "mis, drift": ({"rollout_correction": "mis", "rollout_mis_low": 0.25, "rollout_mis_high": 4.0}, "drift"),
    "icepop, drift": ({"rollout_correction": "icepop"}, "drift"),
    "decoupled_ppo, drift": ({"policy_loss": "decoupled_ppo", "behav_imp_weight_cap": 1.5}, "drift"),
}


def _corrected_updates(rank: int, world_size: int, hf_dir: str) -> dict:
    """One update per CORRECTION_CASES entry on this rank's DP share (lr 0: every update starts from
    the same weights); each update's metrics and gradient (the DDP grad buffers, after the DP mean)."""
    from megatron.core import parallel_state as ps

    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import destroy_layout, initialize_layout
    from mrl.megatron.policy import compute_logprobs, data_parallel_rows, update_actor
    from mrl.megatron.training import OptimConfig, make_trainable

    from mrl.models.registry import model_spec_from_hf

    layout = ParallelLayout()
    coords = initialize_layout(layout)
    built = build_model(model_spec_from_hf(hf_dir), layout)
    load_hf_weights(built, coords, hf_dir)
    trainable = make_trainable(built, OptimConfig(lr=0.0, clip_grad=0.0))
    whole = _rollout_batch(built.spec.vocab_size)
    whole = {k: v[[2, 4, 1, 3]] for k, v in whole.items()}
    batch = data_parallel_rows(whole, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    old = compute_logprobs(trainable, batch, 1, 1)["logprobs"]
    # The engine's log-probs off by up to ±1 nat per token: some ratios truncated, some masked.
    noise = (torch.rand(old.shape, generator=torch.Generator().manual_seed(rank)) * 2 - 1) * batch["response_mask"]
    results = {}
    for name, (algo, engine) in CORRECTION_CASES.items():
        inputs = {**batch, "old_logprobs": old}
        if engine is not None:
            inputs["rollout_logprobs"] = old.clone() if engine == "same" else old + noise
        metrics = update_actor(trainable, inputs, {**algo, "kl_coef": 0.0}, 1)
        grads = [getattr(p, "main_grad", p.grad).detach().clone() for c in trainable.ddp_chunks for p in c.parameters()]
        results[name] = {"metrics": metrics, "grads": grads}
    destroy_layout()
    results["inputs"] = {"old_logprobs": old, "rollout_logprobs": old + noise, "response_mask": batch["response_mask"]}
    return results


def test_rollout_correction_updates_under_dp2(tiny_model_dir):
    """With the engine's log-probs equal to the trainer's, TIS and decoupled PPO weigh every token 1:
    the update's gradient is bitwise the uncorrected one. With drift every mode runs, changes the
    gradient, and the first step's PPO ratio stays exactly 1 (the correction weighs, never moves it)."""
    from mrl.megatron.policy import ActorLoss
    from mrl.trainer import correction_metrics

    per_rank = run_local(_corrected_updates, 2, str(tiny_model_dir("qwen3")), timeout_s=TIMEOUT_S)
    # The drift truncates or masks some tokens but not all (the trainer's metrics over both ranks' rows).
    whole = {k: torch.cat([r["inputs"][k] for r in per_rank]) for k in per_rank[0]["inputs"]}
    for name, (algo, engine) in CORRECTION_CASES.items():
        if engine == "drift":
            drift = correction_metrics(whole, ActorLoss.of(algo))
            cut = drift.get("rollout/is_clipfrac", drift.get("rollout/is_masked_frac"))
            assert 0 < cut < 1 and drift["rollout/is_weight_mean"] > 0, f"{name}: {drift}"
    for rank, results in enumerate(per_rank):
        plain = results.pop("inputs") and results["none"]
        for name, result in results.items():
            metrics = result["metrics"]
            assert metrics["actor/ppo_kl"] == 0.0 and metrics["actor/ratio_mean"] == 1.0, f"{name}: {metrics}"
            assert metrics["actor/grad_norm"] > 0, f"{name}: {metrics}"
            same = all(torch.equal(a, b) for a, b in zip(result["grads"], plain["grads"]))
            if CORRECTION_CASES[name][1] == "drift":
                assert not same, f"rank {rank} {name}: the correction did not change the gradient"
            else:
                assert same, f"rank {rank} {name}: the gradient differs from the uncorrected one"
                assert metrics == plain["metrics"], f"rank {rank} {name}: {metrics} vs {plain['metrics']}"
    # DP ranks average their gradients: both ranks hold the same one.
    for name in CORRECTION_CASES:
        assert all(torch.equal(a, b) for a, b in zip(per_rank[0][name]["grads"], per_rank[1][name]["grads"])), name
