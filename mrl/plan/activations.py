"""Activation memory of the actor's (or critic's) training step: the tensors autograd saves for backward.

The method of Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022, sec. 4): list every tensor a layer saves for its backward pass, per token, and scale by the
tokens each rank holds. Their GPT layer (34·s·b·h + 5·a·s²·b bytes) is replaced here by the layers
mrl builds (megatron-core 0.16.1's local spec: torch RMSNorm, SwiGLU, RoPE, MLA, sequential MoE
experts with the all-to-all dispatcher), no dropout. Each Row was read off the tensors the layers
save on CPU (benchmarks/plan_activations.py measures them with saved-tensor hooks and compares).
Each row has a token scope (`tokens`); the attention kernel (ATTENTION_KINDS), recomputation
(`selective_modules`, `recompute_bytes`) and the pipeline schedule (`in_flight`) decide what is
alive at a stage's peak (`stage_activations`).

The rules for recomputation, context parallelism and the pipeline, the measurements and what is not
modelled: docs/plan.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from mrl.config.schema import Recompute
from mrl.layout import ParallelLayout
from mrl.plan.params import padded_vocab
from mrl.plan.shapes import Chunk, ModelShape

F32, I64, BOOL = 4, 8, 1
# "flash": a fused kernel, saving q, k, v, the output and the log-sum-exp (GPUs, and the CPU for
# equal q/k and v head dims); "math": the CPU's fallback for MLA's unequal head dims, saving fp32
# copies of q, k, v and the s×s probabilities.
ATTENTION_KINDS = ("flash", "math")


@dataclass(frozen=True)
class MicroBatch:
    seq: int  # s: tokens per sequence (the whole sequence under CP), padded to a multiple of TP·2CP
    size: int  # b: sequences


@dataclass(frozen=True)
class Row:
    what: str
    scope: str  # "sp" | "seq" | "routed" | "rope"
    bytes_per_token: float  # "seq" rows of the math attention include the s-long probability rows


def _norm(what: str, width: int, scope: str = "sp", heads: float = 1) -> Row:
    # torch.rms_norm on bf16 input saves an fp32 copy of x, 1/rms and the fp32 normalized x.
    return Row(what, scope, heads * (8 * width + F32))


def cpu_attention(shape: ModelShape) -> str:
    """The kernel torch's CPU SDPA runs for mrl's attention: the fused one when q/k and v head dims
    are equal (causal, no mask), the math fallback otherwise (MLA). GPUs run a fused kernel."""
    if shape.mla and shape.mla.qk_nope + shape.mla.qk_rope != shape.mla.v_dim:
        return "math"
    return "flash"


def layer_rows(shape: ModelShape, layout: ParallelLayout, layer: int, mb: MicroBatch, e: int,
               attention: str = "flash", modules: tuple[str, ...] = ()) -> list[Row]:
    """The saved tensors of one transformer layer, per token of their scope (e: bytes per element
    of the model dtype); `modules`: the submodules selective recompute reruns in backward."""
    h = shape.hidden
    core = "checkpointed" if "core_attn" in modules else attention
    rows = [_norm("input norm", h), Row("attention input", "sp", h * e)]
    rows += (_mla(shape, layout, mb, e, core) if shape.mla else _gqa(shape, layout, mb, e, core))
    rows += [_norm("pre-MLP norm", h), Row("MLP input", "sp", h * e)]
    if shape.is_moe_layer(layer):
        rows += [] if "moe" in modules else _moe(shape, layout, e, "shared_experts" not in modules)
    elif "mlp" not in modules:
        rows.append(Row("MLP fc1..fc2", "seq", 5 * shape.ffn // layout.tp * e))
    return rows


def _gqa(shape: ModelShape, layout: ParallelLayout, mb: MicroBatch, e: int, attention: str) -> list[Row]:
    t, d = layout.tp, shape.head_dim
    heads, groups = shape.heads / t, shape.groups / t
    rows = []
    if shape.qk_norm:  # per-head RMSNorm of q and k
        rows += [_norm("q norm", d, "seq", heads), _norm("k norm", d, "seq", groups)]
    rows.append(Row("rotary cos/sin", "rope", 4 * d * e))
    # Fewer KV heads than heads: mrl's SDPA wrapper repeats k and v (new tensors). Otherwise v is a
    # view of the fused qkv projection's output, whose storage then stays alive whole.
    v_width = heads * d if shape.groups < shape.heads else (heads + 2 * groups) * d
    if attention == "checkpointed":  # the checkpoint keeps k and v before the repeat: v a view of qkv
        return rows + _core(heads, d, d, (heads + 2 * groups) * d, mb, e, attention, k_heads=groups)
    return rows + _core(heads, d, d, v_width, mb, e, attention, cp=layout.cp)


def _mla(shape: ModelShape, layout: ParallelLayout, mb: MicroBatch, e: int, attention: str) -> list[Row]:
    m, t = shape.mla, layout.tp
    heads = shape.heads / t
    rows = [
        _norm("q latent norm", m.q_rank), _norm("kv latent norm", m.kv_rank),
        Row("q up-projection input", "sp", m.q_rank * e), Row("kv up-projection input", "sp", m.kv_rank * e),
        Row("rotary cos/sin", "rope", 4 * m.qk_rope * e),
    ]
    # v is a view of the kv up-projection's output [heads·(qk_nope + v)], which stays alive whole.
    v_width = heads * (m.qk_nope + m.v_dim)
    return rows + _core(heads, m.qk_nope + m.qk_rope, m.v_dim, v_width, mb, e, attention, cp=layout.cp)


def _core(heads: float, qk_dim: int, v_dim: int, v_width: float, mb: MicroBatch, e: int, attention: str,
          k_heads: float | None = None, cp: int = 1) -> list[Row]:
    """Core attention and the output projection's input ("checkpointed": selective recompute's
    saved inputs q, k, v and the output, whatever the kernel)."""
    if cp > 1 and attention != "checkpointed":
        return _core_cp(heads, qk_dim, v_dim, mb, e, attention)
    if attention == "checkpointed":
        k_heads = heads if k_heads is None else k_heads
        return [Row("attention q, k (checkpoint inputs)", "seq", (heads + k_heads) * qk_dim * e),
                Row("attention v (checkpoint input)", "seq", v_width * e),
                Row("attention output", "seq", heads * v_dim * e)]
    if attention == "flash":
        return [Row("attention q, k", "seq", 2 * heads * qk_dim * e), Row("attention v", "seq", v_width * e),
                # the kernel's output is the output projection's input (one tensor)
                Row("attention output", "seq", heads * v_dim * e), Row("attention log-sum-exp", "seq", heads * F32)]
    if attention == "math":
        return [Row("attention q, k (fp32)", "seq", 2 * heads * qk_dim * F32),
                Row("attention v (fp32)", "seq", heads * v_dim * F32),
                Row("attention probabilities (fp32)", "seq", heads * mb.seq * F32),
                Row("output projection input", "seq", heads * v_dim * e)]
    raise ValueError(f"attention {attention!r} is not one of {ATTENTION_KINDS}")


def _core_cp(heads: float, qk_dim: int, v_dim: int, mb: MicroBatch, e: int, attention: str) -> list[Row]:
    """Core attention under CP (megatron_patches/sdpa_attention.py): the kernel saves this rank's
    queries and its outputs (s/CP tokens), the keys and values all-gathered over the CP group (the
    whole sequence: new tensors, so v is no longer a view of the projection's output; GQA repeats
    them to the heads after the gather). The flash kernel also saves the explicit mask [s/CP, s]
    that replaces the built-in causal one: one tensor shared by every layer and micro-batch
    (sdpa_attention.causal_mask), counted once per stage (`_saves_cp_mask`), not here."""
    if attention == "flash":
        return [Row("attention q", "seq", heads * qk_dim * e),
                Row("attention k, v (gathered over CP)", "gathered", heads * (qk_dim + v_dim) * e),
                Row("attention output", "seq", heads * v_dim * e), Row("attention log-sum-exp", "seq", heads * F32)]
    if attention == "math":
        return [Row("attention q (fp32)", "seq", heads * qk_dim * F32),
                Row("attention k, v (fp32, gathered over CP)", "gathered", heads * (qk_dim + v_dim) * F32),
                Row("attention probabilities (fp32)", "seq", heads * mb.seq * F32),
                Row("output projection input", "seq", heads * v_dim * e)]
    raise ValueError(f"attention {attention!r} is not one of {ATTENTION_KINDS}")


def _moe(shape: ModelShape, layout: ParallelLayout, e: int, shared: bool = True) -> list[Row]:
    moe, h = shape.moe, shape.hidden
    k, experts = moe.topk, moe.experts
    if moe.score == "sigmoid":  # group-limited sigmoid routing (DeepSeek-V3)
        router = experts * (F32 + BOOL) + moe.groups * 2 * I64 + moe.group_topk * I64 + k * (I64 + F32) + F32
    else:  # softmax over the top-k logits (or over all, then top-k)
        router = k * (I64 + F32) + (experts * F32 if moe.pre_softmax else 0)
    rows = [
        Row("router", "sp", router),
        Row("dispatcher routing map, probabilities, permutation", "sp", experts * (BOOL + F32) + k * I64),
        # per routed token: the permuted input, fc1's gate+up output, silu, up, their product, the
        # product scaled by the routing probability, and that probability (fp32)
        Row("routed experts", "routed", h * e + 6 * moe.ffn // layout.expert_tp * e + F32),
    ]
    if moe.shared_ffn and shared:
        rows.append(Row("shared expert fc1..fc2", "seq", 5 * moe.shared_ffn // layout.tp * e))
    return rows


def head_rows(shape: ModelShape, layout: ParallelLayout, e: int, value_head: bool) -> list[Row]:
    """The last stage's final norm, output layer and loss (mrl.megatron.policy: the vocab-parallel
    cross-entropy keeps its fp32 softmax [s, b, V/TP]; the critic's value head gathers the sequence)."""
    h, t = shape.hidden, layout.tp
    rows = [_norm("final norm", h)]
    if value_head:
        return rows + [Row("value head input (gathered)", "seq" if t > 1 else "sp", h * e)]
    vocab = padded_vocab(shape.vocab, t) // t
    return rows + [Row("output layer input", "sp", h * e),
                   Row("cross-entropy softmax (fp32), target mask and ids", "seq", vocab * F32 + BOOL + I64)]


