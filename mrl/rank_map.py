"""Where each Megatron rank runs, and whether the layout's groups stay inside a node.

Ranks are numbered by node, then by position on the node (rank r = ranks_per_node·node + local
rank), and Megatron forms a TP group of tp consecutive ranks: so a TP group lies on one node exactly
when every node holds a multiple of tp ranks. `split_groups` checks that (and expert groups small
enough for a node) on the placement Ray actually made; the map goes to <output_dir>/ranks.json.
Pure Python: which node Ray put each bundle on is mrl/launch/placement.py's. docs/scale.md#rank-placement.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Hashable, Sequence

from mrl.layout import ParallelLayout


class PlacementError(RuntimeError):
    """The ranks cannot be placed (no room, or a layout group split over nodes); one line with the fix."""


@dataclass(frozen=True)
class RankPlace:
    """One rank's place: its node (index among the group's nodes, in the order of their first
    bundle; Ray's id and address), its index on that node, its bundle, and its accelerators."""

    rank: int
    node: int
    node_id: str
    node_ip: str
    local_rank: int
    bundle: int
    devices: str | None = None  # CUDA_VISIBLE_DEVICES as Ray set it for the rank (None: unset)

    @property
    def node_label(self) -> str:
        return f"{self.node} ({self.node_ip})"


def bundles_by_node(bundle_nodes: Sequence[Hashable]) -> list[int]:
    """The bundle of each rank: bundles grouped by node (nodes in the order of their first bundle),
    by index within a node. Ray's PACK may interleave nodes (bundles on a, b, a, b): ranks still
    fill one node before the next."""
    first: dict[Hashable, int] = {}
    for node in bundle_nodes:
        first.setdefault(node, len(first))
    return sorted(range(len(bundle_nodes)), key=lambda b: (first[bundle_nodes[b]], b))


def local_ranks(nodes: Sequence[Hashable]) -> list[int]:
    """LOCAL_RANK of each global rank: its index among the ranks on the same node."""
    seen: dict[Hashable, int] = {}
    ranks = []
    for node in nodes:
        ranks.append(seen.get(node, 0))
        seen[node] = ranks[-1] + 1
    return ranks


def rank_places(bundle_nodes: Sequence[str], node_ips: dict[str, str]) -> list[RankPlace]:
    """Each rank's place, from the node id of each placement-group bundle (and each node's address)."""
    bundles = bundles_by_node(bundle_nodes)
    nodes = [bundle_nodes[b] for b in bundles]
    index = {node: i for i, node in enumerate(dict.fromkeys(nodes))}
    return [RankPlace(rank, index[node], node, node_ips.get(node, "?"), local, bundle)
            for rank, (node, local, bundle) in enumerate(zip(nodes, local_ranks(nodes), bundles))]


def split_groups(layout: ParallelLayout, rank_nodes: Sequence[Hashable]) -> list[str]:
    """One line per kind of group the placement splits over nodes, naming the group, its nodes and
    the fix. `rank_nodes`: each rank's node (any label). Empty: every group checked is on one node."""
    return [f"{problem}: {fix}" for problem, fix in _splits(layout, rank_nodes)]


def check_node_locality(layout: ParallelLayout, rank_nodes: Sequence[Hashable], allow_split: bool) -> list[str]:
    """Refuse a placement that splits a group over nodes (PlacementError naming the first split),
    or with launch.allow_cross_node_tp only warn; returns the warnings printed."""
    splits = _splits(layout, rank_nodes)
    if splits and not allow_split:
        raise PlacementError(": ".join(splits[0]))
    warnings = [f"warning: {problem}; running split (launch.allow_cross_node_tp: true): its collectives cross "
                "the network" for problem, _ in splits]
    for warning in warnings:
        print(warning, flush=True)
    return warnings


