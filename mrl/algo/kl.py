"""KL estimators between the policy and a reference policy, per token (Schulman's k1/k2/k3).

Shapes: B sequences, T response positions.
  logp, ref_logp : [B, T] log-probabilities of the sampled tokens under the policy / the reference
  returns        : [B, T] per-token KL estimate (apply the response mask when aggregating)

Use them in the loss (KL_ESTIMATORS + an aggregation) or in the reward (`kl_penalized_rewards`).
"""

from __future__ import annotations

import torch

from mrl.algo.aggregation import SequenceParts, aggregate
from mrl.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")

# exp() of a log-ratio beyond this overflows fp32/bf16 into inf; beyond it the estimate is noise anyway.
_LOG_RATIO_CLAMP = 20.0
# The k3 value is clamped as verl does: one token with a wild ratio must not dominate the batch.
_K3_CLAMP = 10.0


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log p - log p_ref: unbiased, high variance, can be negative per token."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (log p - log p_ref)²: biased, low variance, never negative."""
    return 0.5 * (logp - ref_logp).square()


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 (low_var_kl) = r - log r - 1 with r = p_ref / p: unbiased, low variance, never negative.

    The log-ratio is clamped to ±20 before exp and the result to [-10, 10].
    """
    log_ratio = (ref_logp - logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return (log_ratio.exp() - log_ratio - 1).clamp(-_K3_CLAMP, _K3_CLAMP)


KL_ESTIMATORS.register("low_var_kl")(kl_k3)


def kl_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str = "k3",
    aggregation: str = "token-mean",
    parts: SequenceParts | None = None,
) -> torch.Tensor:
    """The KL-in-the-loss term (multiply by kl_coef): the estimator aggregated over response tokens."""
    return aggregate(KL_ESTIMATORS.get(estimator)(logp, ref_logp), response_mask, aggregation, parts)


def kl_penalized_rewards(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, kl: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Token-level rewards with the KL in the reward: -kl_coef·kl added on every response token.

    token_level_rewards, response_mask, kl: [B, T]; returns [B, T]. Rewards stay where they were
    earned (an episode's per-turn rewards too), outside the mask they are kept as they are.
    """
    return token_level_rewards - kl_coef * kl * response_mask.to(kl.dtype)
