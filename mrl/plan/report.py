"""A Plan as a text table (one row per group of identical pipeline stages) or as plain data (JSON)."""

from __future__ import annotations

from typing import Any

from mrl.plan.memory import Plan, StagePlan
from mrl.plan.rollout import kv_bytes_per_token
from mrl.plan.timing import CROWDED, Gpu, Lengths, RolloutTime, StepTime, lengths_of, pipeline_bubble

GB = 10**9


def gb(value: int) -> str:
    """GB with one decimal, or three significant digits below 10 GB (tiny models)."""
    value /= GB
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


def verdict(free: int) -> str:
    return f"fits ({gb(free)} GB free)" if free >= 0 else f"short by {gb(-free)} GB"


def _groups(stages: list[StagePlan]) -> list[list[StagePlan]]:
    """Runs of consecutive stages with the same memory (a pipeline's middle stages, usually)."""
    groups: list[list[StagePlan]] = []
    for stage in stages:
        key = (stage.state, stage.update, stage.engine, stage.in_flight, stage.host, stage.kept_while_generating)
        last = groups[-1][0] if groups else None
        if last and (last.state, last.update, last.engine, last.in_flight, last.host,
                     last.kept_while_generating) == key:
            groups[-1].append(stage)
        else:
            groups.append([stage])
    return groups


def _layers(stage: StagePlan) -> str:
    if not stage.layers:
        return "-"
    return f"{stage.layers[0]}-{stage.layers[-1]}" if len(stage.layers) > 1 else str(stage.layers[0])


def header(plan: Plan) -> list[str]:
    run, layout = plan.run, plan.run.layout
    mb = run.micro
    split = f" (last stage {layout.last_stage_layers} layers)" if layout.last_stage_layers else ""
    return [
        f"layout {layout.describe()}{split} · DP {run.dp} · expert-DP {run.expert_dp} on {run.world} actor GPUs "
        f"({run.gpus} in all) of {gb(plan.gpu_bytes)} GB; {run.dtype} weights, fp32 gradient buffers, "
        f"{'distributed' if run.distributed_optimizer else 'replicated'} Adam"
        + (f", {1 - run.optimizer_on_gpu:g} of it offloaded to host memory" if run.optimizer_on_gpu < 1 else "")
        + _recompute_words(run),
        f"update micro-batch: {mb.size} × {mb.seq} tokens"
        + (f" ({mb.seq // layout.cp} per CP rank; dense gradients and Adam over DP·CP {run.dp * layout.cp})"
           if layout.cp > 1 else "")
        + f", {run.micro_batches} per DP rank and step; "
        f"rollout: {'one' if run.engines == 1 else run.engines} TP{run.engine_tp} engine{'s' if run.engines > 1 else ''}, "
        f"{'colocated' if run.colocated else 'on their own GPUs' if run.engines > 1 else 'on its own GPUs'}",
        "GB per GPU (10^9 bytes); " + (("train: the update, engine asleep; generate: the engine awake beside "
                                        + ("the actor's weights only (trainer.offload_actor_during_rollout)"
                                           if run.offload_actor else "the actor's state"))
                                       if run.colocated else "the engine runs on its own GPUs"),
    ]


def _recompute_words(run) -> str:
    r = run.recompute
    if r.granularity == "full":
        return f"; full recompute, blocks of {r.num_layers} layer{'s' if r.num_layers > 1 else ''}"
    if r.granularity == "selective":
        return f"; selective recompute of {', '.join(r.modules or ('core_attn',))}"
    return ""


