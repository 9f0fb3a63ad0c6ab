"""mrl.algo.rollout_correction and decoupled PPO against values worked out by hand; the corrections
leave the uncorrected loss bitwise alone when engine and trainer agree; what ships to the workers."""

import math

import pytest
import torch

from mrl.algo import (
    ROLLOUT_CORRECTIONS,
    behaviour_weights,
    correction_settings,
    foreign_settings,
    policy_loss,
    rollout_correction,
    uses_rollout_logprobs,
)
from mrl.registry import UnknownNameError

t = torch.tensor
PAD = float("nan")  # a ratio on padding: must never reach a weight or a metric


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual), torch.as_tensor(expected, dtype=torch.float32),
                               atol=atol, rtol=0)


def logprobs_with_ratios(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old_logp, rollout_logp, mask) whose per-token ratio exp(old - rollout) is `ratios` (PAD: padding,
    where the engine's log-prob is 0 and the trainer's is a wild -30, as on prompt columns)."""
    ratio = t(ratios)
    mask = (~ratio.isnan()).float()
    old = -torch.linspace(0.1, 2.0, ratio.numel()).reshape(ratio.shape)
    rollout = torch.where(mask.bool(), old - ratio.nan_to_num(1.0).log(), torch.zeros_like(old))
    old = torch.where(mask.bool(), old, torch.full_like(old, -30.0))
    return old, rollout, mask


def test_tis_truncates_token_weights_at_the_cap():
    old, rollout, mask = logprobs_with_ratios([[0.5, 1.0, 3.0], [2.5, 1.5, PAD]])
    c = rollout_correction("tis", old, rollout, mask, cap=2.0)
    close(c.weights, [[0.5, 1.0, 2.0], [2.0, 1.5, 0.0]])
    m = c.metrics
    close(m["is_weight_mean"], (0.5 + 1 + 2 + 2 + 1.5) / 5)  # 1.4
    close(m["is_clipfrac"], 2 / 5)  # 3.0 and 2.5 were truncated
    close(m["is_ratio_max"], 3.0), close(m["is_ratio_min"], 0.5)
    close(m["is_eff_sample_size"], 1.4**2 / ((0.25 + 1 + 4 + 4 + 2.25) / 5))  # mean² / mean of squares
    assert not c.weights.requires_grad


def test_mis_masks_sequences_by_the_product_of_their_ratios():
    # products: 2·0.75 = 1.5 (kept, weight 1.5), 2·2·1 = 4 (> 2), 0.5·0.5 = 0.25 (< 0.5); row 3 is empty
    old, rollout, mask = logprobs_with_ratios([[2.0, 0.75, PAD], [2.0, 2.0, 1.0], [0.5, 0.5, PAD], [PAD, PAD, PAD]])
    c = rollout_correction("mis", old, rollout, mask, low=0.5, high=2.0)
    close(c.weights, [[1.5, 1.5, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], atol=1e-5)
    m = c.metrics
    close(m["is_weight_mean"], 3.0 / 7, atol=1e-6)  # 7 response tokens, 2 of them weighted 1.5
    close(m["is_masked_frac"], 5 / 7)
    close(m["is_seq_masked_frac"], 2 / 3)  # the empty row is no sequence
    close(m["is_ratio_max"], 4.0, atol=1e-5), close(m["is_ratio_min"], 0.25)


def test_icepop_masks_tokens_outside_the_bounds_and_weights_the_rest_by_their_ratio():
    old, rollout, mask = logprobs_with_ratios([[0.4, 1.0, 6.0], [4.0, 0.6, PAD]])
    c = rollout_correction("icepop", old, rollout, mask, low=0.5, high=5.0)
    close(c.weights, [[0.0, 1.0, 0.0], [4.0, 0.6, 0.0]], atol=1e-5)
    close(c.metrics["is_masked_frac"], 2 / 5)
    close(c.metrics["is_weight_mean"], (1 + 4 + 0.6) / 5, atol=1e-6)
    assert "is_clipfrac" not in c.metrics


def test_behaviour_weights_drop_tokens_above_the_cap():
    old, rollout, mask = logprobs_with_ratios([[0.5, 2.0, 4.0]])
    close(behaviour_weights(old, rollout, mask, cap=3.0).weights, [[0.5, 2.0, 0.0]], atol=1e-6)
    close(behaviour_weights(old, rollout, mask, cap=3.0).metrics["is_masked_frac"], 1 / 3)
    close(behaviour_weights(old, rollout, mask).weights, [[0.5, 2.0, 4.0]], atol=1e-5)


@pytest.mark.parametrize("name", ["tis", "mis", "icepop", "decoupled"])
def test_identical_logprobs_give_weights_exactly_one(name):
    old, _, mask = logprobs_with_ratios([[1.0, 1.0, 1.0], [1.0, PAD, PAD]])
    rollout = old.clone()
    c = behaviour_weights(old, rollout, mask, 3.0) if name == "decoupled" else rollout_correction(name, old, rollout, mask)
    assert torch.equal(c.weights, mask), c.weights
    assert c.metrics["is_weight_mean"] == 1.0 and c.metrics["is_ratio_max"] == 1.0
    assert c.metrics.get("is_masked_frac", 0.0) == 0.0 and c.metrics.get("is_clipfrac", 0.0) == 0.0


def _loss_and_grad(name: str, aggregation: str = "token-mean", **kwargs):
    logp = t([[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]], requires_grad=True)
    old = t([[-1.1, -0.5, -1.9], [-0.3, -1.0, -0.7]])
    advantages = t([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    mask = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, metrics = policy_loss(name, logp, old, advantages, mask, aggregation=aggregation, **kwargs)
    loss.backward()
    return loss, logp.grad, metrics


@pytest.mark.parametrize("name", ["ppo_clip", "dapo", "gspo"])
def test_unit_weights_leave_every_loss_and_gradient_bitwise_unchanged(name):
    aggregation = "seq-mean-token-mean" if name == "gspo" else "token-mean"
    loss, grad, metrics = _loss_and_grad(name, aggregation)
    weighted, weighted_grad, weighted_metrics = _loss_and_grad(name, aggregation, weights=torch.ones(2, 3))
    assert torch.equal(loss, weighted) and torch.equal(grad, weighted_grad)
    assert all(torch.equal(metrics[k], weighted_metrics[k]) for k in metrics)


def test_weights_change_the_numerator_only():
    """At ratio 1 the per-token loss is -A·w. A masked token (w = 0) still counts in the normaliser:
    token-mean divides by all 5 response tokens, seq-mean-token-mean by each row's own token count."""
    logp = t([[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]], requires_grad=True)
    advantages = t([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    mask = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weights = t([[0.5, 0.0, 2.0], [0.0, 1.5, 0.0]])
    loss, _ = policy_loss("ppo_clip", logp, logp.detach(), advantages, mask, weights=weights)
    close(loss, (-0.5 - 0 - 2 + 0 + 3) / 5)  # 0.5 / 5 = 0.1
    loss, _ = policy_loss("ppo_clip", logp, logp.detach(), advantages, mask, weights=weights,
                          aggregation="seq-mean-token-mean")
    close(loss, ((-0.5 - 2) / 3 + 3 / 2) / 2)
    loss.backward()  # d/dlogp_t of -A·w·r / n: the weight is a constant
    close(logp.grad, [[-0.5 / 3 / 2, 0.0, -2 / 3 / 2], [0.0, 3 / 2 / 2, 0.0]])


def test_decoupled_ppo_by_hand():
    """First step (π_θ = π_prox, ratio 1): per-token loss -A·π_prox/π_behav, the token over the cap
    dropped; mean over the 3 response tokens. Gradient -A·w/3 (the weight is a constant)."""
    old, behav, mask = logprobs_with_ratios([[0.5, 2.0, 4.0]])
    logp = old.clone().requires_grad_(True)
    advantages = t([[1.0, -2.0, 1.0]])
    loss, metrics = policy_loss("decoupled_ppo", logp, old, advantages, mask, behav_logp=behav, behav_weight_cap=3.0)
    close(loss, (-0.5 + 4.0 + 0.0) / 3)
    loss.backward()
    close(logp.grad, [[-0.5 / 3, 4.0 / 3, 0.0]], atol=1e-6)
    assert metrics["ppo_kl"] == 0 and metrics["ratio_mean"] == 1 and metrics["pg_clipfrac"] == 0
    # Later in the step the PPO ratio is against π_prox: r = 1.5 on token 0 is clipped to 1.2 (A > 0).
    moved = (old + t([[math.log(1.5), 0.0, 0.0]])).requires_grad_(True)
    loss, metrics = policy_loss("decoupled_ppo", moved, old, advantages, mask, behav_logp=behav, behav_weight_cap=3.0)
    close(loss, (-1.2 * 0.5 + 4.0 + 0.0) / 3, atol=1e-6)
    close(metrics["pg_clipfrac"], 1 / 3)


def test_decoupled_ppo_with_engine_equal_to_trainer_is_ppo_clip_bitwise():
    logp = t([[-1.0, -0.5, -2.0]], requires_grad=True)
    old, advantages, mask = t([[-1.1, -0.4, -1.9]]), t([[1.0, -1.0, 2.0]]), torch.ones(1, 3)
    plain, _ = policy_loss("ppo_clip", logp, old, advantages, mask)
    decoupled, _ = policy_loss("decoupled_ppo", logp, old, advantages, mask, behav_logp=old.clone())
    assert torch.equal(plain, decoupled)


def test_registry_settings_and_what_ships():
    assert ROLLOUT_CORRECTIONS.names() == ["icepop", "mis", "tis"]
    with pytest.raises(UnknownNameError, match="did you mean 'tis'"):
        rollout_correction("tiss", torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1))
    algo = {"rollout_correction": "mis", "rollout_mis_high": 3, "rollout_is_cap": 4.0}
    assert correction_settings("mis", algo) == {"low": 0.5, "high": 3.0}  # null low: the default
    assert correction_settings("tis", {}) == {"cap": 2.0}
    assert foreign_settings("mis", algo) == [("rollout_is_cap", "tis")]
    assert not uses_rollout_logprobs("none", "ppo_clip")
    assert uses_rollout_logprobs("tis", "ppo_clip") and uses_rollout_logprobs("none", "decoupled_ppo")


def test_actor_inputs_carry_the_engine_logprobs_only_when_asked():
    from mrl.experience import actor_inputs

    batch = {k: torch.zeros(2, 3) for k in ("response_mask", "advantages", "old_logprobs", "rollout_logprobs",
                                            "token_level_rewards")}
    batch["tokens"] = torch.zeros(2, 4, dtype=torch.long)
    assert sorted(actor_inputs(batch)) == ["advantages", "old_logprobs", "response_mask", "tokens"]
    assert "rollout_logprobs" in actor_inputs(batch, rollout_logprobs=True)


def test_trainer_correction_metrics_are_over_the_whole_batch():
    from mrl.config.schema import AlgoConfig
    from mrl.trainer import correction_metrics

    old, rollout, mask = logprobs_with_ratios([[0.5, 1.0, 3.0], [2.5, 1.5, PAD]])
    batch = {"old_logprobs": old, "rollout_logprobs": rollout, "response_mask": mask}
    assert correction_metrics(batch, AlgoConfig()) == {}
    metrics = correction_metrics(batch, AlgoConfig(rollout_correction="tis", rollout_is_cap=2.0))
    assert metrics["rollout/is_weight_mean"] == pytest.approx(1.4) and metrics["rollout/is_clipfrac"] == pytest.approx(0.4)
    metrics = correction_metrics(batch, AlgoConfig(policy_loss="decoupled_ppo", behav_imp_weight_cap=2.0))
    assert metrics["rollout/is_masked_frac"] == pytest.approx(2 / 5)  # 3.0 and 2.5 are over the cap


def test_drift_metrics_estimate_the_train_inference_kl():
    from mrl.trainer import drift_metrics

    # ratios p_trainer / p_engine of 0.5, 1.0, 3.0, 2.5, 1.5 on the sampled tokens; padding ignored
    old, rollout, mask = logprobs_with_ratios([[0.5, 1.0, 3.0], [2.5, 1.5, PAD]])
    metrics = drift_metrics({"old_logprobs": old, "rollout_logprobs": rollout, "response_mask": mask})
    k3 = [r - 1 - math.log(r) for r in (0.5, 1.0, 3.0, 2.5, 1.5)]
    assert metrics["rollout/train_kl"] == pytest.approx(sum(k3) / 5)
    assert metrics["rollout/train_logprob_abs_diff_max"] == pytest.approx(math.log(3.0))
    same = drift_metrics({"old_logprobs": rollout, "rollout_logprobs": rollout, "response_mask": mask})
    assert same["rollout/train_kl"] == 0.0 and same["rollout/train_logprob_abs_diff_max"] == 0.0
