"""The parity gate's routing check: the engine's expert choices on the probe against the trainer's.

The sync (mrl/sync/driver.py) calls it with each engine it gates; it lives here, beside the
engines and the actor it drives, because it builds a trainer batch (mrl.experience) from the
engine's samples, which the sync package does not know.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

from mrl.routes import RouteShape


@dataclass(frozen=True)
class RouteProbe:
    """What the gate's routing check needs: the probe sequences as batch rows (repeated to a
    multiple of the actor's data-parallel size: every rank takes an equal share) and the model's
    route shape (mrl.routes)."""

    rows: list[list[int]]
    shape: RouteShape

    @classmethod
    def of(cls, probe: list[list[int]], data_parallel: int, shape: RouteShape) -> "RouteProbe":
        return cls(probe * (math.lcm(len(probe), data_parallel) // len(probe)), shape)


def routing_check(cfg: Any, hf_dir: str, probe: list[list[int]], actor: Any) -> Callable[[Any], dict] | None:
    """The gate's check of one engine (WeightSync.route_check): an MoE model whose engines return
    routes (rollout.return_routes, or R3); None otherwise."""
    from mrl.config.derived import data_parallel_size, returns_routes
    from mrl.models.registry import model_spec_from_hf

    shape = model_spec_from_hf(hf_dir).route_shape
    if shape is None or not returns_routes(cfg):
        return None
    return functools.partial(probe_routing, actor=actor, probe=RouteProbe.of(probe, data_parallel_size(cfg), shape))


def probe_routing(engine: Any, actor: Any, probe: RouteProbe) -> dict[str, float]:
    """`rollout/probe_routing_agreement`, `_min_layer`, `rollout/probe_routing_tokens_any_diff`: the
    engine forwards every probe sequence (one greedy token, its routes captured) and the trainer's
    log-prob pass counts how often its own top-k equals the engine's at each position. The weights
    are the same on both sides, so a low value is precision or a router tensor the sync left stale
    (e.g. DeepSeek-V3's expert bias); the log-prob gap alone would hide a few flipped choices."""
    from mrl.experience import rollout_batch
    from mrl.rollout.engine import SamplingSettings

    groups = engine.generate(probe.rows, SamplingSettings(max_tokens=1))
    batch = rollout_batch(groups, [0.0] * len(probe.rows), probe.shape)
    routing = actor.logprobs(batch).routing
    return {key.replace("rollout/routing", "rollout/probe_routing"): value for key, value in routing.items()}