def table(plan: Plan) -> str:
    """The per-GPU table: each item, both phases, the verdict."""
    state = list(dict.fromkeys(k for s in plan.stages for k in s.state))
    update = list(dict.fromkeys(k for s in plan.stages for k in s.update))
    engine = any(s.engine for s in plan.stages)
    host = any(s.host for s in plan.stages)
    columns = (["stage", "layers"] + state + update + ["in flight"] + (["engine"] if engine else [])
               + ["train", "generate", "verdict"]
               + ([("host (offloaded state)" if plan.run.offload_actor else "host (offloaded optimizer)")] if host else []))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for group in _groups(plan.stages):
        s = group[0]
        label = str(s.stage) if len(group) == 1 else f"{s.stage}-{group[-1].stage}"
        cells = [label, ", ".join(_layers(g) for g in group)]
        cells += [gb(s.state[k]) if k in s.state else "-" for k in state]
        cells += [gb(s.update[k]) if k in s.update else "-" for k in update]
        cells.append(str(s.in_flight))
        cells += [gb(s.engine)] if engine else []
        cells += [gb(s.train_bytes), gb(s.generate_bytes) if s.engine else "-", verdict(plan.gpu_bytes - s.peak)]
        cells += [gb(s.host)] if host else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def engine_lines(plan: Plan) -> list[str]:
    e = plan.engine
    quant = f", {plan.run.quantization} weights" if plan.run.quantization else ""
    line = (f"rollout engine TP{e.tp} ({plan.run.engine_dtype}{quant}): weights {gb(e.weights)} GB per GPU, "
            f"KV cache {e.kv_per_token:,} B per token; budget {plan.run.gpu_memory_utilization} × "
            f"{gb(plan.gpu_bytes)} GB = {gb(e.budget)} GB")
    if e.kv_space <= 0:
        return [line, f"  does not fit: its weights exceed the budget by {gb(-e.kv_space)} GB"]
    needed = e.kv_per_token * e.max_model_len
    if not e.fits:
        return [line, f"  does not fit: {gb(e.kv_space)} GB left for KV, one {e.max_model_len}-token sequence needs {gb(needed)} GB"]
    share = f" ({-(-e.sequences // plan.run.engines)} per engine)" if plan.run.engines > 1 else ""
    return [line, f"  fits: {gb(e.kv_space)} GB for KV holds at most {e.concurrent_sequences} full-length sequences at "
                  f"once (per engine) of the step's {e.sequences}{share}"]


def notes(plan: Plan) -> list[str]:
    """What the numbers assume, where a reader could assume otherwise."""
    run, lines = plan.run, []
    if run.colocated and run.engines * run.engine_tp < run.world:
        lines.append(f"note: the engines occupy {run.engines * run.engine_tp} of the {run.world} GPUs; which ones is "
                     "Ray's choice, so every stage's generate column assumes it may be one of them.")
    if run.transformer_impl != "local":
        lines.append(f"note: model.transformer_impl {run.transformer_impl!r}: the activations are those of Megatron's "
                     "local layer spec (measured on CPU); Transformer Engine's fused layers save different tensors.")
    if run.offload_actor:
        lines.append("note: trainer.offload_actor_during_rollout: while the engine is awake only the actor's weights stay "
                     "(the weight push reads them; they leave after it); host (offloaded state) adds the pinned host "
                     "copies of everything that leaves, per GPU's rank.")
    elif run.optimizer_on_gpu < 1:
        lines.append("note: host (offloaded optimizer) is host memory per GPU's rank (fp32 copy, Adam moments and a "
                     "gradient copy of the offloaded elements); a node needs it times its GPUs, beyond the GPU column.")
    if run.recompute.granularity == "selective" and set(run.recompute.modules or ()) & {"layernorm", "mla_up_proj"}:
        lines.append("note: layernorm and mla_up_proj recompute are planned as not recomputed (an overestimate).")
    if plan.shape.moe:
        lines.append("note: routed-expert activations assume balanced routing; an imbalanced step holds more on "
                     "some ranks.")
    return lines


def duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    return f"{seconds / 60:.3g} min" if seconds < 7200 else f"{seconds / 3600:.3g} h"


def time_lines(plan: Plan, step: StepTime, lengths: Lengths, gpu: Gpu) -> list[str]:
    """The step's estimated time (mrl.plan.timing) and, when an engine holds far fewer sequences
    at once than the step asks of it, a warning naming the fixes."""
    run, r = plan.run, step.rollout
    longest = " (the longest the recipe allows)" if lengths == lengths_of(run.max_model_len, run.max_new_tokens) else ""
    basis = (f"  (a lower bound: decode at {gpu.bandwidth / GB:g} GB/s per GPU, prefill and update at "
             f"{gpu.efficiency:g} × {gpu.flops / 1e12:g} TFLOPS; no communication; docs/plan.md#rollout-time)")
    if r is None:
        return [f"rollout time: none (the engine holds no {lengths.total}-token sequence)", basis]
    bubble = pipeline_bubble(run.layout.pp, run.micro_batches)
    lines = [f"rollout time, estimated: {r.sequences} sequences per engine of {lengths.prompt} + {lengths.response} "
             f"tokens{longest}, {r.concurrency} at once: {r.waves} wave{'s' if r.waves > 1 else ''}, prefill "
             f"{duration(r.prefill_s)} + decode {duration(r.decode_s)} = {duration(r.seconds)} per step",
             f"update time, a FLOPs proxy: {duration(step.update_s)} (pipeline bubble {bubble:.3f}); "
             f"step ≈ {duration(step.seconds)} (rollout, then update)", basis]
    return lines + ([crowding_warning(plan, r)] if r.crowded else [])


