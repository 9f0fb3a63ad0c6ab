"""Mapping tables: Megatron parameter names → HuggingFace names and how the tensor is sharded.

The single source of truth for the HF importer, the exporter, the vLLM sync and the merge CLI.
A table key is a *global* Megatron name (layer index counted over all pipeline stages, expert id
counted over all EP ranks) with `{layer}` / `{expert}` placeholders; the value says which HF
tensors it holds and how TP ranks split it.

Every split is described by `segments()`: the rows of HF tensors that one rank's shard consists of,
in order. Import reads exactly those rows; export writes the received shards back into them. The
same description drives both directions, so a round trip is an identity by construction.

Shape legend: np attention heads, ng query groups (KV heads), hd head dim, V vocab, Vp padded vocab.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from mrl.models.registry import ModelSpec


class Split(Enum):
    REPLICATED = "replicated"  # every rank holds the whole tensor
    COLUMN = "column"  # rows split over ranks (ColumnParallelLinear weight)
    ROW = "row"  # columns split over ranks (RowParallelLinear weight)
    VOCAB = "vocab"  # rows split over ranks, padded from V to Vp rows
    QKV = "qkv"  # rows of interleaved [q_g | k | v] per query group, then split over ranks
    GATED = "gated"  # each rank holds [gate_r; up_r]: its rows of gate_proj, then of up_proj


@dataclass(frozen=True)
class Rule:
    hf: tuple[str, ...]
    split: Split
    expert: bool = False  # sharded over the expert-tensor-parallel group instead of TP
    export: bool = True  # False for a tied copy whose twin is exported

    def resolve(self, layer: int | None, expert: int | None) -> tuple[str, ...]:
        return tuple(name.format(layer=layer, expert=expert) for name in self.hf)


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of HF tensor `hf` (None: zero padding rows); `cols` for ROW splits."""

    hf: str | None
    start: int
    stop: int
    cols: tuple[int, int] | None = None

    @property
    def rows(self) -> int:
        return self.stop - self.start


R, C, W, V, QKV, G = Split.REPLICATED, Split.COLUMN, Split.ROW, Split.VOCAB, Split.QKV, Split.GATED
L, HL = "decoder.layers.{layer}.", "model.layers.{layer}."

EMBEDDINGS = {
    "embedding.word_embeddings.weight": Rule(("model.embed_tokens.weight",), V),
    "decoder.final_layernorm.weight": Rule(("model.norm.weight",), R),
    "output_layer.weight": Rule(("lm_head.weight",), V),
}
# Tied embeddings: the last stage's output layer is a copy of the embedding, never exported.
TIED_OUTPUT = {"output_layer.weight": Rule(("model.embed_tokens.weight",), V, export=False)}

