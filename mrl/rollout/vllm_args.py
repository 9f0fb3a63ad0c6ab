"""The vllm.LLM keyword arguments of one rollout engine, from mrl's engine options: what the
engine (mrl/rollout/vllm_engine.py) starts vLLM with, and what each other node of an engine that
spans nodes (mrl/launch/engine_nodes.py) builds the same vLLM config from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mrl.rollout.vllm_cpu import cpu_attention


@dataclass(frozen=True)
class EngineSpan:
    """An engine over `nodes` nodes (rollout.nodes_per_engine): vLLM's own multi-node mode, its
    workers joining one torch.distributed world at master_addr:master_port (on the leader's node);
    this process runs node `node_rank`'s workers (0: the leader, which runs the engine itself)."""

    nodes: int
    master_addr: str
    master_port: int
    node_rank: int = 0


def executor_backend(workers: int) -> str:
    """vLLM's executor: one worker runs in this process ("uni": no worker process to spawn and import
    vLLM into, measured 7.5 s against 14 s for an engine start on CPU, and a collective_rpc is a
    call); several are processes ("mp") even inside a Ray actor, where vLLM would otherwise pick
    its Ray executor and wait for resources the actor already holds (a TP2 engine never started)."""
    return "uni" if workers == 1 else "mp"


def local_workers(tensor_parallel_size: int, span: EngineSpan | None) -> int:
    """The engine's workers on this node: its TP workers, split evenly over the nodes it spans."""
    return tensor_parallel_size // (span.nodes if span else 1)


def vllm_arguments(model: str, *, tensor_parallel_size: int = 1, dtype: str = "auto", max_model_len: int = 1024,
                   kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float = 0.5,
                   enforce_eager: bool = True, seed: int = 0, distributed_executor_backend: str | None = None,
                   expert_parallel: bool = False, span: EngineSpan | None = None,
                   **engine_only: Any) -> dict[str, Any]:
    """vllm.LLM's (EngineArgs') keyword arguments; `engine_only` (weight_apply, streaming, ...) are
    mrl's own options, not vLLM's."""
    kwargs: dict[str, Any] = dict(
        model=model, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
        max_model_len=max_model_len, enforce_eager=enforce_eager, seed=seed,
        distributed_executor_backend=distributed_executor_backend or executor_backend(tensor_parallel_size),
    )
    if span is not None:  # every node's workers in one world; several processes: "mp" whatever the count
        kwargs.update(nnodes=span.nodes, node_rank=span.node_rank, master_addr=span.master_addr,
                      master_port=span.master_port, distributed_executor_backend="mp")
    if not torch.cuda.is_available():
        # vLLM on CPU cannot split a seeded request's prefill over two steps: rewinding the
        # request's generator for the discarded partial-prefill sample fails ("CPU Generator
        # does not use offset"), which a batch of seeded prompts over the step's token budget
        # hit (e.g. partial rollout's continuations). Whole prompts only; a step holds
        # at least one full-length sequence. (vLLM does the same itself for MLA on CPU.)
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 2048))
        kwargs.update(cpu_attention(model))
        if span is not None and local_workers(tensor_parallel_size, span) > 1:
            raise ValueError(f"an engine spanning nodes on vLLM-CPU runs one worker a node, not "
                             f"{local_workers(tensor_parallel_size, span)}: its message queues count a CPU as one "
                             "device, so they take a node's second worker for another node's (vLLM 0.32); set "
                             "rollout.nodes_per_engine to rollout.tensor_parallel_size")
        if expert_parallel and not enforce_eager:  # vLLM's compile warm-up would run the unmapped kernel
            raise ValueError("expert_parallel on vLLM-CPU needs enforce_eager=True: its experts kernel is mapped "
                             "after start (mrl/rollout/vllm_cpu_ep.py), before any forward pass")
    if expert_parallel:  # rollout.expert_parallel: the MoE layers' experts split over the TP workers
        kwargs["enable_expert_parallel"] = True
    # On CPU gpu_memory_utilization is a fraction of *host* RAM; an explicit byte budget is
    # the portable way to size the KV cache.
    if kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    return kwargs
