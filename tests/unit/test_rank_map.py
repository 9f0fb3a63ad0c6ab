"""mrl.rank_map and ParallelLayout.rank_groups: ranks numbered by node, the check that a layout's
TP (and in-node EP) groups stay on one node, its refusal, and ranks.json. No Ray: placement on a
simulated Ray cluster is tests/e2e/test_rank_placement.py."""

import json
from pathlib import Path

import pytest

from mrl.config import ConfigError, load_config
from mrl.layout import ParallelLayout
from mrl.rank_map import (PlacementError, RankPlace, bundles_by_node, check_node_locality, planned_split, rank_places,
                          shared_devices, split_groups, write_rank_map)

DSV3 = Path(__file__).resolve().parents[2] / "configs" / "dsv3_671b_grpo.yaml"


def test_ranks_fill_a_node_before_the_next_whatever_the_bundle_order():
    # Ray's PACK may interleave nodes over the bundles: ranks are still numbered node by node
    assert bundles_by_node(["b", "a", "b", "a", "c"]) == [0, 2, 1, 3, 4]
    places = rank_places(["n2", "n1", "n2", "n1"], {"n1": "10.0.0.1", "n2": "10.0.0.2"})
    assert [(p.rank, p.node, p.node_id, p.local_rank, p.bundle) for p in places] == [
        (0, 0, "n2", 0, 0), (1, 0, "n2", 1, 2), (2, 1, "n1", 0, 1), (3, 1, "n1", 1, 3)]
    assert places[2].node_label == "1 (10.0.0.1)"


