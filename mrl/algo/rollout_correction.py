"""Off-policy correction between the engine that sampled a batch and the trainer that learns from it.

The engine (vLLM) samples each response token with log-prob rollout_logp (the behaviour policy μ);
the trainer recomputes it as old_logp (π_old, the proximal policy PPO's ratio π_θ/π_old is taken
against). They differ (kernels, precision, MoE routing; a stale weight version in async modes), and
PPO's ratio does not see that gap. Each mode (ROLLOUT_CORRECTIONS: tis, mis, icepop; and
behaviour_weights for decoupled PPO) turns the per-token ratio ρ_t = π_old / μ = exp(old_logp -
rollout_logp) into a constant weight (no gradient flows into it) on the per-token policy-gradient
loss. A weight changes the numerator only: a masked token still counts in the loss's normaliser.
With identical log-probs every weight is exactly 1, so the loss and its gradient are bitwise the
uncorrected ones.

Shapes (B sequences, T response positions): old_logp, rollout_logp, response_mask [B, T] → a
Correction. Each mode's formula, why the normaliser stays, and the metrics: docs/algorithms.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from mrl.algo.aggregation import SequenceParts, sequence_sum, sequence_tokens, whole_max, whole_mean, whole_min
from mrl.algo.masked import masked_mean
from mrl.registry import Registry

ROLLOUT_CORRECTIONS: Registry = Registry("rollout correction")

# exp() of a log-ratio past this overflows fp32; such a token is truncated or masked anyway.
_LOG_RATIO_CLAMP = 20.0

# Defaults: verl's rollout_is_threshold (2.0) for the TIS cap and [1/2, 2] for its rejection bounds;
# IcePop's [0.5, 5] (Ring-1T).
TIS_CAP = 2.0
MIS_BOUNDS = (0.5, 2.0)
ICEPOP_BOUNDS = (0.5, 5.0)

# Each mode's AlgoConfig fields → (its keyword here, the default when the field is null).
SETTINGS: dict[str, dict[str, tuple[str, float]]] = {
    "tis": {"rollout_is_cap": ("cap", TIS_CAP)},
    "mis": {"rollout_mis_low": ("low", MIS_BOUNDS[0]), "rollout_mis_high": ("high", MIS_BOUNDS[1])},
    "icepop": {"rollout_icepop_low": ("low", ICEPOP_BOUNDS[0]), "rollout_icepop_high": ("high", ICEPOP_BOUNDS[1])},
}


@dataclass(frozen=True)
class Correction:
    """Per-token loss weights [B, T] (detached; 0 on padding and masked tokens) and 0-d metrics."""

    weights: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


@ROLLOUT_CORRECTIONS.register("tis")
def truncated_is(old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor, *,
                 cap: float = TIS_CAP, parts: SequenceParts | None = None) -> Correction:
    """TIS: w_t = min(ρ_t, cap). A token the engine under-sampled relative to the trainer (ρ_t > 1)
    weighs more, at most `cap`; one it over-sampled weighs less."""
    mask = response_mask.to(old_logp.dtype)
    ratio = _token_ratio(old_logp, rollout_logp)
    weights = ratio.clamp(max=cap) * mask
    metrics = _metrics(weights, mask, ratio, parts)
    metrics["is_clipfrac"] = whole_mean((ratio > cap).to(mask.dtype), mask, parts=parts)
    return Correction(weights, metrics)


@ROLLOUT_CORRECTIONS.register("mis")
def masked_sequence_is(old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor, *,
                       low: float = MIS_BOUNDS[0], high: float = MIS_BOUNDS[1],
                       parts: SequenceParts | None = None) -> Correction:
    """Sequence-level MIS: a sequence whose ratio ρ_seq = Π_t ρ_t lies outside [low, high] is masked
    out (weight 0 on all its tokens); the others are weighted by ρ_seq. Compared in log space, so a
    long sequence's product cannot overflow. With split sequences (`parts`) ρ_seq is the whole
    sequence's."""
    mask = response_mask.to(old_logp.dtype)
    log_seq = sequence_sum(old_logp - rollout_logp, mask, parts)  # [B]
    keep = _within(log_seq, low, high)
    seq_ratio = torch.exp(log_seq.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    weights = (seq_ratio * keep).unsqueeze(-1) * mask
    nonempty = (sequence_tokens(mask, parts) > 0).to(mask.dtype)  # whole sequences'
    metrics = _metrics(weights, mask, seq_ratio.unsqueeze(-1), parts, nonempty.unsqueeze(-1))
    metrics["is_masked_frac"] = whole_mean((~keep).to(mask.dtype).unsqueeze(-1).expand_as(mask), mask, parts=parts)
    metrics["is_seq_masked_frac"] = masked_mean((~keep).to(mask.dtype), nonempty)  # of sequences with a response
    return Correction(weights, metrics)


@ROLLOUT_CORRECTIONS.register("icepop")
def icepop(old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor, *,
           low: float = ICEPOP_BOUNDS[0], high: float = ICEPOP_BOUNDS[1],
           parts: SequenceParts | None = None) -> Correction:
    """IcePop: w_t = ρ_t where low ≤ ρ_t ≤ high, else 0 (the token is dropped from the gradient)."""
    mask = response_mask.to(old_logp.dtype)
    log_ratio = old_logp - rollout_logp
    keep = _within(log_ratio, low, high)
    ratio = _token_ratio(old_logp, rollout_logp)
    weights = ratio * keep * mask
    metrics = _metrics(weights, mask, ratio, parts)
    metrics["is_masked_frac"] = whole_mean((~keep).to(mask.dtype), mask, parts=parts)
    return Correction(weights, metrics)


def behaviour_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor, response_mask: torch.Tensor,
                      cap: float | None = None) -> Correction:
    """The decoupled PPO objective's behaviour weights (AReaL): w_t = π_prox/π_behav, and with a cap,
    0 where that exceeds it (the token is dropped, not truncated). π_prox is the trainer's old_logp,
    π_behav the engine's rollout_logp."""
    mask = response_mask.to(prox_logp.dtype)
    ratio = _token_ratio(prox_logp, behav_logp)
    keep = torch.ones_like(mask, dtype=torch.bool) if cap is None else (prox_logp - behav_logp) <= math.log(cap)
    weights = ratio * keep * mask
    metrics = _metrics(weights, mask, ratio)
    metrics["is_masked_frac"] = masked_mean((~keep).to(mask.dtype), mask)
    return Correction(weights, metrics)


