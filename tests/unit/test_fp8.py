"""DeepSeek's block-scaled FP8 (mrl/quant/fp8.py), bitwise against a slow reference written from the
format's definition: e4m3fn decoded from its bit layout, one scale per 128×128 block (partial at
the edges), scale = amax / 448, value = round-to-nearest-even(w / scale)."""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mrl.quant.fp8 import (
    BLOCK, FP8, QUANTIZATION_CONFIG, QUANTIZED_WEIGHT, BlockFp8, Fp8FormatError, block_fp8_of, check_scale,
    dequantize, quantize, quantize_pairs, scale_grid,
)

# e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0 is subnormal; 0x7F is NaN.
# The finite non-negative values by code 0..126, increasing with the code.
E4M3 = [m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7) for code in range(0x7F) for e, m in [(code >> 3, code & 7)]]


def _e4m3_code(x: float) -> int:
    """The e4m3fn byte nearest to x, ties to the even code (= even mantissa), saturating at 448."""
    mag = abs(x)
    i = bisect.bisect_left(E4M3, mag)
    if i == len(E4M3):
        code = len(E4M3) - 1
    elif E4M3[i] == mag:
        code = i
    else:
        below, above = mag - E4M3[i - 1], E4M3[i] - mag
        code = i - 1 if below < above or (below == above and (i - 1) % 2 == 0) else i
    return code | (0x80 if math.copysign(1.0, x) < 0 else 0)


def reference_quantize(w: torch.Tensor, bn: int = 128, bk: int = 128) -> tuple[list[list[int]], list[list[np.float32]]]:
    """(e4m3 codes, float32 scales), one block and one element at a time."""
    x = w.float().tolist()
    rows, cols = w.shape
    codes = [[0] * cols for _ in range(rows)]
    scales = [[np.float32(0)] * math.ceil(cols / bk) for _ in range(math.ceil(rows / bn))]
    for br in range(len(scales)):
        for bc in range(len(scales[0])):
            cells = [(i, j) for i in range(br * bn, min(rows, (br + 1) * bn)) for j in range(bc * bk, min(cols, (bc + 1) * bk))]
            scale = np.float32(max(abs(x[i][j]) for i, j in cells)) / np.float32(448)
            scale = scale if scale > 0 else np.float32(1)
            scales[br][bc] = scale
            for i, j in cells:
                codes[i][j] = _e4m3_code(float(np.float32(x[i][j]) / scale))
    return codes, scales


