"""vLLM 0.32's parameter layout per architecture, as data: the sync plan (mrl/sync/plan.py) reads it,
and the config check reads which architectures have it. Add an architecture with one row in each
table below (its rules read from vllm/model_executor/models/<arch>.py: `stacked_params_mapping`,
`expert_params_mapping`, and the weight_loader of QKVParallelLinear / MergedColumnParallelLinear /
FusedMoE for the offsets)."""

from __future__ import annotations

# --- vLLM 0.32's fusion rules (data) -------------------------------------------------------------
# A fused engine module: the HF modules stacked into it along dim 0 of its weight (and bias), in
# order, each with its per-rank length rule: "split" (1/tp of the HF rows), or "kv" (the rows left
# after the split parts, shared equally; K/V heads are replicated when there are fewer than TP
# ranks, vLLM's QKVParallelLinear), or "whole" (replicated: ReplicatedLinear's fused MLA input).
_QKV = ("qkv_proj", (("q_proj", "split"), ("k_proj", "kv"), ("v_proj", "kv")))
_GATE_UP = ("gate_up_proj", (("gate_proj", "split"), ("up_proj", "split")))
_MLA_A = ("fused_qkv_a_proj", (("q_a_proj", "whole"), ("kv_a_proj_with_mqa", "whole")))
# FusedMoE's stacked experts live in a `routed_experts` child of the HF `experts` module (vLLM 0.32).
EXPERT_MODULE = "routed_experts"
# FusedMoE's stacked experts: engine parameter → (HF leaf module, rule) pieces of experts.{e}.
_EXPERTS = {"w13_weight": (("gate_proj", "split"), ("up_proj", "split")), "w2_weight": (("down_proj", "row"),)}

FUSIONS: dict[str, dict] = {
    "llama": {"stacked": dict([_QKV, _GATE_UP]), "experts": {}},
    "qwen2": {"stacked": dict([_QKV, _GATE_UP]), "experts": {}},
    "qwen3": {"stacked": dict([_QKV, _GATE_UP]), "experts": {}},
    "qwen3_moe": {"stacked": dict([_QKV, _GATE_UP]), "experts": _EXPERTS},
    "deepseek_v3": {"stacked": dict([_MLA_A, _GATE_UP]), "experts": _EXPERTS},
}
# What an in-place apply must redo after writing, per architecture, in order (the hooks are in
# mrl/rollout/vllm_weights.py POST_APPLY_HOOKS): kernel formats derived from linear weights (CPU
# GEMM packing, the LM head's), the CPU fused experts' packing, MLA's absorbed W_UK_T/W_UV.
POST_APPLY: dict[str, tuple[str, ...]] = {
    "llama": ("kernel_formats",), "qwen2": ("kernel_formats",), "qwen3": ("kernel_formats",),
    "qwen3_moe": ("kernel_formats", "cpu_experts"),
    "deepseek_v3": ("kernel_formats", "cpu_experts", "mla_absorb"),
}

# Unfused engine modules split across TP ranks, by HF leaf module: the weight's split dimension
# (0: column parallel, its bias split too; 1: row parallel, its bias replicated). Vocab-parallel
# ones are padded: rows past the HF vocabulary are padding, which no sync writes.
TP_DIMS = {"o_proj": 1, "down_proj": 1, "q_b_proj": 0, "kv_b_proj": 0, "q_proj": 0}
VOCAB = ("embed_tokens", "lm_head")