def rollout_correction(name: str, old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                       response_mask: torch.Tensor, parts: SequenceParts | None = None, **settings: float) -> Correction:
    """Run the correction called `name` on old_logp, rollout_logp, response_mask [B, T] (`parts`:
    split sequences, see mrl.algo.aggregation)."""
    return ROLLOUT_CORRECTIONS.get(name)(old_logp.detach(), rollout_logp.detach(), response_mask, parts=parts,
                                         **settings)


def correction_settings(name: str, algo: Any) -> dict[str, float]:
    """The keywords of correction `name` from an AlgoConfig-like object or dict (null: the default)."""
    read = algo.get if isinstance(algo, dict) else lambda key, default=None: getattr(algo, key, default)
    return {keyword: default if read(key, None) is None else float(read(key, None))
            for key, (keyword, default) in SETTINGS.get(name, {}).items()}


def foreign_settings(name: str, algo: Any) -> list[tuple[str, str]]:
    """(field, its mode) of every correction setting that is set but belongs to a mode other than `name`."""
    read = algo.get if isinstance(algo, dict) else lambda key, default=None: getattr(algo, key, default)
    return [(key, mode) for mode, keys in SETTINGS.items() if mode != name for key in keys
            if read(key, None) is not None]


def uses_rollout_logprobs(correction: str, policy_loss: str) -> bool:
    """Whether the update needs the engine's log-probs: a correction is on, or the loss is decoupled PPO."""
    return correction != "none" or policy_loss == "decoupled_ppo"


def _token_ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor) -> torch.Tensor:
    return torch.exp((old_logp - rollout_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))


def _within(log_ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """low ≤ exp(log_ratio) ≤ high, compared in log space (low = 0 admits every ratio from below)."""
    above_low = log_ratio >= math.log(low) if low > 0 else torch.ones_like(log_ratio, dtype=torch.bool)
    return above_low & (log_ratio <= math.log(high))


def _metrics(weights: torch.Tensor, mask: torch.Tensor, ratio: torch.Tensor, parts: SequenceParts | None = None,
             ratio_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """is_weight_mean, is_ratio_min/max (over `ratio_mask`, default the token mask), is_eff_sample_size:
    the whole sequences' (split ones: over the ranks, mrl.algo.aggregation). The trainer logs every
    metric as rollout/<name> over the whole batch; their meanings: docs/algorithms.md, "Metrics".

    is_weight_mean      mean weight over response tokens (masked tokens count as 0)
    is_ratio_min, _max  the raw ratio (ρ_t; ρ_seq over sequences for mis) before truncation or masking
    is_eff_sample_size  mean(w)² / mean(w²) over response tokens: 1 for equal weights (verl's ESS)
    (is_clipfrac, is_masked_frac, is_seq_masked_frac: set by the mode that has them.)"""
    ratio_mask = mask if ratio_mask is None else ratio_mask
    mean, mean_square = (whole_mean(w, mask, parts=parts) for w in (weights, weights.square()))
    return {
        "is_weight_mean": mean,
        "is_ratio_min": whole_min(ratio, ratio_mask, parts, empty=1.0),
        "is_ratio_max": whole_max(ratio, ratio_mask, parts, empty=1.0),
        "is_eff_sample_size": mean.square() / mean_square if mean_square > 0 else mean_square,
    }