def embedding_rows(layout: ParallelLayout) -> list[Row]:
    # token ids (int64); with TP also the mask of ids outside this rank's vocabulary slice
    return [Row("token ids", "seq", I64 + (BOOL if layout.tp > 1 else 0))]


# Token scopes: "sp" rows live on the sequence-parallel slice (s·b/TP tokens); "seq" rows on the
# whole sequence with TP-sharded widths; "routed" rows on the tokens this rank's experts process
# (s·b/TP·topk·ETP with balanced routing); "rope" rows on s positions (not per sequence). Context
# parallelism divides each of these by CP (a rank holds s/CP of every sequence); its core attention
# adds "gathered" rows (the keys and values of the whole sequence, s·b) and, once per stage, the
# flash kernel's "mask" ([s/CP, s], shared by every layer and micro-batch).
def tokens(scope: str, shape: ModelShape, layout: ParallelLayout, mb: MicroBatch) -> float:
    """Tokens of a scope on one rank (balanced routing for "routed"); a CP rank holds s/CP of each
    sequence, except the keys and values gathered over CP ("gathered": all s) and the CP attention
    mask ("mask": s/CP queries × s keys, one for the whole step whatever b)."""
    local = mb.seq * mb.size / layout.cp
    if scope == "sp":
        return local / layout.tp
    if scope == "seq":
        return local
    if scope == "routed":
        return local / layout.tp * shape.moe.topk * layout.expert_tp
    if scope == "rope":
        return mb.seq / layout.cp
    if scope == "gathered":
        return mb.seq * mb.size
    if scope == "mask":
        return mb.seq / layout.cp * mb.seq
    raise ValueError(f"unknown token scope {scope!r}")


