"""Megatron ranks on Ray: one placement group with a bundle per rank (PACK: as few nodes as Ray can),
ranks numbered by node once Ray has placed the bundles, and the layout's node check made then,
before any rank's process starts (mrl.rank_map). docs/scale.md#rank-placement."""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mrl.layout import ParallelLayout
from mrl.rank_map import PlacementError, RankPlace, check_node_locality, rank_places


@dataclass
class RankPlacement:
    """A ready placement group and each rank's place in it (`places[rank]`)."""

    group: PlacementGroup | None
    places: list[RankPlace]

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        """Where rank `rank`'s actor goes: its bundle, on its node."""
        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=self.places[rank].bundle)

    def remove(self) -> None:
        """Free the bundles (again: a no-op)."""
        if self.group is not None:
            remove_placement_group(self.group)
        self.group = None


def place_ranks(world_size: int, bundle: dict[str, float], timeout_s: float, layout: ParallelLayout | None = None,
                allow_split: bool = False) -> RankPlacement:
    """Reserve `world_size` bundles, number the ranks by node and, given a `layout`, refuse (or with
    `allow_split` warn about) a TP or in-node EP group split over nodes. PlacementError when the
    bundles do not fit in `timeout_s` or a group is split; nothing is left reserved then."""
    group = placement_group([bundle] * world_size, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise PlacementError(
            f"Ray could not place {world_size} workers of {bundle} within {timeout_s:.0f}s: the cluster has "
            f"{ray.cluster_resources()}; lower the layout or add resources (launch.* settings)") from None
    placement = RankPlacement(group, [])
    try:
        placement.places = rank_places(bundle_nodes(group), node_addresses())
        if layout is not None:
            check_node_locality(layout, [p.node_label for p in placement.places], allow_split)
    except BaseException:
        placement.remove()
        raise
    return placement


def bundle_nodes(group: PlacementGroup) -> list[str]:
    """The Ray node id of each bundle of a ready placement group, by bundle index."""
    table = placement_group_table(group)["bundles_to_node_id"]
    return [table[index] for index in range(len(table))]


def node_addresses() -> dict[str, str]:
    """Each live Ray node's address by node id (nodes of a simulated cluster share one)."""
    return {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