_INPUT_NORM = Rule((HL + "input_layernorm.weight",), R)
GQA_ATTENTION = {
    L + "input_layernorm.weight": _INPUT_NORM,
    L + "self_attention.linear_qkv.layer_norm_weight": _INPUT_NORM,  # TE spec spelling
    L + "self_attention.linear_qkv.weight": Rule(tuple(HL + f"self_attn.{p}_proj.weight" for p in "qkv"), QKV),
    L + "self_attention.linear_proj.weight": Rule((HL + "self_attn.o_proj.weight",), W),
}
QKV_BIAS = {
    L + "self_attention.linear_qkv.bias": Rule(tuple(HL + f"self_attn.{p}_proj.bias" for p in "qkv"), QKV),
}
QK_NORM = {
    L + "self_attention.q_layernorm.weight": Rule((HL + "self_attn.q_norm.weight",), R),
    L + "self_attention.k_layernorm.weight": Rule((HL + "self_attn.k_norm.weight",), R),
}
_Q_A_NORM = Rule((HL + "self_attn.q_a_layernorm.weight",), R)
_KV_A_NORM = Rule((HL + "self_attn.kv_a_layernorm.weight",), R)
MLA_ATTENTION = {
    L + "input_layernorm.weight": _INPUT_NORM,
    # Local spec: the down-projections are column-parallel. Under TE they are duplicated on every
    # TP rank; parameters marked tensor_model_parallel=False are treated as replicated.
    L + "self_attention.linear_q_proj.weight": Rule((HL + "self_attn.q_proj.weight",), C),
    L + "self_attention.linear_q_down_proj.weight": Rule((HL + "self_attn.q_a_proj.weight",), C),
    L + "self_attention.q_layernorm.weight": _Q_A_NORM,
    L + "self_attention.linear_q_up_proj.layer_norm_weight": _Q_A_NORM,
    L + "self_attention.linear_q_up_proj.weight": Rule((HL + "self_attn.q_b_proj.weight",), C),
    L + "self_attention.linear_kv_down_proj.weight": Rule((HL + "self_attn.kv_a_proj_with_mqa.weight",), C),
    L + "self_attention.kv_layernorm.weight": _KV_A_NORM,
    L + "self_attention.linear_kv_up_proj.layer_norm_weight": _KV_A_NORM,
    L + "self_attention.linear_kv_up_proj.weight": Rule((HL + "self_attn.kv_b_proj.weight",), C),
    L + "self_attention.linear_proj.weight": Rule((HL + "self_attn.o_proj.weight",), W),
}
_POST_NORM = Rule((HL + "post_attention_layernorm.weight",), R)
DENSE_MLP = {
    L + "pre_mlp_layernorm.weight": _POST_NORM,
    L + "mlp.linear_fc1.layer_norm_weight": _POST_NORM,  # TE spec spelling
    L + "mlp.linear_fc1.weight": Rule((HL + "mlp.gate_proj.weight", HL + "mlp.up_proj.weight"), G),
    L + "mlp.linear_fc2.weight": Rule((HL + "mlp.down_proj.weight",), W),
}
_EXPERT = L + "mlp.experts.local_experts.{expert}."
_HF_EXPERT = HL + "mlp.experts.{expert}."
MOE = {
    L + "pre_mlp_layernorm.weight": _POST_NORM,
    L + "mlp.router.weight": Rule((HL + "mlp.gate.weight",), R),
    _EXPERT + "linear_fc1.weight": Rule((_HF_EXPERT + "gate_proj.weight", _HF_EXPERT + "up_proj.weight"), G, expert=True),
    _EXPERT + "linear_fc2.weight": Rule((_HF_EXPERT + "down_proj.weight",), W, expert=True),
}
ROUTER_EXPERT_BIAS = {  # an fp32 buffer in Megatron, not a parameter
    L + "mlp.router.expert_bias": Rule((HL + "mlp.gate.e_score_correction_bias",), R),
}
SHARED_EXPERTS = {
    L + "mlp.shared_experts.linear_fc1.weight": Rule(
        (HL + "mlp.shared_experts.gate_proj.weight", HL + "mlp.shared_experts.up_proj.weight"), G
    ),
    L + "mlp.shared_experts.linear_fc2.weight": Rule((HL + "mlp.shared_experts.down_proj.weight",), W),
}

TABLES: dict[str, tuple[dict[str, Rule], ...]] = {
    "llama": (EMBEDDINGS, GQA_ATTENTION, DENSE_MLP),
    "qwen2": (EMBEDDINGS, GQA_ATTENTION, QKV_BIAS, DENSE_MLP),
    "qwen3": (EMBEDDINGS, GQA_ATTENTION, QK_NORM, DENSE_MLP),
    "qwen3_moe": (EMBEDDINGS, GQA_ATTENTION, QK_NORM, DENSE_MLP, MOE),
    "deepseek_v3": (EMBEDDINGS, MLA_ATTENTION, DENSE_MLP, MOE, ROUTER_EXPERT_BIAS, SHARED_EXPERTS),
}

# Transformer Engine's grouped experts name weights `experts.linear_fc1.weight{i}`; SequentialMLP
# names them `experts.local_experts.{i}.linear_fc1.weight`. Tables use the latter.
_TE_GROUPED = re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


class MappingError(KeyError):
    """A Megatron tensor that the architecture's mapping table does not cover."""

    def __str__(self) -> str:  # KeyError quotes its message; this one is a sentence
        return str(self.args[0])


def table_for(spec: ModelSpec) -> dict[str, Rule]:
    table: dict[str, Rule] = {}
    for part in TABLES[spec.arch]:
        table.update(part)
    if spec.tie_word_embeddings:
        table.update(TIED_OUTPUT)
    return table


def canonical_name(name: str) -> str:
    return _TE_GROUPED.sub(r"mlp.experts.local_experts.\2.\1.weight", name)


