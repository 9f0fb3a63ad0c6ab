"""Layouts of a recipe that fit a GPU count: every TP × PP × EP × ETP the model and world allow,
planned, the fitting ones ranked, the others with the reason they do not fit.

Ranking, best first: the fewest pipeline bubbles ((PP-1)/(M+PP-1) of a 1F1B step with M
micro-batches per DP rank, Narayanan et al. 2021), then the most data parallelism, then the most
free memory on the tightest GPU. TP stays within a node (NVLink); a pipeline that does not divide
the layers evenly gives its last stage the remainder, as the DeepSeek-V3 recipe does (16+16+16+13).
The rollout engine's TP is chosen first (it does not depend on the actor's layout): the smallest
power of two whose engine fits, preferring one node. Not searched: VPP (the recipe's own is
dropped), uneven first stages, micro-batch sizes, the rollout settings, and context parallelism:
the recipe's parallel.cp is kept in every layout (CP trades data parallelism for activation memory
and adds an all-gather of K and V per layer, which this ranking does not weigh).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mrl.config.schema import RunConfig
from mrl.layout import ParallelLayout
from mrl.plan.memory import EnginePlan, Plan, Run, engine_plan, plan
from mrl.plan.report import gb
from mrl.plan.shapes import ModelShape, PlanError


@dataclass
class Rejected:
    layout: ParallelLayout
    reason: str
    shortfall: int | None = None  # bytes over the GPU, when it is memory
    plan: Plan | None = None


@dataclass
class SearchResult:
    engine_tp: int
    engines: list[EnginePlan]  # one per engine TP tried
    fits: list[Plan]
    rejected: list[Rejected]
    problems: tuple[str, ...]  # the recipe's own, whatever the layout (a token budget too small)


def bubble(p: Plan) -> float:
    pp, m = p.run.layout.pp, p.run.micro_batches
    return (pp - 1) / (m + pp - 1)


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def layouts(shape: ModelShape, world: int, node: int, cp: int = 1) -> list[ParallelLayout]:
    """Every layout worth planning at context-parallel size `cp`: TP within a node, PP up to the
    layer count, EP and ETP ∈ {1, TP} for MoE models; sizes powers of two dividing the world."""
    found = []
    for tp in _powers_of_two(min(node, world // cp)):
        for pp in _powers_of_two(min(world // (tp * cp), shape.layers)):
            possible, split = _split(shape.layers, pp)
            if not possible:
                continue
            experts = [(1, None)]
            if shape.moe:
                experts = [(ep, etp) for ep in _powers_of_two(min(shape.moe.experts, world // pp))
                           for etp in sorted({1, tp}) if world % (ep * etp * pp) == 0]
            found += [ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp, last_stage_layers=split, cp=cp)
                      for ep, etp in experts]
    return found


def _split(layers: int, pp: int) -> tuple[bool, int | None]:
    """Whether `pp` stages can hold the layers, and last_stage_layers (None: an even split)."""
    if layers % pp == 0:
        return True, None
    last = layers - (pp - 1) * -(-layers // pp)
    return last >= 1, last


def _with_layout(cfg: RunConfig, layout: ParallelLayout, engine_tp: int) -> RunConfig:
    parallel = replace(cfg.parallel, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp, cp=layout.cp, vpp=None,
                       first_stage_layers=None, last_stage_layers=layout.last_stage_layers)
    return replace(cfg, parallel=parallel, rollout=replace(cfg.rollout, tensor_parallel_size=engine_tp))


def _engine_choice(cfg: RunConfig, shape: ModelShape, gpus: int, gpu_bytes: int, node: int) -> tuple[int, list[EnginePlan]]:
    """The engine at every TP that divides the heads and the rollout GPUs; the chosen TP: the
    smallest that fits within a node, else the smallest that fits, else the configured one."""
    rollout_gpus = cfg.launch.rollout_gpus if cfg.launch.placement == "separate" else gpus
    tried = [engine_plan(shape, cfg, tp, gpu_bytes) for tp in _powers_of_two(rollout_gpus) if shape.heads % tp == 0]
    fitting = [e.tp for e in tried if e.fits]
    chosen = min((t for t in fitting if t <= node), default=min(fitting, default=cfg.rollout.tensor_parallel_size))
    return chosen, tried


def search(cfg: RunConfig, shape: ModelShape, gpus: int, gpu_bytes: int) -> SearchResult:
    node = cfg.launch.gpus_per_node or 8
    engine_tp, engines = _engine_choice(cfg, shape, gpus, gpu_bytes, node)
    world = cfg.parallel.world_size or gpus - (cfg.launch.rollout_gpus if cfg.launch.placement == "separate" else 0)
    fits, rejected = [], []
    for layout in layouts(shape, world, node, cfg.parallel.cp):
        try:
            p = plan(shape, Run.of(_with_layout(cfg, layout, engine_tp), shape, gpus), gpu_bytes)
        except PlanError as exc:
            rejected.append(Rejected(layout, str(exc)))
            continue
        if p.run.split_problems:
            rejected.append(Rejected(layout, p.run.split_problems[0], plan=p))
        elif p.fits:
            fits.append(p)
        else:
            rejected.append(Rejected(layout, _why(p), -p.margin if p.margin < 0 else None, p))
    fits.sort(key=lambda p: (bubble(p), -p.run.dp, -p.margin))
    rejected.sort(key=lambda r: (r.shortfall is None, r.shortfall or 0))
    problems = next((p.run.budget_problems for p in fits + [r.plan for r in rejected if r.plan]), ())
    return SearchResult(engine_tp, engines, fits, rejected, problems)


def _why(p: Plan) -> str:
    if not p.engine.fits:
        return f"the TP{p.engine.tp} rollout engine does not fit its budget"
    worst = min(p.stages, key=lambda s: p.gpu_bytes - s.peak)
    train = worst.train_bytes >= worst.generate_bytes
    items = worst.state | (worst.update if train else {"rollout engine": worst.engine})
    biggest = max(items, key=items.get)
    return (f"stage {worst.stage} needs {gb(worst.peak)} GB ({'train' if train else 'generate'}; largest: "
            f"{biggest} {gb(items[biggest])} GB)")


def render(result: SearchResult, top: int = 10) -> str:
    lines = ["rollout engine options:", "| engine TP | weights GB/GPU | KV space GB/GPU | full-length sequences at once | fits |",
             "|---|---|---|---|---|"]
    for e in result.engines:
        lines.append(f"| {e.tp} | {gb(e.weights)} | {gb(max(e.kv_space, 0))} | {e.concurrent_sequences} | "
                     f"{'yes' if e.fits else 'no'} |")
    lines.append(f"chosen: TP{result.engine_tp}\n")
    lines += [f"problem (every layout): {p}" for p in result.problems] + ([""] if result.problems else [])
    if result.fits:
        lines += [f"{len(result.fits)} layouts fit; the best {min(top, len(result.fits))}:",
                  "| layout | DP | micro-batches | bubble | tightest GPU free GB |", "|---|---|---|---|---|"]
        lines += [f"| {p.run.layout.describe()} | {p.run.dp} | {p.run.micro_batches} | {bubble(p):.3f} | {gb(p.margin)} |"
                  for p in result.fits[:top]]
    else:
        lines.append("no layout fits.")
    lines += ["", f"{len(result.rejected)} layouts do not fit; the nearest {min(top, len(result.rejected))}:",
              "| layout | why not |", "|---|---|"]
    lines += [f"| {r.layout.describe()} | {r.reason} |" for r in result.rejected[:top]]
    return "\n".join(lines)
