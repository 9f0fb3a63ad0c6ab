"""The parameter tensors one rank's model chunk holds, in the order Megatron registers them.

Each tensor's element count is its TP/ETP/EP shard, as megatron-core 0.16.1 builds the local
(non-Transformer-Engine) layer spec that mrl uses: torch norms keep fp32 weights whatever the
model dtype, the router weight is in the model dtype, the experts' weights are
"expert" (reduced over the expert-data-parallel group) only when EP > 1 (`allreduce = not
expert_parallel` in megatron/core/transformer/moe/experts.py), and a tied embedding is repeated on
the last pipeline stage with `shared_embedding` set. The order matters: the DDP buffer pads each
parameter's start to a multiple of 64 (mrl.plan.ddp), so sizes depend on the sequence.
tests/distributed/test_plan_static.py compares these lists with meta-device builds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mrl.layout import ParallelLayout
from mrl.plan.shapes import Chunk, ModelShape

FP32 = "fp32"


@dataclass(frozen=True)
class ParamTensor:
    name: str
    numel: int
    dtype: str  # "bf16", "fp16" or "fp32"
    expert: bool = False  # gradient reduced over the expert-data-parallel group
    shared_embedding: bool = False  # the distributed optimizer gives it a bucket of its own


def padded_vocab(vocab: int, tp: int, divisor: int = 128) -> int:
    """Megatron-LM's vocabulary padding (as mrl.megatron.model.padded_vocab_size): a multiple of divisor·TP."""
    return math.ceil(vocab / (divisor * tp)) * divisor * tp


def chunk_params(shape: ModelShape, layout: ParallelLayout, chunk: Chunk, dtype: str,
                 value_head: bool = False) -> list[ParamTensor]:
    """The parameters of `chunk` on one rank (every rank of a stage holds equal-sized shards)."""
    tp, h = layout.tp, shape.hidden
    vocab_rows = padded_vocab(shape.vocab, tp) // tp
    # Tied weights: the last stage holds a copy of the embedding (none when it is also the first).
    tied = shape.tied and not value_head
    params = []
    if chunk.embedding:
        params.append(ParamTensor("embedding.word_embeddings.weight", vocab_rows * h, dtype,
                                  shared_embedding=tied and layout.pp > 1))
    for local, layer in enumerate(chunk.layers):  # Megatron numbers a chunk's layers from 0
        prefix = f"decoder.layers.{local}."
        params.append(ParamTensor(prefix + "input_layernorm.weight", h, FP32))
        params += [ParamTensor(prefix + "self_attention." + n, numel, dt)
                   for n, numel, dt in _attention(shape, tp, dtype)]
        params.append(ParamTensor(prefix + "pre_mlp_layernorm.weight", h, FP32))
        params += [ParamTensor(prefix + "mlp." + n, numel, dtype, expert)
                   for n, numel, expert in _mlp(shape, layout, layer)]
    if chunk.head:
        params.append(ParamTensor("decoder.final_layernorm.weight", h, FP32))
        if value_head:  # mrl.megatron.value_head.ValueHead: one scalar per position, on every TP rank
            params += [ParamTensor("output_layer.weight", h, dtype), ParamTensor("output_layer.bias", 1, dtype)]
        elif not (tied and chunk.embedding):
            params.append(ParamTensor("output_layer.weight", vocab_rows * h, dtype, shared_embedding=tied))
    return params


def _attention(shape: ModelShape, tp: int, dtype: str) -> list[tuple[str, int, str]]:
    """(name, shard numel, dtype) of one layer's attention, in registration order."""
    h, heads = shape.hidden, shape.heads
    if shape.mla:
        m = shape.mla
        return [
            ("linear_proj.weight", h * heads * m.v_dim // tp, dtype),
            ("linear_q_down_proj.weight", m.q_rank // tp * h, dtype),
            ("linear_q_up_proj.weight", heads * (m.qk_nope + m.qk_rope) // tp * m.q_rank, dtype),
            ("linear_kv_down_proj.weight", (m.kv_rank + m.qk_rope) // tp * h, dtype),
            ("linear_kv_up_proj.weight", heads * (m.qk_nope + m.v_dim) // tp * m.kv_rank, dtype),
            ("q_layernorm.weight", m.q_rank, FP32),
            ("kv_layernorm.weight", m.kv_rank, FP32),
        ]
    d = shape.head_dim
    qkv_rows = (heads + 2 * shape.groups) * d // tp
    params = [("linear_proj.weight", h * heads * d // tp, dtype), ("linear_qkv.weight", qkv_rows * h, dtype)]
    if shape.qkv_bias:
        params.append(("linear_qkv.bias", qkv_rows, dtype))
    if shape.qk_norm:
        params += [("q_layernorm.weight", d, FP32), ("k_layernorm.weight", d, FP32)]
    return params


def _mlp(shape: ModelShape, layout: ParallelLayout, layer: int) -> list[tuple[str, int, bool]]:
    """(name, shard numel, expert) of one layer's MLP: SwiGLU (fc1 holds gate and up), or router,
    this rank's routed experts (ETP-sharded) and the shared expert (TP-sharded)."""
    h, tp = shape.hidden, layout.tp
    if not shape.is_moe_layer(layer):
        return [("linear_fc1.weight", 2 * shape.ffn // tp * h, False), ("linear_fc2.weight", h * (shape.ffn // tp), False)]
    moe, etp = shape.moe, layout.expert_tp
    expert = layout.ep > 1
    params = [("router.weight", moe.experts * h, False)]
    for e in range(moe.experts // layout.ep):
        params += [(f"experts.local_experts.{e}.linear_fc1.weight", 2 * moe.ffn // etp * h, expert),
                   (f"experts.local_experts.{e}.linear_fc2.weight", h * (moe.ffn // etp), expert)]
    if moe.shared_ffn:
        params += [("shared_experts.linear_fc1.weight", 2 * moe.shared_ffn // tp * h, False),
                   ("shared_experts.linear_fc2.weight", h * (moe.shared_ffn // tp), False)]
    return params
