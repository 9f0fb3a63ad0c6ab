"""Policy-gradient losses, registered by name in POLICY_LOSSES.

Shapes: B sequences, T response positions.
  logp, old_logp : [B, T] log-probabilities of the sampled tokens under the current policy and the
                   policy that generated them (old_logp is a constant: no gradient flows into it)
  advantages, response_mask : [B, T]; the mask is 1 on response tokens, 0 on padding
  weights        : [B, T] optional constant per-token weights (an off-policy correction, see
                   mrl.algo.rollout_correction) multiplying the per-token loss before aggregation;
                   None leaves the loss exactly as without them
  parts          : sequences split over ranks (context parallelism; mrl.algo.aggregation.SequenceParts),
                   None where this rank holds whole sequences
Each loss returns (scalar loss, metrics): detached 0-d tensors, named at _clipped_objective. On the
first step (logp == old_logp) the ratio is exactly 1, ppo_kl exactly 0 and pg_clipfrac 0.
"""

from __future__ import annotations

import torch

from mrl.algo.aggregation import SequenceParts, aggregate, sequence_sum, sequence_tokens, whole_max, whole_mean
from mrl.algo.rollout_correction import behaviour_weights
from mrl.registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss")

# exp() of a log-ratio past this overflows; a ratio of e^20 is clipped anyway.
_LOG_RATIO_CLAMP = 20.0
# GSPO's sequence log-ratio is clamped tighter, as its ratio multiplies every token of the sequence.
_SEQ_LOG_RATIO_MAX = 10.0


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
    aggregation: str = "token-mean",
    weights: torch.Tensor | None = None,
    parts: SequenceParts | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip: max(-A·r, -A·clip(r, 1-clip_low, 1+clip_high)) per token, then aggregated.

    clip_ratio_c (> 1) adds dual clip: for negative advantages the loss is capped at -A·c, so a huge
    ratio on a bad token cannot blow up the update.
    """
    log_ratio = (logp - old_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    return _clipped_objective(
        ratio, log_ratio, advantages, response_mask, clip_low, clip_high, clip_ratio_c, aggregation, weights, parts
    )


@POLICY_LOSSES.register("dapo")
def dapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_ratio_c: float | None = None,
    aggregation: str = "token-mean",
    weights: torch.Tensor | None = None,
    parts: SequenceParts | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DAPO: PPO-clip with clip-higher (clip_high > clip_low lets unlikely tokens grow, keeping
    entropy up) and token-level aggregation (every token weighs the same however long its answer).
    """
    if aggregation != "token-mean":
        raise ValueError(f"DAPO aggregates per token: aggregation must be 'token-mean', got {aggregation!r}.")
    return ppo_clip_loss(
        logp, old_logp, advantages, response_mask,
        clip_low=clip_low, clip_high=clip_high, clip_ratio_c=clip_ratio_c, aggregation=aggregation, weights=weights,
        parts=parts,
    )


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    clip_ratio_c: float | None = None,
    aggregation: str = "seq-mean-token-mean",
    weights: torch.Tensor | None = None,
    parts: SequenceParts | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: a sequence-level importance ratio s = exp(mean_t(logp - old_logp)), the geometric mean
    of the token ratios, clipped per sequence (hence the small default clip range).

    Every token of a sequence carries the value s; its gradient is s·∇logp_t / |y| summed over the
    sequence, written as s.detach() · exp(logp_t - logp_t.detach()). With split sequences (`parts`)
    s is the whole sequence's: its log-ratio sum is added up over the ranks that hold its parts.
    """
    mask = response_mask.to(logp.dtype)
    seq_log_ratio = sequence_sum(logp - old_logp, mask, parts) / sequence_tokens(mask, parts).clamp(min=1)
    token_log_ratio = logp - logp.detach() + seq_log_ratio.unsqueeze(-1)
    token_log_ratio = token_log_ratio.clamp(max=_SEQ_LOG_RATIO_MAX)
    ratio = torch.exp(token_log_ratio)
    return _clipped_objective(
        ratio, logp - old_logp, advantages, response_mask, clip_low, clip_high, clip_ratio_c, aggregation, weights,
        parts,
    )


@POLICY_LOSSES.register("decoupled_ppo")
def decoupled_ppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    behav_logp: torch.Tensor,
    behav_weight_cap: float | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
    aggregation: str = "token-mean",
    parts: SequenceParts | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AReaL's decoupled PPO for asynchronous RL: three policies. The engine's behaviour policy
    (behav_logp, which sampled the tokens), the proximal policy (old_logp, the trainer's recomputed
    log-probs) and π_θ. The PPO ratio r = π_θ/π_prox is clipped as in ppo_clip, and each token's
    clipped objective is multiplied by the constant importance weight π_prox/π_behav, which corrects
    for the tokens having been sampled by the behaviour policy. With behav_weight_cap, tokens whose
    weight exceeds it are dropped (weight 0; see rollout_correction.behaviour_weights).
    """
    weights = behaviour_weights(old_logp.detach(), behav_logp.detach(), response_mask, behav_weight_cap).weights
    return ppo_clip_loss(
        logp, old_logp, advantages, response_mask,
        clip_low=clip_low, clip_high=clip_high, clip_ratio_c=clip_ratio_c, aggregation=aggregation, weights=weights,
        parts=parts,
    )


# Losses that read the engine's log-probs (the behaviour policy) as behav_logp.
BEHAVIOUR_LOSSES = frozenset({"decoupled_ppo"})


def _clipped_objective(
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None,
    aggregation: str,
    weights: torch.Tensor | None = None,
    parts: SequenceParts | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {  # over the response tokens of whole sequences (split ones too)
        "ppo_kl": whole_mean(-log_ratio, mask, parts=parts),  # mean of old_logp - logp
        # the fraction of response tokens whose clipped objective was the one used
        "pg_clipfrac": whole_mean((clipped > unclipped).to(ratio.dtype), mask, parts=parts),
        "ratio_mean": whole_mean(ratio, mask, parts=parts),  # importance ratio statistics
        "ratio_max": whole_max(ratio, mask, parts),
    }
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 for dual clip, got {clip_ratio_c}.")
        capped = torch.minimum(loss, -advantages * clip_ratio_c)
        lower_clipped = (advantages < 0) & (capped < loss)
        metrics["pg_clipfrac_lower"] = whole_mean(lower_clipped.to(ratio.dtype), mask, parts=parts)
        loss = torch.where(advantages < 0, capped, loss)
    if weights is not None:  # after dual clip, as verl applies its IS weights
        loss = loss * weights.detach()
    return aggregate(loss, mask, aggregation, parts), metrics


# The aggregation each loss is defined with, where it is not token-mean (GSPO's paper averages the
# sequence-level objective over sequences): what algo.aggregation means when left unset.
_OWN_AGGREGATION = {"gspo": "seq-mean-token-mean"}


def default_aggregation(loss_name: str) -> str:
    """The aggregation policy loss `loss_name` was defined with."""
    return _OWN_AGGREGATION.get(loss_name, "token-mean")


def policy_loss(name: str, *args: torch.Tensor, **kwargs: float | str | None) -> tuple[torch.Tensor, dict]:
    """Run the policy loss called `name` (the module docstring gives the arguments' shapes)."""
    return POLICY_LOSSES.get(name)(*args, **kwargs)
