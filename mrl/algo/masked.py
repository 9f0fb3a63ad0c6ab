"""Masked reductions over response tokens.

Shapes: B sequences, T response positions; `mask` is [B, T] with 1 on response tokens, 0 on padding.
An empty mask gives 0 (not NaN), so an all-padding micro-batch contributes nothing.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where mask is 1."""
    masked = values * mask
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where mask is 1; 0 where the mask is empty."""
    mask = mask.to(values.dtype)
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def add_on_last_token(values: torch.Tensor, mask: torch.Tensor, per_row: torch.Tensor) -> torch.Tensor:
    """`values` [B, T] with per_row[b] [B] added at row b's last response position (a row without
    one gets nothing): where an outcome score or a sequence-level penalty sits."""
    positions = torch.arange(mask.shape[-1], device=mask.device)
    last = (positions * mask.bool()).amax(-1)
    rows = (mask != 0).any(-1).nonzero().flatten()
    out = values.clone()
    out[rows, last[rows]] += per_row[rows].to(out.dtype)
    return out


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) over the masked entries (biased variance), 0 on padding."""
    mask = mask.to(values.dtype)
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    return (values - mean) * torch.rsqrt(var + eps) * mask
