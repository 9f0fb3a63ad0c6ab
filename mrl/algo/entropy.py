"""Entropy bonus: a loss term that rewards keeping the policy's per-token entropy up.

Shapes: entropy, mask [B, T] (B sequences, T response positions).
"""

from __future__ import annotations

import torch

from mrl.algo.aggregation import SequenceParts, aggregate, whole_mean


def entropy_bonus(
    entropy: torch.Tensor, mask: torch.Tensor, coef: float, aggregation: str = "token-mean",
    parts: SequenceParts | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (loss term to add, aggregated entropy): the term is -coef · aggregate(entropy); the
    entropy is the whole sequences' (mrl.algo.aggregation.whole_mean)."""
    return -coef * aggregate(entropy, mask, aggregation, parts), whole_mean(entropy, mask, aggregation, parts)