def test_rank_groups_are_megatrons():
    # Megatron's RankGenerator (order tp-cp-ep-dp-pp) gives these; mrl's groups equalled it on 302
    # layouts (tp 1-4, cp 1-2, pp 1-2, ep 1-4, etp, worlds 8-32) when written.
    dense = ParallelLayout(tp=2, cp=2, pp=2)
    assert dense.rank_groups(16, "tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    moe = ParallelLayout(tp=2, ep=2, etp=2)
    assert moe.rank_groups(8, "ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert moe.rank_groups(8, "etp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # the 671B recipe: the TP group is a node's 8 GPUs; EP rank = r % 32, one EP group per stage
    dsv3 = ParallelLayout(tp=8, pp=4, ep=32, etp=1)
    assert dsv3.rank_groups(128, "tp")[3] == list(range(24, 32))
    assert dsv3.rank_groups(128, "ep") == [list(range(32 * s, 32 * s + 32)) for s in range(4)]


TWO_NODES = ["n0"] * 4 + ["n1"] * 4
FOUR_NODES = [f"n{r // 2}" for r in range(8)]


@pytest.mark.parametrize("layout, nodes", [
    (ParallelLayout(tp=4), TWO_NODES),
    (ParallelLayout(tp=2, pp=2, ep=2), TWO_NODES),  # EP2 × ETP2 = 4 ranks: one node's
    (ParallelLayout(tp=2, pp=4), FOUR_NODES),
    (ParallelLayout(tp=2, ep=4, etp=1), FOUR_NODES),  # EP4 exceeds a node of 2: spans nodes by design
])
def test_groups_on_one_node_pass(layout, nodes):
    assert split_groups(layout, nodes) == []


@pytest.mark.parametrize("layout, nodes, start", [
    (ParallelLayout(tp=8), TWO_NODES, "TP group of ranks 0-7 is split over nodes n0, n1 (1 of 1 TP groups are; "
                                       "the nodes hold 4, 4 ranks)"),
    (ParallelLayout(tp=4, pp=2), FOUR_NODES, "TP group of ranks 0-3 is split over nodes n0, n1 (2 of 2"),
    (ParallelLayout(tp=4), ["n0"] * 6 + ["n1"] * 10, "TP group of ranks 4-7 is split over nodes n0, n1 (1 of 4 TP "
                                                      "groups are; the nodes hold 6, 10 ranks)"),
    (ParallelLayout(tp=1, ep=4, etp=4), FOUR_NODES, "expert TP group of ranks 0-3 is split over nodes n0, n1"),
    (ParallelLayout(tp=1, ep=4), ["n0"] * 4 + ["n1"] * 2 + ["n0"] * 2, "EP group of ranks 4-7 is split over nodes n1, n0"),
])
def test_a_split_group_is_named_with_its_nodes(layout, nodes, start):
    errors = split_groups(layout, nodes)
    assert len(errors) == 1 and errors[0].startswith(start), errors


def test_a_split_is_refused_in_one_line_or_only_warned_when_allowed(capsys):
    with pytest.raises(PlacementError) as refused:
        check_node_locality(ParallelLayout(tp=8), TWO_NODES, allow_split=False)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("TP group of ranks 0-7 is split over nodes n0, n1")
    assert message.endswith("choose parallel.tp (tp <= launch.gpus_per_node) dividing the ranks per node, so each "
                            "group of 8 fits in one, give every node a multiple of it, or set "
                            "launch.allow_cross_node_tp: true to run split")
    warnings = check_node_locality(ParallelLayout(tp=8), TWO_NODES, allow_split=True)
    assert len(warnings) == 1 and warnings[0] in capsys.readouterr().out
    assert check_node_locality(ParallelLayout(tp=4), TWO_NODES, allow_split=False) == []


def test_validation_refuses_a_tp_group_larger_than_a_node():
    assert planned_split(ParallelLayout(tp=8, pp=4, ep=32, etp=1), 128, 8) == []  # the recipe as it is
    assert planned_split(ParallelLayout(tp=4), 12, 6)[0].startswith("TP group of ranks 4-7 is split over nodes 0, 1")
    files = ["launch.num_nodes=32", "rollout.tensor_parallel_size=16", "rollout.num_engines=1",
             "rollout.nodes_per_engine=2"]
    with pytest.raises(ConfigError) as refused:
        load_config(DSV3, [*files, "parallel.tp=16"], check_files=False)
    errors = refused.value.errors
    assert any(e.startswith("parallel: TP group of ranks 0-15 is split over nodes 0, 1") for e in errors), errors
    cfg = load_config(DSV3, [*files, "parallel.tp=16", "launch.allow_cross_node_tp=true"], check_files=False)
    assert cfg.launch.allow_cross_node_tp  # the run's placement check warns instead


def test_the_rank_map_is_printed_once_per_node_and_written(tmp_path, capsys):
    places = [RankPlace(r, r // 2, f"id{r // 2}", "10.0.0.1", r % 2, r, str(r % 2)) for r in range(4)]
    path = write_rank_map(tmp_path / "run", {"actor": places})
    assert capsys.readouterr().out.splitlines() == [
        "actor ranks:", "  node 0 (10.0.0.1) [id0]: ranks 0-1, local ranks 0-1, devices 0,1",
        "  node 1 (10.0.0.1) [id1]: ranks 2-3, local ranks 0-1, devices 0,1"]
    written = json.loads(path.read_text())["actor"]
    assert written[3] == {"rank": 3, "node": 1, "node_id": "id1", "node_ip": "10.0.0.1", "local_rank": 1,
                          "bundle": 3, "devices": "1"}


def test_ranks_that_share_a_gpu_are_warned_about():
    # what Ray 2.60 does with 4 bundles of {"GPU": 0.5} on two 2-GPU nodes (PACK): one node, 2 ranks a GPU
    places = [RankPlace(r, 0, "id0", "10.0.0.1", r, r, str(r // 2)) for r in range(4)]
    assert shared_devices(places).startswith("warning: ranks 0-1 share device 0 on node 0 (10.0.0.1) (2 devices are shared)")
    assert shared_devices([RankPlace(r, 0, "id0", "ip", r, r, str(r)) for r in range(4)]) is None
    assert shared_devices([RankPlace(r, 0, "id0", "ip", r, r) for r in range(4)]) is None  # CPU ranks: no devices
