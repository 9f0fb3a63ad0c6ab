"""The model sizes a memory plan needs, read from a ModelSpec, and which layers each pipeline chunk holds.

Pure Python: the plan runs on a laptop from config.json alone. The layer split follows
megatron-core 0.16.1's `get_transformer_layer_offset` (uneven first/last stage, or PP×VPP equal
chunks where chunk c of stage p holds virtual stage c·PP + p).
"""

from __future__ import annotations

from dataclasses import dataclass

from mrl.layout import ParallelLayout
from mrl.models.registry import ModelSpec, moe_layer_pattern


class PlanError(ValueError):
    """Input the plan cannot work with; the message names the problem and the fix."""


@dataclass(frozen=True)
class MLADims:
    q_rank: int
    kv_rank: int
    qk_nope: int
    qk_rope: int
    v_dim: int


@dataclass(frozen=True)
class MoEDims:
    experts: int
    ffn: int
    shared_ffn: int  # 0: no shared expert
    topk: int
    groups: int  # group-limited routing (DeepSeek-V3); 0: none
    group_topk: int
    score: str  # "softmax" | "sigmoid"
    pre_softmax: bool
    moe_layers: tuple[bool, ...]  # per global layer: MoE (True) or dense MLP


@dataclass(frozen=True)
class ModelShape:
    arch: str
    layers: int
    hidden: int
    heads: int
    groups: int  # query groups (KV heads)
    head_dim: int  # kv_channels
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool  # per-head q/k RMSNorm (Qwen3); MLA's latent norms are part of MLADims
    mla: MLADims | None
    moe: MoEDims | None

    @classmethod
    def of(cls, spec: ModelSpec) -> "ModelShape":
        c = spec.config
        mla = None
        if spec.mla:
            if c.get("q_lora_rank") is None:
                raise PlanError(f"{spec.arch} without q_lora_rank (no query down-projection) is not modelled by "
                                "mrl plan: only DeepSeek-V3-style MLA with a q_lora_rank is.")
            mla = MLADims(c["q_lora_rank"], c["kv_lora_rank"], c["qk_head_dim"], c["qk_pos_emb_head_dim"],
                          c["v_head_dim"])
        moe = None
        if c.get("num_moe_experts"):
            moe_layers = tuple(bool(x) for x in moe_layer_pattern(c.get("moe_layer_freq", 1), c["num_layers"]))
            moe = MoEDims(
                experts=c["num_moe_experts"], ffn=c["moe_ffn_hidden_size"],
                shared_ffn=c.get("moe_shared_expert_intermediate_size") or 0, topk=c["moe_router_topk"],
                groups=c.get("moe_router_num_groups") or 0, group_topk=c.get("moe_router_group_topk") or 0,
                score=c.get("moe_router_score_function", "softmax"),
                pre_softmax=bool(c.get("moe_router_pre_softmax", False)), moe_layers=moe_layers,
            )
        return cls(
            arch=spec.arch, layers=c["num_layers"], hidden=c["hidden_size"], heads=c["num_attention_heads"],
            groups=c.get("num_query_groups") or c["num_attention_heads"], head_dim=c["kv_channels"],
            ffn=c["ffn_hidden_size"], vocab=spec.vocab_size, tied=spec.tie_word_embeddings,
            qkv_bias=bool(c.get("add_qkv_bias")), qk_norm=bool(c.get("qk_layernorm")) and not spec.mla,
            mla=mla, moe=moe,
        )

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.moe_layers[layer]


@dataclass(frozen=True)
class Chunk:
    """One model chunk of a pipeline stage: its global layer indices (0-based) and whether it holds
    the embedding (first chunk of stage 0) or the final norm and output layer (last chunk of the
    last stage)."""

    stage: int
    index: int  # virtual chunk (0 without VPP)
    layers: tuple[int, ...]
    embedding: bool
    head: bool


def stage_chunks(layers: int, layout: ParallelLayout, stage: int) -> list[Chunk]:
    """The chunks pipeline stage `stage` holds, as Megatron assigns them."""
    pp, vpp = layout.pp, layout.virtual_stages or 1
    last = stage == pp - 1
    if vpp > 1:
        per = layers // (pp * vpp)
        return [Chunk(stage, c, tuple(range((c * pp + stage) * per, (c * pp + stage + 1) * per)),
                      embedding=stage == 0 and c == 0, head=last and c == vpp - 1) for c in range(vpp)]
    counts = stage_layer_counts(layers, layout)
    start = sum(counts[:stage])
    return [Chunk(stage, 0, tuple(range(start, start + counts[stage])), embedding=stage == 0, head=last)]


def stage_layer_counts(layers: int, layout: ParallelLayout) -> list[int]:
    """Layers per pipeline stage (no VPP): the uneven first/last stage, the rest split evenly."""
    first, last, pp = layout.first_stage_layers, layout.last_stage_layers, layout.pp
    if pp == 1:
        return [layers]
    middle_stages = pp - (first is not None) - (last is not None)
    middle = layers - (first or 0) - (last or 0)
    per = middle // middle_stages if middle_stages else 0
    counts = [per] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def model_shape(model_path: str, tiny: str | None = None) -> ModelShape:
    """The shape of the recipe's model: a tiny-zoo architecture, or the config.json under
    model.path (nothing else of the checkpoint is read)."""
    from mrl.models.registry import UnsupportedModelError, model_spec_from_hf

    try:
        if tiny is not None:
            from mrl.models.tiny import tiny_hf_config

            return ModelShape.of(model_spec_from_hf(tiny_hf_config(tiny)))
        if not model_path:
            raise PlanError("model.path is empty: set it to a directory with the model's config.json "
                            "(only config.json is read).")
        return ModelShape.of(model_spec_from_hf(model_path))
    except (UnsupportedModelError, ValueError) as exc:
        if isinstance(exc, PlanError):
            raise
        raise PlanError(f"model.path: {exc}") from None