def rows_bytes(rows: list[Row], shape: ModelShape, layout: ParallelLayout, mb: MicroBatch) -> int:
    return round(sum(r.bytes_per_token * tokens(r.scope, shape, layout, mb) for r in rows))


def _saves_cp_mask(layout: ParallelLayout, attention: str, recompute: Recompute) -> bool:
    """Whether the forward saves CP's causal mask (one tensor for every layer and micro-batch): the
    flash kernel's, unless core attention is recomputed (then only the layer being recomputed
    holds it, within the recompute working set)."""
    recomputed = recompute.granularity == "full" or "core_attn" in selective_modules(recompute)
    return layout.cp > 1 and attention == "flash" and not recomputed


# Recomputation (model.recompute, Megatron's recompute_granularity): "full" keeps only each block's
# input ([s/TP, b, h]; blocks of recompute_num_layers layers) and, while one block is
# back-propagated, that block's layers' rows again; "selective" drops the rows of the recomputed
# submodules (core attention keeps its inputs q, k, v, GQA's k and v before the repeat, and loses the
# kernel's own saves; "mlp"/"moe"/"shared_experts" keep only their input, already a row) and adds
# back one layer's dropped rows while that layer is back-propagated. "layernorm" and "mla_up_proj"
# are planned as if not recomputed (an overestimate; Megatron frees their outputs' storage in place,
# which saved-tensor hooks cannot see, so they are not measured either).
def selective_modules(recompute: Recompute) -> tuple[str, ...]:
    """The submodules whose rows selective recompute drops (Megatron's default: core attention)."""
    if recompute.granularity != "selective":
        return ()
    return ("core_attn",) if recompute.modules is None else recompute.modules


