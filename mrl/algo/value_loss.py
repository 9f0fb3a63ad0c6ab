"""The critic's loss for PPO with GAE: PPO's clipped value regression.

Shapes: B sequences, T response positions; values, old_values, returns, mask are [B, T].
"""

from __future__ import annotations

import torch

from mrl.algo.aggregation import SequenceParts, aggregate, whole_mean


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    aggregation: str = "token-mean",
    parts: SequenceParts | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 · max((V - R)², (clip(V, V_old ± cliprange) - R)²), aggregated over response tokens.

    The clip keeps one update from moving the critic's predictions far from the values the
    advantages were computed with (as PPO's ratio clip does for the policy). Metrics:
    vf_clipfrac, the fraction of tokens where the clipped term is the larger one.
    """
    clipped = old_values + (values - old_values).clamp(-cliprange, cliprange)
    unclipped_error = (values - returns).square()
    clipped_error = (clipped - returns).square()
    per_token = 0.5 * torch.maximum(unclipped_error, clipped_error)
    loss = aggregate(per_token, mask, aggregation, parts)
    return loss, {"vf_clipfrac": whole_mean((clipped_error > unclipped_error).to(values.dtype), mask, parts=parts)}
