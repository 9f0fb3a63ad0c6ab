"""Reducing a per-token loss to a scalar.

Shapes: loss, mask [B, T] (B sequences, T response positions) → scalar.

- token-mean:          every response token weighs the same (DAPO; long answers weigh more).
- seq-mean-token-sum:  sum over a sequence's tokens, then mean over sequences (Dr. GRPO style with a
                       constant normaliser left to the caller's learning rate).
- seq-mean-token-mean: mean over a sequence's tokens, then mean over sequences (original GRPO).
Sequences with no response token are left out of the sequence means, so padding rows cannot dilute
the loss; with no response token at all the result is a zero that still carries a graph.
"""

from __future__ import annotations

import torch

from mrl.algo.masked import masked_mean, masked_sum
from mrl.registry import Registry

AGGREGATIONS: Registry = Registry("loss aggregation")


@AGGREGATIONS.register("token-mean")
def token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over all response tokens of the batch."""
    return masked_mean(loss, mask)


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence token sum, averaged over the sequences that have response tokens."""
    return masked_mean(masked_sum(loss, mask, dim=-1), _nonempty(mask, loss.dtype))


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence token mean, averaged over the sequences that have response tokens."""
    return masked_mean(masked_mean(loss, mask, dim=-1), _nonempty(mask, loss.dtype))


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce a [B, T] loss to a scalar with the aggregation called `mode`."""
    return AGGREGATIONS.get(mode)(loss, mask)


def _nonempty(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (mask.sum(-1) > 0).to(dtype)
