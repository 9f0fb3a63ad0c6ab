"""One node's share of a vLLM engine that spans nodes (rollout.nodes_per_engine): vLLM's headless
multi-node mode, that node's workers and nothing else (no scheduler, no API); they take their
orders from the engine's leader on the first node. mrl/launch/engine_nodes.py runs it in a Ray actor."""

from __future__ import annotations

from typing import Any

from mrl.rollout.vllm_args import local_workers, vllm_arguments
from mrl.rollout.vllm_cpu import _bind_cpu_workers


class NodeWorkers:
    """Start node `engine_options["span"].node_rank`'s workers of the engine on `model`; returns once
    they have joined the engine's world (so the leader must be starting too)."""

    def __init__(self, model: str, engine_options: dict[str, Any]):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor

        _bind_cpu_workers(local_workers(engine_options.get("tensor_parallel_size", 1), engine_options["span"]))
        config = EngineArgs(**vllm_arguments(model, **engine_options)).create_engine_config(headless=True)
        self.executor = MultiprocExecutor(config, monitor_workers=False)

    def exited(self) -> list[int]:
        """The ranks of this node's workers whose process has exited."""
        return [w.rank for w in self.executor.workers if not w.proc.is_alive()]

    def shutdown(self) -> None:
        """Stop the workers and free their message queues."""
        self.executor.shutdown()
