"""Rank placement on a simulated two-node Ray cluster (ray.cluster_utils.Cluster: 2 nodes × 4 CPUs ×
2 logical GPUs on this machine): mrl.launch.placement numbers 4 lightweight actors' ranks node by
node, each actor runs on the node and device the map says, and a TP4 layout (a group over both
nodes) is refused before any actor starts, with its bundles freed. Colocated on GPUs
(mrl.launch.colocation): ranks at half a GPU each get a GPU of their own, and each engine's part
sees exactly its ranks' GPUs, on their node: two TP2 engines, then one TP4 engine over both nodes.

The cluster runs in a child process (this file run as a script) under a private RAY_TMPDIR: a test
session's own Ray (tests/e2e/conftest.py) stays connected, and no other cluster's address file is
touched. Ray starts once per run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.matrix  # 35-64 s on the shared 2-core machine, most of it starting the two Ray nodes
def test_ranks_follow_nodes_and_a_split_tp_group_is_refused():
    pytest.importorskip("ray")
    with tempfile.TemporaryDirectory(prefix="mrl-ray-", dir="/tmp") as temp:  # short: Ray's socket paths
        env = {**os.environ, "RAY_TMPDIR": temp, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    places, actors = seen["places"], seen["actors"]
    nodes = [p["node_id"] for p in places]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3], places  # consecutive ranks share a node
    assert [p["node"] for p in places] == [0, 0, 1, 1] and [p["local_rank"] for p in places] == [0, 1, 0, 1]
    assert [a["node_id"] for a in actors] == nodes  # each actor ran where the map put its rank
    assert sorted(a["devices"] for a in actors[:2]) == sorted(a["devices"] for a in actors[2:]) == ["0", "1"]
    assert seen["refused"].startswith("TP group of ranks 0-3 is split over nodes 0 (") and "\n" not in seen["refused"]
    assert seen["free_after_refusal"] == {"CPU": 8.0, "GPU": 4.0}
    colocated = seen["colocated"]
    ranks = colocated["ranks"]  # (node id, CUDA_VISIBLE_DEVICES) by rank, at half a GPU each
    assert [r[0] for r in ranks] == nodes
    assert sorted(r[1] for r in ranks[:2]) == sorted(r[1] for r in ranks[2:]) == ["0", "1"]
    for engines, parts in (("tp2", colocated["tp2"]), ("tp4", colocated["tp4"])):
        width = 2
        for e, engine in enumerate(parts):  # engine e's part k: ranks e·tp + k·width onwards, on their node
            for k, (node, devices) in enumerate(engine):
                first = e * width * len(engine) + k * width
                assert node == ranks[first][0], (engines, e, k)
                assert devices == ",".join(r[1] for r in ranks[first:first + width]), (engines, e, k)


def _on_two_nodes() -> dict:
    """Place 4 one-GPU ranks as TP2, start a probe actor per rank, then try TP4."""
    import ray
    from ray.cluster_utils import Cluster

    from mrl.launch.placement import place_ranks
    from mrl.layout import ParallelLayout
    from mrl.rank_map import PlacementError

    @ray.remote
    class Probe:
        def where(self) -> dict:
            return {"node_id": ray.get_runtime_context().get_node_id(),
                    "devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 2, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=4, num_gpus=2)
        ray.init(address=cluster.address, log_to_driver=False)
        bundle = {"CPU": 1, "GPU": 1}
        placement = place_ranks(4, bundle, 60.0, ParallelLayout(tp=2))
        probes = [Probe.options(num_cpus=1, num_gpus=1, scheduling_strategy=placement.strategy(rank)).remote()
                  for rank in range(4)]
        actors = ray.get([probe.where.remote() for probe in probes], timeout=60)
        for probe in probes:
            ray.kill(probe)
        placement.remove()
        try:
            place_ranks(4, bundle, 60.0, ParallelLayout(tp=4))
            refused = ""
        except PlacementError as err:
            refused = str(err)
        return {"places": [asdict(p) for p in placement.places], "actors": actors, "refused": refused,
                "free_after_refusal": _free_resources(expect={"CPU": 8.0, "GPU": 4.0}), "colocated": _colocated(Probe)}
    finally:
        ray.shutdown()
        cluster.shutdown()


def _colocated(probe_class) -> dict:
    """The run's bundles (a whole GPU each), 4 ranks at half a GPU, and the engines' parts at half a
    GPU with the GPUs mrl gives them: where each runs and what it sees."""
    import ray

    from mrl.launch.colocation import engine_slots, rank_gpus
    from mrl.launch.placement import place_ranks
    from mrl.layout import ParallelLayout

    shared = place_ranks(4, {"CPU": 2, "GPU": 1}, 60.0, ParallelLayout(tp=2))
    gpus = rank_gpus(shared, 60.0)

    def run(strategies_and_envs) -> list:
        probes = [probe_class.options(num_cpus=1, num_gpus=0.5, scheduling_strategy=strategy,
                                      runtime_env={"env_vars": env}).remote() for strategy, env in strategies_and_envs]
        seen = ray.get([p.where.remote() for p in probes], timeout=60)
        for p in probes:
            ray.kill(p)
        return [(s["node_id"], s["devices"]) for s in seen]

    ranks = run([(shared.strategy(rank), {}) for rank in range(4)])
    found = {"ranks": ranks}
    for name, engines, tp, nodes in (("tp2", 2, 2, 1), ("tp4", 1, 4, 2)):
        slots = engine_slots(shared, gpus, engines, tp, nodes)
        seen = run([(slot.strategy(shared), slot.env()) for parts in slots for slot in parts])
        found[name] = [seen[e * nodes:(e + 1) * nodes] for e in range(engines)]
    shared.remove()
    return found


def _free_resources(expect: dict, within_s: float = 10.0) -> dict:
    """The cluster's free CPUs and GPUs once they equal `expect`, or as they are after `within_s`
    (Ray frees a removed placement group's bundles asynchronously)."""
    import ray

    deadline = time.monotonic() + within_s
    while True:
        free = {k: ray.available_resources().get(k) for k in expect}
        if free == expect or time.monotonic() > deadline:
            return free
        time.sleep(0.2)


if __name__ == "__main__":
    print(json.dumps(_on_two_nodes()))
