"""Layouts of a recipe that fit a GPU count: every TP × PP × EP × ETP the model and world allow,
planned, the fitting ones ranked by estimated step time, the others with the reason they do not fit.

The rollout engines are chosen first (they do not depend on the actor's layout): at each TP, as
many engines as fill the rollout GPUs; the one with the shortest estimated rollout (mrl.plan.timing)
wins, within one node if any fits there (the estimate has no term for all-reduces between nodes).
Layouts rank by that rollout plus the update's FLOPs proxy, which among layouts differs only by
the pipeline bubble; then the most data parallelism, then the most free memory on the tightest
GPU. TP stays within a node; a pipeline that does not divide the layers evenly gives its last stage
the remainder (16+16+16+13). Not searched: VPP, uneven first stages, micro-batch sizes, the
rollout's lengths, dtype and memory share, and context parallelism (the recipe's parallel.cp is
kept: it trades data parallelism for activation memory, which this ranking does not weigh).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mrl.config.schema import RunConfig
from mrl.layout import ParallelLayout
from mrl.plan.memory import EnginePlan, Plan, Run, engine_plan, plan
from mrl.plan.report import duration, gb
from mrl.plan.shapes import ModelShape, PlanError
from mrl.plan.timing import Gpu, Lengths, RolloutTime, StepTime, engine_rollout, lengths_of, pipeline_bubble, step_time


@dataclass
class Rejected:
    layout: ParallelLayout
    reason: str
    shortfall: int | None = None  # bytes over the GPU, when it is memory
    plan: Plan | None = None


@dataclass
class EngineOption:
    engine: EnginePlan
    count: int  # engines of this TP that fill the rollout GPUs
    rollout: RolloutTime | None  # None: not one sequence fits


@dataclass
class SearchResult:
    engine: EngineOption  # the chosen engines
    engines: list[EngineOption]  # one per engine TP tried
    fits: list[Plan]
    times: list[StepTime]  # times[i]: fits[i]'s estimate
    rejected: list[Rejected]
    problems: tuple[str, ...]  # the recipe's own, whatever the layout (a token budget too small)

    @property
    def engine_tp(self) -> int:
        return self.engine.engine.tp


def bubble(p: Plan) -> float:
    return pipeline_bubble(p.run.layout.pp, p.run.micro_batches)


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


def _with_layout(cfg: RunConfig, layout: ParallelLayout, engine: EngineOption) -> RunConfig:
    parallel = replace(cfg.parallel, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp, cp=layout.cp, vpp=None,
                       first_stage_layers=None, last_stage_layers=layout.last_stage_layers)
    node = cfg.launch.gpus_per_node  # an engine wider than a node spans as many as it needs
    rollout = replace(cfg.rollout, tensor_parallel_size=engine.engine.tp, num_engines=engine.count,
                      nodes_per_engine=-(-engine.engine.tp // node) if node else 1)
    return replace(cfg, parallel=parallel, rollout=rollout)


def _engine_choice(cfg: RunConfig, shape: ModelShape, gpus: int, gpu_bytes: int, node: int, lengths: Lengths,
                   gpu: Gpu) -> tuple[EngineOption, list[EngineOption]]:
    """The engines at every TP that divides the heads and the rollout GPUs, as many as fill them;
    the chosen: the shortest estimated rollout within a node, else overall (then the smaller TP);
    when none holds a sequence, the recipe's own."""
    r = cfg.rollout
    rollout_gpus = cfg.launch.rollout_gpus if cfg.launch.placement == "separate" else gpus
    tried = []
    for tp in _powers_of_two(rollout_gpus):
        if shape.heads % tp == 0:
            engine, count = engine_plan(shape, cfg, tp, gpu_bytes), rollout_gpus // tp
            tried.append(EngineOption(engine, count, engine_rollout(shape, engine, r.dtype, r.quantization, count,
                                                                    lengths, gpu, gpu_bytes)))
    fitting = sorted((o for o in tried if o.engine.fits and o.rollout),
                     key=lambda o: (o.engine.tp > node, o.rollout.seconds, o.engine.tp))
    if fitting:
        return fitting[0], tried
    own = engine_plan(shape, cfg, r.tensor_parallel_size, gpu_bytes)
    return EngineOption(own, r.num_engines, None), tried