def reference_dequantize(codes: list[list[int]], scales: list[list[np.float32]], bn: int = 128, bk: int = 128) -> torch.Tensor:
    out = [[np.float32(E4M3[c & 0x7F] * (-1 if c & 0x80 else 1)) * scales[i // bn][j // bk] for j, c in enumerate(row)]
           for i, row in enumerate(codes)]
    return torch.tensor(np.array(out, dtype=np.float32))


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """N(0, 0.05²) with crafted blocks: all zeros, a lone value, and ties of the e4m3 grid."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    if rows > 128 and cols > 128:
        w[128:, :128] = 0  # a whole (partial) block of zeros
    # amax 448 → scale exactly 1, so these are e4m3 ties: 1.0625 → 1.0, 1.1875 → 1.25,
    # 2⁻¹⁰ → 0 (tie between 0 and the smallest subnormal), 3·2⁻¹⁰ → 2⁻⁸; and a negative zero.
    ties = [448.0, 1.0625, -1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, -0.0, -3.0]
    if cols >= 128 + len(ties):
        w[:128, 128:256] = 0
        w[0, 128:128 + len(ties)] = torch.tensor(ties)
    return w


SHAPES = [(1, 1), (5, 300), (130, 129), (257, 64), (128, 256)]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_quantize_and_dequantize_bitwise_against_the_reference(shape):
    w = _weight(*shape)
    q, scale_inv = quantize(w)
    codes, scales = reference_quantize(w)
    assert q.dtype == FP8 and q.shape == w.shape
    assert scale_inv.dtype == torch.float32 and tuple(scale_inv.shape) == scale_grid(shape) == (len(scales), len(scales[0]))
    assert torch.equal(scale_inv, torch.tensor(np.array(scales, dtype=np.float32)))
    assert torch.equal(q.view(torch.uint8), torch.tensor(codes, dtype=torch.uint8))
    expected = reference_dequantize(codes, scales)
    assert torch.equal(dequantize(q, scale_inv), expected)
    assert torch.equal(dequantize(q, scale_inv, dtype=torch.bfloat16), expected.to(torch.bfloat16))


def test_crafted_blocks_land_where_the_format_says():
    q, scale_inv = quantize(_weight(130, 200))
    assert scale_inv[1, 0] == 1 and not q[128:, :128].float().any()  # all-zero block: scale 1, zeros
    assert scale_inv[0, 1] == 1
    assert q[0, 128:136].float().tolist() == [448.0, 1.0, -1.0, 1.25, 0.0, 2.0**-8, -0.0, -3.0]
    assert q[0, 134].view(torch.uint8) == 0x80  # the sign of zero survives


def test_a_bf16_weight_quantises_as_its_float32_value():
    w = _weight(130, 200).to(torch.bfloat16)
    for a, b in zip(quantize(w), quantize(w.float())):
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8 else b)


def test_round_trip_error_is_within_half_an_e4m3_step():
    w = torch.randn(300, 400, generator=torch.Generator().manual_seed(1)) * 0.02
    q, scale_inv = quantize(w)
    scale = scale_inv.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :400]
    err = (dequantize(q, scale_inv) - w).abs()
    # Half a step of e4m3: 2⁻⁴ relative for normal values, 2⁻¹⁰ absolute below 2⁻⁶ (subnormals),
    # in units of the block scale; plus one float32 rounding of the product.
    bound = scale * torch.maximum((w / scale).abs() * 2.0**-4, torch.tensor(2.0**-10)) + w.abs() * 2.0**-23
    assert (err <= bound).all()
    assert (err > 0.5 * bound).any()  # the bound is tight, not vacuous
    assert torch.equal(q.float().abs().amax(), torch.tensor(448.0))  # each block's amax maps to 448


@pytest.mark.parametrize("rows, cols", [(100, 260), (20, 2)])
def test_dequantizing_a_window_equals_the_window_of_the_whole(rows, cols):
    q, scale_inv = quantize(_weight(300, 400))
    whole = dequantize(q, scale_inv)
    for r0, c0 in [(0, 0), (27, 127), (127, 128), (200, 398 - cols + 2)]:
        window = q[r0 : r0 + rows, c0 : c0 + cols]
        got = dequantize(window, scale_inv, offset=(r0, c0))
        assert torch.equal(got, whole[r0 : r0 + rows, c0 : c0 + cols]), (r0, c0)


def test_transformers_dequantises_whole_blocks_identically_and_refuses_partial_ones():
    """The convention check against HF: transformers' Fp8Dequantize gives the same bits; it cannot
    read a partial edge block (DeepSeek-V3's kv_a_proj_with_mqa has 576 = 4.5·128 rows)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    q, scale_inv = quantize(_weight(256, 384))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(Fp8Dequantize(None)._dequantize_one(q, scale_inv, dtype), dequantize(q, scale_inv, dtype=dtype))
    q, scale_inv = quantize(_weight(576, 128))
    with pytest.raises(ValueError, match="not divisible by scale grid"):
        Fp8Dequantize(None)._dequantize_one(q, scale_inv, torch.float32)


def test_bad_inputs_are_named():
    with pytest.raises(Fp8FormatError, match=r"'x.weight' .*shape \[4\].*2-D"):
        quantize(torch.ones(4), name="x.weight")
    with pytest.raises(Fp8FormatError, match="'x.weight': it holds inf or NaN"):
        quantize(torch.tensor([[1.0, float("nan")]]), name="x.weight")
    with pytest.raises(Fp8FormatError, match=r"x.weight_scale_inv has shape \[1, 1\] but weight 'x.weight' \[130, 64\] "
                                             r"in \[128, 128\] blocks needs \[2, 1\]"):
        check_scale("x.weight", (130, 64), (1, 1))
    with pytest.raises(Fp8FormatError, match="float8_e4m3fn values and float32 scales"):
        dequantize(torch.zeros(2, 2), torch.ones(1, 1))


def test_quantization_config_is_deepseeks():
    real = json.loads((Path(__file__).parents[1] / "fixtures/deepseek_v3_671b/config.json").read_text())
    assert real["quantization_config"] == QUANTIZATION_CONFIG
    assert block_fp8_of(real) == BlockFp8((128, 128)) and BLOCK == (128, 128)
    assert block_fp8_of({}) is None


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "awq"}, "quant_method='awq'"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt='e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "weight_block_size=None: only block-scaled FP8"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\]"),
])
def test_unsupported_quantization_configs_are_refused(config, message):
    with pytest.raises(Fp8FormatError, match=message):
        block_fp8_of({"quantization_config": config})


# DeepSeek-V3's release: linear projections in FP8; embeddings, head, norms and the router not.
RELEASE_NAMES = {
    "model.layers.0.self_attn.q_a_proj.weight": True,
    "model.layers.0.self_attn.q_b_proj.weight": True,
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": True,
    "model.layers.0.self_attn.kv_b_proj.weight": True,
    "model.layers.0.self_attn.o_proj.weight": True,
    "model.layers.0.mlp.gate_proj.weight": True,
    "model.layers.0.mlp.down_proj.weight": True,
    "model.layers.3.mlp.experts.255.up_proj.weight": True,
    "model.layers.3.mlp.shared_experts.down_proj.weight": True,
    "model.layers.61.eh_proj.weight": False,  # MTP (never imported): no rule needed for it
    "model.layers.3.mlp.gate.weight": False,
    "model.layers.3.mlp.gate.e_score_correction_bias": False,
    "model.layers.0.self_attn.q_a_layernorm.weight": False,
    "model.layers.0.self_attn.kv_a_layernorm.weight": False,
    "model.layers.0.input_layernorm.weight": False,
    "model.layers.0.post_attention_layernorm.weight": False,
    "model.embed_tokens.weight": False,
    "model.norm.weight": False,
    "lm_head.weight": False,
}


def test_which_tensors_are_quantised():
    assert {n: bool(QUANTIZED_WEIGHT.match(n)) for n in RELEASE_NAMES} == RELEASE_NAMES


def test_quantize_pairs_adds_a_scale_after_each_quantised_weight():
    norm, proj = torch.ones(64), _weight(130, 64)
    out = list(quantize_pairs([("model.layers.0.input_layernorm.weight", norm),
                               ("model.layers.0.self_attn.o_proj.weight", proj)]))
    assert [n for n, _ in out] == ["model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.o_proj.weight",
                                   "model.layers.0.self_attn.o_proj.weight_scale_inv"]
    assert out[0][1] is norm
    q, scale_inv = quantize(proj)
    assert torch.equal(out[1][1].view(torch.uint8), q.view(torch.uint8)) and torch.equal(out[2][1], scale_inv)
