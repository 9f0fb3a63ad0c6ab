"""Engines that span nodes (rollout.nodes_per_engine): one placement group per engine, a bundle
per node (STRICT_SPREAD), the engine itself (RolloutServer, vLLM's leader) in bundle 0 and an
EngineNode in every other: vLLM's own multi-node mode, each node's workers spawned there and
joined into one torch.distributed world at the leader's address. The leader's collective_rpc
reaches every worker (vLLM's message queues over TCP), so the sync's routed transport, whose
workers receive over TCP, reaches them all; /dev/shm and CUDA IPC do not cross nodes
(validation refuses other transports). Colocated on GPUs the parts go in the run's bundles instead
(mrl.launch.colocation). docs/scale.md#engines-that-span-nodes."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mrl.launch.proxies import EngineHandle
from mrl.launch.rollout_actor import ENGINE_ENV, engine_place, launch_rollout_actor
from mrl.rollout.vllm_args import EngineSpan


class EngineNode:
    """The workers of one node of an engine that spans nodes (mrl.rollout.vllm_node)."""

    def __init__(self, model: str, engine_options: dict[str, Any]):
        from mrl.rollout.vllm_node import NodeWorkers

        self.workers = NodeWorkers(model, engine_options)

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def place(self) -> dict:
        return engine_place()

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        """Returns (raising) only when one of this node's workers has exited: the fleet waits on it
        beside every call to the engine, whose leader would otherwise wait for that worker forever."""
        while not (gone := self.workers.exited()):
            time.sleep(WATCH_S)
        raise RuntimeError(f"the engine's worker(s) {gone} on this node exited")

    def shutdown(self) -> None:
        """Stop this node's workers (and free their message queues) before the actor is killed."""
        self.workers.shutdown()


WATCH_S = 1.0  # how often a node looks at its workers


def _free_port() -> tuple[str, int]:
    """This node's address and a port free on it now (the leader's workers bind it next)."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return ray.util.get_node_ip_address(), probe.getsockname()[1]


def launch_spanning_engine(model: str, engine_options: dict[str, Any], nodes: int, *, num_cpus: float = 1,
                           num_gpus: float = 0, sync_timeout_s: float = 300.0, call_timeout_s: float = 300.0,
                           timeout_s: float = 600.0) -> EngineHandle:
    """Reserve a bundle on each of `nodes` nodes and start the engine's leader and node actors
    without waiting for the engine (the fleet waits for all its engines at once). `num_gpus`: the
    whole engine's, split evenly over its nodes. A node that dies fails the engine's calls at once
    (its `watch`, EngineHandle.watchers)."""
    bundle = {"CPU": num_cpus, **({"GPU": num_gpus / nodes} if num_gpus else {})}
    group = placement_group([bundle] * nodes, strategy="STRICT_SPREAD")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise TimeoutError(
            f"Ray could not place an engine over {nodes} nodes ({bundle} on each) within {timeout_s:.0f}s: the "
            f"cluster has {ray.cluster_resources()}; rollout.nodes_per_engine needs that many nodes with "
            "room") from None
    on = [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=k) for k in range(nodes)]
    parts = [EnginePart(strategy, num_cpus, bundle.get("GPU", 0)) for strategy in on]
    try:
        return start_engine_parts(model, engine_options, parts, group=group, sync_timeout_s=sync_timeout_s,
                                  call_timeout_s=call_timeout_s, timeout_s=timeout_s)
    except BaseException:
        ray.util.remove_placement_group(group)
        raise


@dataclass(frozen=True)
class EnginePart:
    """Where one node's part of an engine runs (its actor's scheduling and resources), and the
    environment it adds (colocated on GPUs: the GPUs its workers see, mrl.launch.colocation)."""

    strategy: Any
    num_cpus: float
    num_gpus: float
    env: dict[str, str] = field(default_factory=dict)


def start_engine_parts(model: str, engine_options: dict[str, Any], parts: list[EnginePart], *, group: Any = None,
                       sync_timeout_s: float = 300.0, call_timeout_s: float = 300.0,
                       timeout_s: float = 600.0) -> EngineHandle:
    """Start an engine's leader in parts[0] and, when it spans nodes, an EngineNode in each other
    part, all joined at a port free on the leader's node; nothing waits for the engine. `group`:
    the engine's own placement group, freed when it is killed."""
    spans = [{}] * len(parts)  # one part: a plain engine
    if len(parts) > 1:
        address, port = ray.get(ray.remote(_free_port).options(num_cpus=0, scheduling_strategy=parts[0].strategy)
                                .remote(), timeout=timeout_s)
        spans = [{"span": EngineSpan(len(parts), address, port, node_rank=k)} for k in range(len(parts))]
    leader = launch_rollout_actor(model, engine_options | spans[0], num_cpus=parts[0].num_cpus,
                                  num_gpus=parts[0].num_gpus, sync_timeout_s=sync_timeout_s,
                                  strategy=parts[0].strategy, env=parts[0].env)
    node_actor = ray.remote(concurrency_groups={"watch": 1})(EngineNode)
    others = [node_actor.options(num_cpus=part.num_cpus, num_gpus=part.num_gpus, scheduling_strategy=part.strategy,
                                 runtime_env={"env_vars": ENGINE_ENV | part.env}).remote(model, engine_options | span)
              for part, span in zip(parts[1:], spans[1:])]
    return EngineHandle(leader, call_timeout_s, node_actors=others, placement=group,
                        watchers=[node.watch.remote() for node in others])