def search(cfg: RunConfig, shape: ModelShape, gpus: int, gpu_bytes: int, gpu: Gpu,
           lengths: tuple[int | None, int | None] = (None, None)) -> SearchResult:
    """`lengths`: the prompt and response tokens to estimate with (None: the longest the recipe allows)."""
    node = cfg.launch.gpus_per_node or 8
    planned = lengths_of(cfg.rollout.max_model_len, cfg.rollout.max_new_tokens, *lengths)
    engine, engines = _engine_choice(cfg, shape, gpus, gpu_bytes, node, planned, gpu)
    world = cfg.parallel.world_size or gpus - (cfg.launch.rollout_gpus if cfg.launch.placement == "separate" else 0)
    fits, rejected = [], []
    for layout in layouts(shape, world, node, cfg.parallel.cp):
        try:
            p = plan(shape, Run.of(_with_layout(cfg, layout, engine), shape, gpus), gpu_bytes)
        except PlanError as exc:
            rejected.append(Rejected(layout, str(exc)))
            continue
        if p.run.split_problems:
            rejected.append(Rejected(layout, p.run.split_problems[0], plan=p))
        elif p.fits:
            fits.append(p)
        else:
            rejected.append(Rejected(layout, _why(p), -p.margin if p.margin < 0 else None, p))
    ranked = sorted(((p, step_time(p, planned, gpu)) for p in fits), key=lambda pt: (pt[1].seconds, -pt[0].run.dp,
                                                                                       -pt[0].margin))
    rejected.sort(key=lambda r: (r.shortfall is None, r.shortfall or 0))
    problems = next((p.run.budget_problems for p in fits + [r.plan for r in rejected if r.plan]), ())
    return SearchResult(engine, engines, [p for p, _ in ranked], [t for _, t in ranked], rejected, problems)


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
    lines = ["rollout engine options (as many engines as fill the rollout GPUs):",
             "| engine TP | engines | weights GB/GPU | KV space GB/GPU | sequences at once per engine | waves | "
             "rollout (estimate) | fits |", "|---|---|---|---|---|---|---|---|"]
    for o in result.engines:
        e, r = o.engine, o.rollout
        lines.append(f"| {e.tp} | {o.count} | {gb(e.weights)} | {gb(max(e.kv_space, 0))} | "
                     f"{r.concurrency if r else 0} | {r.waves if r else '-'} | {duration(r.seconds) if r else '-'} | "
                     f"{'yes' if e.fits else 'no'} |")
    lines.append(f"chosen: {result.engine.count} TP{result.engine_tp} engine{'s' if result.engine.count > 1 else ''}\n")
    lines += [f"problem (every layout): {p}" for p in result.problems] + ([""] if result.problems else [])
    if result.fits:
        lines += [f"{len(result.fits)} layouts fit; the fastest {min(top, len(result.fits))} (estimated step: "
                  "rollout, then the update's FLOPs proxy):",
                  "| layout | DP | micro-batches | bubble | update (proxy) | step (estimate) | tightest GPU free GB |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {p.run.layout.describe()} | {p.run.dp} | {p.run.micro_batches} | {bubble(p):.3f} | "
                  f"{duration(t.update_s)} | {duration(t.seconds)} | {gb(p.margin)} |"
                  for p, t in zip(result.fits[:top], result.times)]
    else:
        lines.append("no layout fits.")
    lines += ["", f"{len(result.rejected)} layouts do not fit; the nearest {min(top, len(result.rejected))}:",
              "| layout | why not |", "|---|---|"]
    lines += [f"| {r.layout.describe()} | {r.reason} |" for r in result.rejected[:top]]
    return "\n".join(lines)
