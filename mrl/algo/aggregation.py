"""Reducing a per-token loss to a scalar, and per-sequence sums when sequences are split over ranks.

Shapes: loss, mask [B, T] (B sequences, T response positions) → scalar. The aggregations
(AGGREGATIONS; each function below says how it weighs tokens): token-mean (DAPO), seq-mean-token-sum
(Dr. GRPO style) and seq-mean-token-mean (original GRPO). Sequences with no response token are left
out of the sequence means, so padding rows cannot dilute the loss; with no response token at all
the result is a zero that still carries a graph.

Split sequences (context parallelism): each rank holds part of every sequence (a SequenceParts). A
sequence mean divides this rank's part of a sequence's sum by the whole sequence's tokens, so the
ranks' results are shares that add up to the whole batch's value (Megatron's DDP adds their
gradients); token-mean stays this rank's own mean, weighed by its share of the micro-batch's tokens
(mrl.megatron.context_parallel.split_micro_batch). A metric (`whole_mean`, `whole_max`,
`whole_min`) is the whole sequences' value on every rank: its sums and extremes go over the CP group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mrl.algo.masked import masked_mean, masked_sum
from mrl.registry import Registry

AGGREGATIONS: Registry = Registry("loss aggregation")


@dataclass(frozen=True)
class SequenceParts:
    """This rank's part of each of B sequences (None where a rank holds whole sequences).

    tokens  [B] each whole sequence's response tokens (counted before the split)
    reduce  (a per-sequence partial result [B], "sum" or "max") → the whole sequence's, over the
            ranks that hold its parts (a constant: no gradient crosses ranks)
    """

    tokens: torch.Tensor
    reduce: Callable[[torch.Tensor, str], torch.Tensor]

    def total(self, partial: torch.Tensor) -> torch.Tensor:
        return self.reduce(partial, "sum")


def sequence_tokens(mask: torch.Tensor, parts: SequenceParts | None = None) -> torch.Tensor:
    """[B] each whole sequence's response tokens, in the mask's dtype."""
    mask = mask.to(torch.float32) if not mask.is_floating_point() else mask
    return mask.sum(-1) if parts is None else parts.tokens.to(mask.dtype)


def sequence_sum(values: torch.Tensor, mask: torch.Tensor, parts: SequenceParts | None = None) -> torch.Tensor:
    """[B] each whole sequence's sum of `values` over its response tokens, as a constant (an
    importance ratio's log: GSPO, MIS)."""
    here = masked_sum(values.detach(), mask, dim=-1)
    return here if parts is None else parts.total(here)


@AGGREGATIONS.register("token-mean")
def token_mean(loss: torch.Tensor, mask: torch.Tensor, parts: SequenceParts | None = None) -> torch.Tensor:
    """Mean over all response tokens here: every response token weighs the same (DAPO; long answers
    weigh more). Split sequences: weighed by the caller (the module docstring)."""
    return masked_mean(loss, mask)


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, parts: SequenceParts | None = None) -> torch.Tensor:
    """Per-sequence token sum, averaged over the sequences that have response tokens (Dr. GRPO style,
    with a constant normaliser left to the caller's learning rate)."""
    return masked_mean(masked_sum(loss, mask, dim=-1), _nonempty(mask, loss.dtype, parts))


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, parts: SequenceParts | None = None) -> torch.Tensor:
    """Per-sequence token mean, averaged over the sequences that have response tokens (original GRPO)."""
    mask = mask.to(loss.dtype)
    per_sequence = masked_sum(loss, mask, dim=-1) / sequence_tokens(mask, parts).clamp(min=1)
    return masked_mean(per_sequence, _nonempty(mask, loss.dtype, parts))


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, parts: SequenceParts | None = None) -> torch.Tensor:
    """Reduce a [B, T] loss to a scalar with the aggregation called `mode` (`parts`: split sequences)."""
    return AGGREGATIONS.get(mode)(loss, mask, parts)


def whole_mean(values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
               parts: SequenceParts | None = None) -> torch.Tensor:
    """A metric: `values` aggregated like `mode` over whole sequences, detached. With split
    sequences every rank gets the same value, the whole sequences' (its sums are added up over the
    ranks: a first step's ratio mean is then exactly 1 there too); without, aggregate's."""
    values = values.detach()
    if parts is None:
        return aggregate(values, mask, mode)
    mask = mask.to(values.dtype)
    sums, tokens = parts.total(masked_sum(values, mask, dim=-1)), sequence_tokens(mask, parts)
    if mode == "token-mean":
        return sums.sum() / tokens.sum().clamp(min=1)
    per_sequence = sums if mode == "seq-mean-token-sum" else sums / tokens.clamp(min=1)
    return masked_mean(per_sequence, (tokens > 0).to(values.dtype))


def whole_max(values: torch.Tensor, mask: torch.Tensor, parts: SequenceParts | None = None,
              empty: float = 0.0) -> torch.Tensor:
    """A metric: the largest of `values` [B, T] over the response tokens of whole sequences (split
    ones: over the ranks), detached; `empty` where there is no response token."""
    here = values.detach().masked_fill(~mask.bool(), float("-inf")).amax(-1) if values.numel() else values.new_empty(0)
    per_sequence = here if parts is None else parts.reduce(here, "max")
    largest = per_sequence.max() if per_sequence.numel() else values.new_tensor(float("-inf"))
    return values.new_tensor(empty) if torch.isneginf(largest) else largest


def whole_min(values: torch.Tensor, mask: torch.Tensor, parts: SequenceParts | None = None,
              empty: float = 0.0) -> torch.Tensor:
    """A metric: the smallest of `values` over the response tokens of whole sequences (whole_max's twin)."""
    return -whole_max(-values, mask, parts, -empty)


def _nonempty(mask: torch.Tensor, dtype: torch.dtype, parts: SequenceParts | None) -> torch.Tensor:
    return (sequence_tokens(mask, parts) > 0).to(dtype)
