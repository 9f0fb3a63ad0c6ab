"""Batch statistics of advantages, returns and (PPO) the critic's values, under verl's metric names.

Shapes: B sequences, T response positions; every tensor is [B, T] and only response tokens
(response_mask = 1) count. They tell whether a critic is learning: critic/vf_explained_var is
1 - Var(returns - values) / Var(returns) over the batch's tokens, 1 for a critic that predicts
its targets, 0 for one no better than their mean, negative for a worse one.
"""

from __future__ import annotations

import torch

from mrl.algo.masked import masked_mean


def advantage_metrics(batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """critic/{advantages,returns}_{mean,max,min} of a batch with "advantages", "returns" and
    "response_mask"; with "values" (PPO) also critic/values_{mean,max,min} and critic/vf_explained_var.
    The values are those GAE used (before this step's critic update)."""
    mask = batch["response_mask"].bool()
    metrics = {}
    for key in ("advantages", "returns", "values"):
        if key in batch:
            metrics.update(_stats(f"critic/{key}", batch[key][mask]))
    if "values" in batch:
        metrics["critic/vf_explained_var"] = explained_variance(batch["values"], batch["returns"], mask)
    return metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the masked entries; 0 when the returns are
    constant (nothing to explain: a critic that predicts them exactly is then no better than their mean)."""
    mask = mask.to(returns.dtype)
    variance = _masked_var(returns, mask)
    if variance <= 0:
        return 0.0
    return float(1 - _masked_var(returns - values, mask) / variance)


def _masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean((x - masked_mean(x, mask)).square(), mask)


def _stats(name: str, x: torch.Tensor) -> dict[str, float]:
    if x.numel() == 0:
        return {f"{name}_mean": 0.0, f"{name}_max": 0.0, f"{name}_min": 0.0}
    return {f"{name}_mean": float(x.mean()), f"{name}_max": float(x.max()), f"{name}_min": float(x.min())}
