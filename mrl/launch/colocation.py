"""Colocated placement on GPUs: trainer ranks and engines sharing each GPU. The run reserves one
placement-group bundle per GPU (a whole GPU, so Ray puts one bundle on each: ranks never pair up on
a GPU while others idle); every rank (actor, critic) takes its share of its own bundle's GPU, and
each engine (or each node's part of one spanning nodes) runs in the bundle of its first GPU with a
share of it, its workers seeing every GPU of its part: engine e's part k holds the GPUs of the ranks
e·tp + k·tp/nodes onwards, tp/nodes of them on one node. Ray narrows an actor to the GPU its share
is of; the engine sets CUDA_VISIBLE_DEVICES itself (Ray's RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES).
docs/scale.md#colocated-gpus."""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mrl.launch.placement import RankPlacement
from mrl.rank_map import PlacementError


@dataclass(frozen=True)
class EngineSlot:
    """Where one node's part of a colocated engine runs: beside its first rank, in that rank's bundle
    of the run's placement group, and the GPUs (CUDA_VISIBLE_DEVICES) its workers see, that rank's first."""

    rank: int
    devices: str

    def strategy(self, placement: RankPlacement) -> PlacementGroupSchedulingStrategy:
        return placement.strategy(self.rank)

    def env(self) -> dict[str, str]:
        """The part's environment: its GPUs, which Ray must leave as they are."""
        return {"CUDA_VISIBLE_DEVICES": self.devices, "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def rank_gpus(placement: RankPlacement, timeout_s: float) -> list[str]:
    """The GPU id Ray gave each rank's bundle (by rank), asked of a sliver of each."""

    def gpu() -> str:
        return ",".join(str(g) for g in ray.get_gpu_ids())

    probe = ray.remote(gpu)
    refs = [probe.options(num_cpus=0, num_gpus=0.001, scheduling_strategy=placement.strategy(rank)).remote()
            for rank in range(len(placement.places))]
    return ray.get(refs, timeout=timeout_s)


def engine_slots(placement: RankPlacement, gpus: list[str], engines: int, tp: int,
                 nodes: int) -> list[list[EngineSlot]]:
    """Per engine, per node it spans, its slot: the GPUs (`gpus`, by rank) of ranks e·tp + k·(tp/nodes) onwards.
    PlacementError when one part's GPUs are not on one node (the fix: rollout.nodes_per_engine)."""
    width, slots = tp // nodes, []
    if engines * tp > len(placement.places):
        raise PlacementError(f"rollout.num_engines {engines} × tensor_parallel_size {tp} colocated engines need "
                             f"{engines * tp} GPUs, and the ranks hold {len(placement.places)}: lower "
                             "rollout.num_engines")
    for e in range(engines):
        parts = []
        for k in range(nodes):
            places = placement.places[e * tp + k * width:e * tp + (k + 1) * width]
            if len({p.node_id for p in places}) > 1:
                raise PlacementError(
                    f"rollout engine {e}'s GPUs for node {k} of its {nodes} (ranks {places[0].rank}-{places[-1].rank}) "
                    f"lie on {len({p.node_id for p in places})} nodes: set rollout.nodes_per_engine so that "
                    "tensor_parallel_size / nodes_per_engine GPUs fit on one node")
            parts.append(EngineSlot(places[0].rank, ",".join(gpus[p.rank] for p in places)))
        slots.append(parts)
    return slots
