"""MoE routes: the contract between the engine that records them and the trainer that replays them.

A sample's routes are an array [T, L, K] of logical expert ids: T = the tokens the engine forwarded
(len(prompt_ids) + len(response_ids) - 1; the last generated token is never forwarded), L = the
model's MoE layers in layer order (dense layers such as DeepSeek-V3's first_k_dense_replace are not
counted), K = top-k. Ids are compared as sets per (token, layer) row. The array travels in the sample
dict under ROUTES_KEY, in the smallest integer type that holds the ids (`route_dtype`).
Routes are checked before use (`check_routes`), never trusted; `agreement` measures how often the
trainer's own top-k equals them. Pure numpy and torch. Replay itself: docs/routing-replay.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

ROUTES_KEY = "routed_experts"
METRIC_PREFIX = "rollout/"


def route_dtype(n_experts: int) -> np.dtype:
    """The smallest integer type that holds expert ids in [0, n_experts): uint8 up to 256 experts."""
    if n_experts <= 0:
        raise ValueError(f"n_experts must be positive, got {n_experts}")
    if n_experts <= 256:
        return np.dtype(np.uint8)
    if n_experts <= np.iinfo(np.int16).max + 1:
        return np.dtype(np.int16)
    raise ValueError(f"{n_experts} experts do not fit the route contract's int16 ids (at most 32768)")


@dataclass(frozen=True)
class RouteShape:
    """A model's routes per token: `layers` MoE layers × `top_k` ids in [0, n_experts)."""

    layers: int
    top_k: int
    n_experts: int

    def check(self, routes: Any, tokens: int, sample: Any) -> np.ndarray:
        """check_routes against this shape."""
        return check_routes(routes, tokens=tokens, layers=self.layers, top_k=self.top_k,
                            n_experts=self.n_experts, sample=sample)

    @property
    def torch_dtype(self) -> torch.dtype:
        """route_dtype as a torch dtype (uint8 or int16)."""
        return torch.from_numpy(np.zeros(0, route_dtype(self.n_experts))).dtype


def _as_numpy(routes: Any) -> np.ndarray:
    if isinstance(routes, torch.Tensor):
        return routes.detach().cpu().numpy()
    return np.asarray(routes)


def check_routes(routes: Any, *, tokens: int, layers: int, top_k: int, n_experts: int,
                 sample: Any) -> np.ndarray:
    """Return `routes` as a numpy array [tokens, layers, top_k] after checking it, or raise a ValueError
    naming the sample and, for bad ids, the MoE layer and token of the first problem (token-major).

    Refused: a missing route, a wrong shape, non-integer ids, ids outside [0, n_experts), an id
    repeated within a row (which also catches the all-zero rows of routes never captured).
    """
    where = f"sample {sample}"
    if routes is None:
        raise ValueError(f"{where}: no routes ({ROUTES_KEY!r} missing); the engine must record them "
                         f"for router replay R3 (or set algo.router_replay to none or R2)")
    array = _as_numpy(routes)
    expected = (tokens, layers, top_k)
    if array.shape != expected:
        raise ValueError(f"{where}: routes have shape {tuple(array.shape)}, expected {expected} "
                         f"(tokens = prompt + response - 1, MoE layers, top-k)")
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{where}: routes have dtype {array.dtype}, expected integer expert ids "
                         f"({route_dtype(n_experts)})")
    wide = array.astype(np.int64)
    out_of_range = ((wide < 0) | (wide >= n_experts)).any(axis=-1)  # [T, L]
    ordered = np.sort(wide, axis=-1)
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(axis=-1)  # [T, L]
    bad = out_of_range | repeated
    if bad.any():
        token, layer = (int(i) for i in np.argwhere(bad)[0])
        row = wide[token, layer].tolist()
        if out_of_range[token, layer]:
            problem = f"expert ids {row} outside [0, {n_experts})"
        else:
            problem = f"expert ids {row} repeat an id (an all-zero row means routes were not captured)"
        raise ValueError(f"{where}, MoE layer {layer}, token {token}: {problem}; "
                         f"record logical expert ids, top-{top_k} distinct per token and layer")
    return array


def same_sets(trainer_ids: torch.Tensor, given_ids: torch.Tensor) -> torch.Tensor:
    """[..., K] × [..., K] → [...] bool: whether each row's top-k SETS are equal (order ignored)."""
    return (trainer_ids.long().sort(dim=-1).values == given_ids.long().sort(dim=-1).values).all(dim=-1)


def agreement_counts(trainer_ids: Any, given_ids: Any, mask: Any) -> torch.Tensor:
    """Sums that `agreement_from_counts` turns into the metrics, additive across micro-batches and ranks.

    trainer_ids, given_ids: [..., L, K] (any leading token dims); mask: [...] bool, the tokens counted.
    Returns float64 [L + 2]: per MoE layer the masked tokens whose sets agree, then the masked tokens,
    then the masked tokens that differ in at least one layer.
    """
    trainer_ids, given_ids = torch.as_tensor(trainer_ids), torch.as_tensor(given_ids)
    mask = torch.as_tensor(mask, dtype=torch.bool)
    if trainer_ids.shape != given_ids.shape or trainer_ids.shape[:-2] != mask.shape:
        raise ValueError(f"agreement needs ids of one shape [..., L, K] and a mask of their token dims; "
                         f"got {tuple(trainer_ids.shape)}, {tuple(given_ids.shape)} and {tuple(mask.shape)}")
    equal = same_sets(trainer_ids, given_ids)[mask]  # [N, L]
    per_layer = equal.sum(dim=0, dtype=torch.float64)
    tokens = torch.tensor([float(equal.shape[0])], dtype=torch.float64)
    any_diff = (~equal.all(dim=-1)).sum(dtype=torch.float64).reshape(1)
    return torch.cat([per_layer, tokens, any_diff])


def agreement_from_counts(counts: torch.Tensor) -> dict[str, float]:
    """The routing metrics from `agreement_counts` sums; empty when no token was counted."""
    per_layer, tokens, any_diff = counts[:-2], float(counts[-2]), float(counts[-1])
    if tokens == 0 or per_layer.numel() == 0:
        return {}
    return {
        f"{METRIC_PREFIX}routing_agreement": float(per_layer.sum()) / (tokens * per_layer.numel()),
        f"{METRIC_PREFIX}routing_agreement_min_layer": float(per_layer.min()) / tokens,
        f"{METRIC_PREFIX}routing_tokens_any_diff": any_diff / tokens,
    }


def agreement(trainer_ids: Any, given_ids: Any, mask: Any) -> dict[str, float]:
    """rollout/routing_agreement: the fraction of masked token-layer decisions whose top-k sets are
    equal; rollout/routing_agreement_min_layer: that fraction in the worst MoE layer;
    rollout/routing_tokens_any_diff: the fraction of masked tokens differing in at least one layer.
    Shapes as in `agreement_counts`."""
    return agreement_from_counts(agreement_counts(trainer_ids, given_ids, mask))