def crowding_warning(plan: Plan, r: RolloutTime) -> str:
    e, run = plan.engine, plan.run
    replicated = e.tp > 1 and e.kv_per_token * e.tp > kv_bytes_per_token(plan.shape, 1, run.engine_dtype)
    more = ("more, smaller engines (the KV cache is replicated on the engine's GPUs: MLA's latent, or fewer KV heads "
            "than TP; a smaller rollout.tensor_parallel_size with more rollout.num_engines holds more sequences in all)"
            if replicated else "more GPUs for the engines (rollout.num_engines; launch.rollout_gpus when placed apart)")
    return (f"warning: each engine holds {r.concurrency} of the {r.sequences} sequences a step asks of it at once "
            f"(under 1/{CROWDED}): {r.waves} waves, {duration(r.seconds)}. Fixes: {more}; more KV memory "
            "(rollout.gpu_memory_utilization; rollout.quantization: fp8 halves the engine's weights); an FP8 KV cache "
            "(vLLM's kv_cache_dtype fp8, no mrl setting yet); shorter sequences (rollout.max_model_len, "
            "rollout.max_new_tokens).")


def render(plan: Plan, step: StepTime | None = None, lengths: Lengths | None = None, gpu: Gpu | None = None) -> str:
    lines = header(plan) + ["", table(plan), ""] + engine_lines(plan)
    if step is not None:
        lines += time_lines(plan, step, lengths, gpu)
    lines += notes(plan)
    lines += [f"problem: {p}" for p in plan.run.problems]
    if not plan.fits:
        lines.append("verdict: does not fit")
    else:
        lines.append("verdict: fits" + (", but the update refuses the batch (see problem)" if plan.run.problems else ""))
    return "\n".join(lines)


def to_dict(plan: Plan, step: StepTime | None = None) -> dict[str, Any]:
    run, layout, e = plan.run, plan.run.layout, plan.engine
    r = step.rollout if step else None
    time = None if step is None else dict(
        update_s=step.update_s, step_s=step.seconds if r else None,
        rollout=r and dict(sequences_per_engine=r.sequences, concurrency=r.concurrency, waves=r.waves,
                           prefill_s=r.prefill_s, decode_s=r.decode_s, seconds=r.seconds, crowded=r.crowded))
    return {
        "fits": plan.fits,
        "gpu_bytes": plan.gpu_bytes,
        "layout": dict(tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, etp=layout.expert_tp, vpp=layout.vpp,
                       first_stage_layers=layout.first_stage_layers, last_stage_layers=layout.last_stage_layers,
                       dp=run.dp, expert_dp=run.expert_dp, world=run.world, gpus=run.gpus),
        "micro_batch": dict(size=run.micro.size, seq=run.micro.seq, per_step=run.micro_batches),
        "stages": [dict(stage=s.stage, layers=s.layers, ranks=s.ranks, in_flight=s.in_flight, state=s.state,
                        update=s.update, engine=s.engine, host_bytes=s.host, train_bytes=s.train_bytes,
                        kept_while_generating=s.kept_while_generating,
                        generate_bytes=s.generate_bytes,
                        peak=s.peak,
                        free=plan.gpu_bytes - s.peak, fits=s.peak <= plan.gpu_bytes) for s in plan.stages],
        "engine": dict(tp=e.tp, weights=e.weights, kv_bytes_per_token=e.kv_per_token, budget=e.budget,
                       kv_space=e.kv_space, concurrent_sequences=e.concurrent_sequences, sequences=e.sequences,
                       fits=e.fits, dtype=run.engine_dtype, quantization=run.quantization),
        "problems": list(run.problems),
        "time": time,
    }
