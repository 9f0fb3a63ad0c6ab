"""Memory of a vLLM rollout engine on each of its GPUs: weights and KV cache.

The engine's tensor-parallel shards follow vLLM's model code (vllm 0.32, model_executor/models):
column/row-parallel projections, MLPs and the routed experts (FusedMoE without expert
parallelism: every rank holds every expert's 1/TP slice) split over TP; norms, the MoE router
and MLA's latent down-projection (`fused_qkv_a_proj`, ReplicatedLinear) are replicated; the
vocabulary is padded to a multiple of 64 and split. MLA keeps a second copy of its kv
up-projection in the activation dtype (W_UK_T, W_UV in layers/attention/mla_attention.py).
With `rollout.quantization: fp8` the linear and expert weights take 1 byte; embedding, output
head, norms and router stay in the model dtype.

KV cache per token and layer: MLA caches the compressed latent (kv_lora_rank + qk_rope_head_dim)
on every TP rank (it is not split over heads); other attention caches K and V of this rank's KV
heads (at least one: vLLM replicates KV heads when TP exceeds their number).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mrl.plan.ddp import DTYPE_BYTES
from mrl.plan.shapes import ModelShape, PlanError

VLLM_VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
WEIGHT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
QUANTIZATIONS = (None, "fp8")


@dataclass(frozen=True)
class EngineWeights:
    """Parameters per engine GPU: `linear` are quantizable (projections, MLPs, experts), `other`
    stay in the model dtype (embedding, head, norms, router); `mla_copy` is MLA's bf16 copy;
    `routed` the routed experts' part of `linear` (a decode step reads only the experts it uses)."""

    linear: int
    other: int
    mla_copy: int
    routed: int


def engine_parameters(shape: ModelShape, tp: int) -> EngineWeights:
    h = shape.hidden
    linear = other = mla_copy = routed = 0
    for layer in range(shape.layers):
        other += 2 * h  # input and post-attention norms
        attn_linear, attn_other, copy = _attention(shape, tp)
        linear += attn_linear
        other += attn_other
        mla_copy += copy
        if shape.is_moe_layer(layer):
            moe = shape.moe
            other += moe.experts * h + (moe.experts if moe.score == "sigmoid" else 0)  # router (+ its bias)
            experts = moe.experts * 3 * h * moe.ffn // tp
            linear += experts + 3 * h * moe.shared_ffn // tp
            routed += experts
        else:
            linear += 3 * h * shape.ffn // tp
    vocab_rows = math.ceil(math.ceil(shape.vocab / VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING / tp)
    other += vocab_rows * h * (1 if shape.tied else 2) + h  # embedding, head, final norm
    return EngineWeights(linear, other, mla_copy, routed)


def _attention(shape: ModelShape, tp: int) -> tuple[int, int, int]:
    """(linear, other, MLA copy) parameters of one layer's attention on one engine GPU."""
    h, heads = shape.hidden, shape.heads
    if shape.mla:
        m = shape.mla
        replicated_down = h * (m.q_rank + m.kv_rank + m.qk_rope)
        kv_up = heads * (m.qk_nope + m.v_dim) // tp * m.kv_rank
        linear = (replicated_down + heads * (m.qk_nope + m.qk_rope) // tp * m.q_rank + kv_up
                  + h * heads * m.v_dim // tp)
        return linear, m.q_rank + m.kv_rank, kv_up
    d = shape.head_dim
    kv_heads = max(1, shape.groups // tp)
    qkv_rows = heads // tp * d + 2 * kv_heads * d
    other = qkv_rows * shape.qkv_bias + 2 * d * shape.qk_norm
    return qkv_rows * h + h * heads * d // tp, other, 0


def engine_weight_bytes(shape: ModelShape, tp: int, dtype: str, quantization: str | None) -> int:
    if quantization not in QUANTIZATIONS:
        raise PlanError(f"rollout.quantization {quantization!r} is not modelled: use one of "
                        f"{', '.join(str(q) for q in QUANTIZATIONS)}.")
    params = engine_parameters(shape, tp)
    element = DTYPE_BYTES[WEIGHT_DTYPES[dtype]]
    linear = 1 if quantization == "fp8" else element
    return params.linear * linear + params.other * element + params.mla_copy * element


def kv_bytes_per_token(shape: ModelShape, tp: int, dtype: str) -> int:
    """KV cache bytes per token over all layers on one engine GPU (vLLM's kv_cache_dtype "auto":
    the model dtype)."""
    element = DTYPE_BYTES[WEIGHT_DTYPES[dtype]]
    if shape.mla:
        per_layer = shape.mla.kv_rank + shape.mla.qk_rope
    else:
        per_layer = 2 * max(1, shape.groups // tp) * shape.head_dim
    return per_layer * element * shape.layers