def template_of(global_name: str) -> tuple[str, int | None, int | None]:
    """'decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight' → (template, 3, 5)."""
    layer = expert = None
    if m := _LAYER.match(global_name):
        layer = int(m.group(1))
        global_name = _LAYER.sub(L, global_name, count=1)
    if m := _LOCAL_EXPERT.search(global_name):
        expert = int(m.group(1))
        global_name = _LOCAL_EXPERT.sub(".local_experts.{expert}.", global_name, count=1)
    return global_name, layer, expert


def lookup(table: dict[str, Rule], global_name: str, arch: str) -> tuple[Rule, tuple[str, ...]]:
    """The rule for a global Megatron name and its resolved HF names."""
    template, layer, expert = template_of(canonical_name(global_name))
    if template not in table:
        raise MappingError(
            f"no {arch} mapping for Megatron tensor {global_name!r} (template {template!r}); "
            "add it to mrl/bridge/mapping.py"
        )
    rule = table[template]
    return rule, rule.resolve(layer, expert)


def global_shape(split: Split, local_shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    """Shape of the tensor formed by all `size` shards of a split."""
    if split is Split.REPLICATED or size == 1:
        return tuple(local_shape)
    if split is Split.ROW:
        return (local_shape[0], local_shape[1] * size, *local_shape[2:])
    return (local_shape[0] * size, *local_shape[1:])


@dataclass(frozen=True)
class SplitDims:
    """Model sizes the QKV and VOCAB splits need."""

    num_heads: int
    num_query_groups: int
    vocab_size: int

    @classmethod
    def of(cls, spec: ModelSpec) -> "SplitDims":
        heads = spec.config["num_attention_heads"]
        return cls(heads, spec.config.get("num_query_groups") or heads, spec.vocab_size)


def segments(
    split: Split, names: tuple[str, ...], shape: tuple[int, ...], rank: int, size: int, dims: SplitDims
) -> list[Segment]:
    """The HF rows that make up shard `rank` of `size` of a Megatron tensor of global `shape`."""
    rows = shape[0]
    if split is Split.REPLICATED:
        return [Segment(names[0], 0, rows)]
    if split is Split.ROW:
        width = shape[1] // size
        return [Segment(names[0], 0, rows, (rank * width, (rank + 1) * width))]
    if split is Split.COLUMN:
        return _take(rows // size * rank, rows // size * (rank + 1), [Segment(names[0], 0, rows)])
    if split is Split.VOCAB:
        full = [Segment(names[0], 0, dims.vocab_size), Segment(None, 0, rows - dims.vocab_size)]
        return _take(rows // size * rank, rows // size * (rank + 1), full)
    if split is Split.GATED:
        part = rows // 2 // size  # each rank holds [its gate rows; its up rows]
        return [Segment(name, part * rank, part * (rank + 1)) for name in names]
    if split is Split.QKV:
        return _take(rows // size * rank, rows // size * (rank + 1), _qkv_layout(names, rows, dims))
    raise ValueError(split)


def _qkv_layout(names: tuple[str, ...], rows: int, dims: SplitDims) -> list[Segment]:
    """Megatron's fused QKV rows: per query group, its g query heads, then its key, then its value."""
    ng, g = dims.num_query_groups, dims.num_heads // dims.num_query_groups
    hd = rows // (dims.num_heads + 2 * ng)
    q, k, v = names
    layout = []
    for group in range(ng):
        layout += [
            Segment(q, group * g * hd, (group + 1) * g * hd),
            Segment(k, group * hd, (group + 1) * hd),
            Segment(v, group * hd, (group + 1) * hd),
        ]
    return layout


def _take(start: int, stop: int, layout: list[Segment]) -> list[Segment]:
    """Rows [start, stop) of the concatenation of `layout`, as segments."""
    taken, offset = [], 0
    for seg in layout:
        lo, hi = max(start, offset), min(stop, offset + seg.rows)
        if lo < hi:
            base = seg.start - offset
            taken.append(Segment(seg.hf, base + lo, base + hi, seg.cols))
        offset += seg.rows
    return taken


def hf_shapes(
    split: Split, names: tuple[str, ...], shape: tuple[int, ...], shards: int, dims: SplitDims
) -> dict[str, tuple[int, ...]]:
    """Shapes of the HF tensors that all shards of a Megatron tensor of global `shape` make up."""
    rows: dict[str, int] = {}
    for rank in range(shards):
        for seg in segments(split, names, shape, rank, shards, dims):
            if seg.hf is not None:
                rows[seg.hf] = max(rows.get(seg.hf, 0), seg.stop)
    return {name: (rows[name], *shape[1:]) for name in names}