def _splits(layout: ParallelLayout, rank_nodes: Sequence[Hashable]) -> list[tuple[str, str]]:
    """(problem, fix) per kind of split group. Checked: TP, expert TP (when it differs from TP), and
    EP when an expert group (ETP·EP ranks) fits on the fullest node (a larger EP spans nodes by
    design: the 671B recipe's EP32 over 4 nodes)."""
    counts = Counter(rank_nodes)
    kinds = [("TP", "tp", layout.tp, "parallel.tp (tp <= launch.gpus_per_node)")]
    if layout.expert_tp != layout.tp:
        kinds.append(("expert TP", "etp", layout.expert_tp, "parallel.etp"))
    if layout.ep > 1 and layout.ep * layout.expert_tp <= max(counts.values()):
        kinds.append(("EP", "ep", layout.ep * layout.expert_tp, "parallel.ep × parallel.etp"))
    splits = []
    for name, kind, size, setting in kinds:
        groups = layout.rank_groups(len(rank_nodes), kind)
        split = [g for g in groups if len({rank_nodes[r] for r in g}) > 1]
        if split:
            nodes = ", ".join(str(n) for n in dict.fromkeys(rank_nodes[r] for r in split[0]))
            held = ", ".join(str(counts[n]) for n in dict.fromkeys(rank_nodes))
            splits.append((f"{name} group of ranks {_ranks(split[0])} is split over nodes {nodes} ({len(split)} of "
                           f"{len(groups)} {name} groups are; the nodes hold {held} ranks)",
                           f"choose {setting} dividing the ranks per node, so each group of {size} fits in one, "
                           "give every node a multiple of it, or set launch.allow_cross_node_tp: true to run split"))
    return splits


def planned_split(layout: ParallelLayout, world_size: int, gpus_per_node: int) -> list[str]:
    """split_groups for the placement a GPU run gets when every node is free: ranks fill nodes of
    gpus_per_node in order. Lets validation refuse the layout before anything starts."""
    return split_groups(layout, [rank // gpus_per_node for rank in range(world_size)])


def describe_ranks(places: Sequence[RankPlace]) -> list[str]:
    """One line per node: its ranks and their accelerators."""
    lines = []
    for node in dict.fromkeys(p.node for p in places):
        here = [p for p in places if p.node == node]
        devices = ",".join(p.devices for p in here if p.devices) or "none"
        lines.append(f"node {here[0].node_label} [{here[0].node_id[:12]}]: ranks {_ranks([p.rank for p in here])}, "
                     f"local ranks 0-{len(here) - 1}, devices {devices}")
    return lines


def shared_devices(places: Sequence[RankPlace]) -> str | None:
    """A warning when ranks of one group share an accelerator: Ray packs fractional-GPU bundles onto
    as few GPUs as it can, two ranks to a GPU (a run sharing GPUs reserves whole-GPU bundles instead,
    mrl.launch.cluster._shared_gpus; this catches a placement that still packs)."""
    holders: dict[tuple[str, str], list[int]] = {}
    for p in places:
        if p.devices:
            holders.setdefault((p.node_label, p.devices), []).append(p.rank)
    shared = [(key, ranks) for key, ranks in holders.items() if len(ranks) > 1]
    if not shared:
        return None
    (node, devices), ranks = shared[0]
    return (f"warning: ranks {_ranks(ranks)} share device {devices} on node {node} ({len(shared)} devices are "
            "shared): Ray packed fractional-GPU bundles together (launch.placement colocated or a critic gives "
            "each rank part of a GPU); the ranks do not each get a GPU of their own")


def write_rank_map(out_dir: Path, roles: dict[str, Sequence[RankPlace]],
                   engines: Sequence[Sequence[dict]] = ()) -> Path:
    """Print each role's map (rank → node, device) and where the engines run (per engine, each of its
    nodes: Ray's node id and the GPUs its workers see) once, and write them to <out_dir>/ranks.json."""
    for role, places in roles.items():
        print(f"{role} ranks:\n  " + "\n  ".join(describe_ranks(places)), flush=True)
        if (warning := shared_devices(places)) is not None:
            print(f"{role} {warning}", flush=True)
    for i, parts in enumerate(engines):
        where = ", ".join(f"{p['node_id'][:12]} (devices {p['devices'] or 'none'})" for p in parts)
        print(f"rollout engine {i}: node{'s' * (len(parts) > 1)} {where}", flush=True)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / "ranks.json"
    layout = {role: [asdict(p) for p in places] for role, places in roles.items()}
    path.write_text(json.dumps(layout | ({"engines": [list(n) for n in engines]} if engines else {}), indent=1))
    return path


def _ranks(ranks: Sequence[int]) -> str:
    """`4-7` for consecutive ranks, else `0,2,4,6`."""
    ranks = list(ranks)
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))) and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