def chunk_bytes(shape: ModelShape, layout: ParallelLayout, chunk: Chunk, mb: MicroBatch, e: int,
                attention: str = "flash", value_head: bool = False, recompute: Recompute = Recompute()) -> int:
    """Saved-for-backward bytes of one micro-batch's forward through `chunk` (loss included)."""
    rows = embedding_rows(layout) if chunk.embedding else []
    if recompute.granularity == "full":  # one checkpointed input per block of layers
        blocks = -(-len(chunk.layers) // recompute.num_layers)
        rows += [Row("block input (full recompute)", "sp", shape.hidden * e)] * blocks
    else:
        for layer in chunk.layers:
            rows += layer_rows(shape, layout, layer, mb, e, attention, selective_modules(recompute))
    if chunk.head:
        rows += head_rows(shape, layout, e, value_head)
    return rows_bytes(rows, shape, layout, mb)


def recompute_bytes(shape: ModelShape, layout: ParallelLayout, chunk: Chunk, mb: MicroBatch, e: int,
                    attention: str, recompute: Recompute) -> int:
    """What recomputation holds again while one block (full) or layer (selective) of `chunk` is
    back-propagated: the rows its forward would have saved (less, for selective, what it kept)."""
    if recompute.granularity == "none" or not chunk.layers:
        return 0
    layers, most = list(chunk.layers), 0
    if recompute.granularity == "full":
        for start in range(0, len(layers), recompute.num_layers):
            rows = [r for layer in layers[start : start + recompute.num_layers]
                    for r in layer_rows(shape, layout, layer, mb, e, attention)]
            most = max(most, rows_bytes(rows, shape, layout, mb))
        return most
    modules = selective_modules(recompute)
    for layer in layers:
        full = rows_bytes(layer_rows(shape, layout, layer, mb, e, attention), shape, layout, mb)
        kept = rows_bytes(layer_rows(shape, layout, layer, mb, e, attention, modules), shape, layout, mb)
        most = max(most, full - kept)
    return most


# 1F1B (megatron/core/pipeline_parallel/schedules.py, get_pp_rank_microbatches): stage p runs
# PP-p-1 warm-up forwards, so PP-p micro-batches are in flight at its peak (interleaved: the first
# 2(PP-p-1)+(VPP-1)·PP+1 entries of the schedule table).
def in_flight(layout: ParallelLayout, stage: int, micro_batches: int) -> list[int]:
    """The model chunk of each forward pass alive at stage `stage`'s activation peak."""
    pp, vpp = layout.pp, layout.virtual_stages or 1
    if pp == 1:
        return [0]
    if vpp == 1:
        return [0] * min(pp - stage, micro_batches)
    warmup = 2 * (pp - stage - 1) + (vpp - 1) * pp  # microbatch_group_size_per_vp_stage = PP
    order = [chunk for group in range(0, micro_batches, pp) for chunk in range(vpp)
             for _ in range(group, min(group + pp, micro_batches))]  # get_schedule_table's forwards
    return order[: min(warmup + 1, len(order))]


@dataclass(frozen=True)
class StageActivations:
    saved: int  # tensors autograd saves for backward, over the in-flight micro-batches
    # the schedule's received inputs and sent outputs of those micro-batches (kept, as
    # deallocate_pipeline_outputs is off; not saved tensors, so the CPU measurement does not see them)
    pipeline: int
    in_flight: int

    @property
    def total(self) -> int:
        return self.saved + self.pipeline


def stage_activations(shape: ModelShape, layout: ParallelLayout, chunks: list[Chunk], mb: MicroBatch, e: int,
                      micro_batches: int, attention: str = "flash", value_head: bool = False,
                      recompute: Recompute = Recompute()) -> StageActivations:
    """Activation bytes at a stage's peak: the in-flight forwards' saved tensors, plus the pipeline
    schedule's copy of each one's received input (not on the first stage) and sent output (not on
    the last). With recomputation, the backward pass of one micro-batch holds one block's (or
    layer's) rows again; its loss rows are gone by then (the head is back-propagated first)."""
    alive = in_flight(layout, chunks[0].stage, micro_batches)
    per_chunk = [chunk_bytes(shape, layout, c, mb, e, attention, value_head, recompute) for c in chunks]
    boundary = tokens("sp", shape, layout, mb) * shape.hidden * e if layout.pp > 1 else 0
    saved = sum(per_chunk[i] for i in alive)
    if recompute.granularity != "none":
        head = [rows_bytes(head_rows(shape, layout, e, value_head), shape, layout, mb) if c.head else 0 for c in chunks]
        saved += max(max(0, recompute_bytes(shape, layout, chunks[i], mb, e, attention, recompute) - head[i])
                     for i in set(alive))
    if _saves_cp_mask(layout, attention, recompute):
        saved += tokens("mask", shape, layout, mb) * e
    pipeline = sum(boundary * ((not chunks[i].embedding) + (not chunks[i].head)) for i in alive)
    return StageActivations(saved, round(pipeline), len(alive))
