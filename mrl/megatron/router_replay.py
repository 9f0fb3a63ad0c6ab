"""MoE routing replay in the Megatron trainer (algo.router_replay R2, R3) and the trainer's own routes.

A batch may carry routes (mrl.routes' contract, padded: "routes" [B, L, M, K] aligned to the model
inputs tokens[:, :L], "routes_len" [B] positions with a route). `prepare` checks them, keeps this
rank's MoE layers and says what a pass does with them: a RoutePass replays them (before each
micro-batch's forward through a chunk every router of the chunk gets this rank's rows of its layer:
the CP positions, then the TP rank's sequence-parallel slice, in the router's [s, b] token order)
and/or records each router's own top-k. Megatron's RouterReplay does the replay, in recomputation
too (REPLAY_BACKWARD, first in first out); megatron_patches/router_replay_fallback.py adds the
per-token fallback (-1 rows: positions without a route route themselves) and recording under
replay. Recorded routes are gathered back to whole sequences and all MoE layers (`own_routes`).
The longer story: docs/routing-replay.md.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from mrl.megatron.context_parallel import gather_sequence
from mrl.models.registry import moe_layer_pattern
from mrl.routes import RouteShape, agreement_counts, check_routes

MODES = ("none", "R2", "R3")
NO_ROUTE = -1  # a target row of -1: the router chooses for that token itself


def config_moe_layers(config) -> list[int]:
    """1 for each MoE layer of the model, 0 for a dense one (its TransformerConfig's moe_layer_freq)."""
    return moe_layer_pattern(config.moe_layer_freq, config.num_layers)


def chunk_routers(chunk: torch.nn.Module) -> list[tuple[int, object]]:
    """(MoE layer index, RouterReplay) of every router in a model chunk (raw or DDP-wrapped)."""
    out = []
    for module in chunk.modules():
        if hasattr(module, "router_replay") and hasattr(module, "routing"):
            if module.router_replay is None:
                raise RuntimeError("this model was built without moe_enable_routing_replay: build it with "
                                   "mrl.megatron.model.build_model, which turns it on for MoE models")
            pattern = config_moe_layers(module.config)
            out.append((sum(pattern[: module.layer_number - 1]), module.router_replay))
    return out


def route_shape_of(built) -> RouteShape | None:
    """The routes a sample of this model carries (None: a dense model)."""
    return built.spec.route_shape


@dataclass
class RoutePlan:
    """What one pass does with routes: replay the batch's, record the router's own, or both."""

    replay: bool = False
    record: bool = False


def plan_for(mode: str, stage: str, has_routes: bool) -> RoutePlan:
    """stage "old" (the old-log-prob pass), "ref" (the reference's log-probs) or "update".

    R3 replays the engine's routes everywhere; R2 records the trainer's own in the old pass and
    replays those (put in the batch by the driver) in the updates; the old pass records whenever
    the batch has routes, for the agreement metrics."""
    if mode not in MODES:
        raise ValueError(f"algo.router_replay {mode!r} is not one of {', '.join(MODES)}")
    replay = (mode == "R3" and stage in ("old", "ref")) or (mode != "none" and stage == "update")
    record = stage == "old" and (mode == "R2" or has_routes)
    if replay and not has_routes:
        source = "the engine's routes (rollout.return_routes: true)" if mode == "R3" else \
            "the routes the old-log-prob pass returned (batch['routes'])"
        raise ValueError(f"algo.router_replay {mode} replays routes in the {stage} pass but the batch has none: "
                         f"put {source} into the batch, or set algo.router_replay: none")
    return RoutePlan(replay, record)


def check_batch_routes(batch: dict, shape: RouteShape) -> None:
    """mrl.routes.check_routes on every row's routes; a sample is named by its sample_ids entry."""
    routes, lengths = batch["routes"], batch["routes_len"]
    names = batch.get("sample_ids", torch.arange(routes.shape[0]))
    if routes.dim() != 4 or tuple(routes.shape[2:]) != (shape.layers, shape.top_k):
        raise ValueError(f"batch routes have shape {tuple(routes.shape)}, expected [B, L, {shape.layers}, "
                         f"{shape.top_k}] (MoE layers, top-k)")
    for row in range(routes.shape[0]):
        n = int(lengths[row])
        shape.check(routes[row, :n], tokens=n, sample=int(names[row]))


def fit_routes(routes: torch.Tensor, lengths: torch.Tensor, rows: int, seq: int) -> torch.Tensor:
    """Batch routes [B, L, M, K] → long [rows, seq, M, K] for micro-batching: a row's positions from
    its routes_len on, trimmed or padded columns and filler rows are NO_ROUTE."""
    count, width = routes.shape[:2]
    columns = min(width, seq)
    out = torch.full((rows, seq, *routes.shape[2:]), NO_ROUTE, dtype=torch.long)
    out[:count, :columns] = routes[:, :columns].long()
    beyond = torch.arange(seq).unsqueeze(0) >= lengths.unsqueeze(1)  # [count, seq]
    out[:count][beyond] = NO_ROUTE
    return out


def local_layers(built) -> list[int]:
    """This rank's MoE layers (every chunk of its pipeline stage), in order."""
    return sorted(g for chunk in built.chunks for g, _ in chunk_routers(chunk))


class RoutePass:
    """One pass's replay and recording over a model's routers; hooks for the forward step."""

    def __init__(self, built, plan: RoutePlan):
        self.plan = plan
        self.top_k = built.chunks[0].config.moe_router_topk
        self.moe_layers = sum(config_moe_layers(built.chunks[0].config))
        self.layers = local_layers(built)
        self.position = {g: i for i, g in enumerate(self.layers)}
        self._routers: dict[int, list] = {}  # id(model given to forward_step) → its routers
        self.recorded: dict[int, list[dict[int, torch.Tensor]]] = {}  # id(model) → per micro-batch, per layer

    def routers(self, model: torch.nn.Module) -> list:
        if id(model) not in self._routers:
            self._routers[id(model)] = chunk_routers(model)
        return self._routers[id(model)]

    def before(self, model: torch.nn.Module, micro: dict) -> None:
        """Before `model`'s forward of `micro` (this rank's CP part, as split_micro_batch leaves it)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        from megatron_patches.router_replay_fallback import record_own

        for layer, replay in self.routers(model):
            if self.plan.replay:
                replay.set_target_indices(self._targets(micro["routes"][:, :, self.position[layer]]))
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                record_own(replay, self.plan.record)
            elif self.plan.record:
                replay.set_router_replay_action(RouterReplayAction.RECORD)

    def after(self, model: torch.nn.Module) -> None:
        """After the forward: keep what was recorded; recomputation in backward replays the same
        targets, in the order of the forwards (Megatron's REPLAY_BACKWARD)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self.plan.record:
            self.recorded.setdefault(id(model), []).append(
                {layer: replay.get_recorded_indices() for layer, replay in self.routers(model)})
        for _, replay in self.routers(model):
            if self.plan.replay:
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            else:
                replay.clear_router_replay_action()

    def close(self) -> None:
        from megatron_patches.router_replay_fallback import record_own

        for routers in self._routers.values():
            for _, replay in routers:
                replay.clear_indices()
                replay.clear_router_replay_action()
                record_own(replay, False)

    def _targets(self, routes: torch.Tensor) -> torch.Tensor:
        """[b, s_cp, K] of one layer → this TP rank's tokens in the router's order: the sequence-
        parallel slice of the positions, [s, b] flattened s-major."""
        from megatron.core import parallel_state as ps

        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        n = routes.shape[1] // tp  # sequence parallelism is on whenever TP > 1 (mrl.megatron.model)
        return routes[:, rank * n : (rank + 1) * n].transpose(0, 1).reshape(-1, routes.shape[-1])

    def own_routes(self, micro: list[dict], count: int, length: int) -> torch.Tensor:
        """The recorded own routes as long [count, length, all MoE layers, K] in the batch's row order,
        NO_ROUTE where nothing was forwarded. Collective over TP, CP and PP."""
        per_micro = []
        for index, mb in enumerate(micro):
            rows = {}
            for recorded in self.recorded.values():
                rows.update(recorded[index])
            b = mb["tokens"].shape[0]
            local = [rows[g].reshape(-1, b, self.top_k) for g in self.layers]  # [s_sp, b, K] each
            per_micro.append(_whole_sequences(local, mb["tokens"].shape[1], b, self.top_k))
        values = torch.cat(per_micro)[:, : micro[0]["label_columns"]].cpu()
        index = torch.cat([m["index"] for m in micro])
        mine = torch.full((count, length, len(self.layers), self.top_k), NO_ROUTE, dtype=torch.long)
        mine[index[index >= 0], : values.shape[1]] = values[index >= 0]
        return _all_layers(mine, self.layers, self.moe_layers)


def _whole_sequences(local: list[torch.Tensor], seq: int, b: int, top_k: int) -> torch.Tensor:
    """Per layer [s_sp, b, K] of this rank → [b, seq, layers, K]: gathered over TP (sequence
    parallelism) and CP."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not local:
        return torch.zeros(b, seq, 0, top_k, dtype=torch.long)
    stacked = torch.stack(local, dim=2).long()  # [s_sp, b, M, K]
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(stacked) for _ in range(tp)]
        dist.all_gather(parts, stacked.contiguous(), group=ps.get_tensor_model_parallel_group())
        stacked = torch.cat(parts)
    return gather_sequence(stacked.transpose(0, 1).contiguous())


def _all_layers(mine: torch.Tensor, layers: list[int], moe_layers: int) -> torch.Tensor:
    """This stage's layers → every MoE layer, summed over the pipeline group (each layer lives on one stage)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return mine
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the pipeline group is NCCL's on GPUs
    full = torch.zeros(*mine.shape[:2], moe_layers, mine.shape[-1], dtype=torch.long, device=device)
    full[:, :, layers] = (mine - NO_ROUTE).to(device)  # 0 where nothing was recorded
    dist.all_reduce(full, group=ps.get_pipeline_model_parallel_group())
    return full.cpu() + NO_ROUTE


@contextmanager
def route_pass(built, plan: RoutePlan | None) -> Iterator[RoutePass | None]:
    """A RoutePass for `plan` (None when there is nothing to do), its routers cleared afterwards."""
    if plan is None or not (plan.replay or plan.record):
        yield None
        return
    routes = RoutePass(built, plan)
    try:
        yield routes
    finally:
        routes.close()


def prepare(batch: dict, built, mode: str, stage: str) -> tuple[dict, RoutePlan | None]:
    """This rank's batch for a pass and its plan: routes checked and narrowed to this rank's MoE
    layers when the pass replays them, dropped when it does not (recording needs none). A dense
    model: no plan."""
    shape = route_shape_of(built)
    has_routes = "routes" in batch
    plan = None if shape is None else plan_for(mode, stage, has_routes)
    if has_routes and plan is not None and (plan.replay or plan.record):
        check_batch_routes(batch, shape)
    if not has_routes or plan is None or not plan.replay:  # recording needs no routes in the micro-batches
        return {k: v for k, v in batch.items() if k not in ("routes", "routes_len")}, plan
    return {**batch, "routes": batch["routes"][:, :, local_layers(built)]}, plan


def routing_results(own: torch.Tensor, batch: dict, mode: str, shape: RouteShape) -> dict:
    """What the old-log-prob pass reports about routes: "routing_counts" (mrl.routes.agreement_counts
    of the trainer's own top-k [B, L, M, K] against the batch's routes, over the positions that have
    both; additive over DP ranks) when the batch has routes; with R2 the own routes to replay in
    the updates, "routes" (the contract's dtype) and "routes_len"."""
    out = {}
    forwarded = own[:, :, 0, 0] >= 0  # [B, L]: positions the pass forwarded (a MoE model has M >= 1)
    if "routes" in batch:
        given, lengths = batch["routes"], batch["routes_len"]
        width = min(given.shape[1], own.shape[1])
        mask = forwarded[:, :width] & (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1))
        out["routing_counts"] = agreement_counts(own[:, :width], given[:, :width].long(), mask)
    if mode == "R2":
        out["routes"] = own.clamp(min=0).to(shape.torch_dtype)
        out["routes_len"] = forwarded.sum(-1)
    return out
