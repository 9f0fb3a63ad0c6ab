"""DeepSeek-V3's FP8 weight format: e4m3 values with one float32 scale per 128×128 block.

A 2-D weight W [N, K] (N output features, K input features) is stored as two tensors (DeepSeek-V3's
release, read by transformers' FineGrainedFP8 and vLLM's Fp8Config with `weight_block_size`):

    <name>            Q [N, K]                      float8_e4m3fn
    <name>_scale_inv  S [ceil(N/bn), ceil(K/bk)]    float32, (bn, bk) = weight_block_size = (128, 128)

    W[i, j] ≈ Q[i, j] · S[i // bn, j // bk]          (blocks at the right and bottom edges are partial)

`quantize` and `dequantize` give the same scales and bits as DeepSeek's kernels, vLLM's and
transformers' (how, and where they differ: beside each), so a bf16 twin written by either holds the
same bits as `dequantize(..., dtype=torch.bfloat16)`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"

# The HF tensors DeepSeek's FP8 release stores in FP8: the weights of the linear projections inside
# the decoder layers (attention q_a/q_b/kv_a/kv_b/o, dense/shared/routed expert gate/up/down).
# Kept in high precision: embeddings, lm_head, norms, the router (`mlp.gate.weight`) and its
# `e_score_correction_bias` — the release's own choice, and what vLLM's DeepSeek model builds
# without a quantised method (its GateLinear and ParallelLMHead have none under Fp8Config), like
# transformers, which skips lm_head by default and has no FP8 router.
QUANTIZED_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(.+\.)?\w+_proj(_with_mqa)?\.weight$")

# config.json's `quantization_config` for this format, as in DeepSeek-V3's release.
QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
}


class Fp8FormatError(ValueError):
    """A quantization_config, tensor or scale this format cannot describe; the message names it and the fix."""


@dataclass(frozen=True)
class BlockFp8:
    """The block shape (bn, bk) of a DeepSeek-style FP8 checkpoint."""

    block: tuple[int, int] = BLOCK


def block_fp8_of(hf_config: dict[str, Any]) -> BlockFp8 | None:
    """The FP8 format config.json declares, or None for an unquantised checkpoint."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    method, fmt, block = q.get("quant_method"), q.get("fmt", "e4m3"), q.get("weight_block_size")
    if method != "fp8":
        raise Fp8FormatError(
            f"config.json quantization_config has quant_method={method!r}: mrl reads unquantised checkpoints "
            "and DeepSeek-style FP8 (quant_method 'fp8' with weight_block_size); dequantise the checkpoint first."
        )
    if fmt != "e4m3":
        raise Fp8FormatError(f"config.json quantization_config has fmt={fmt!r}: only e4m3 FP8 weights are supported.")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise Fp8FormatError(
            f"config.json quantization_config has weight_block_size={block!r}: only block-scaled FP8 "
            "(two positive block sizes, DeepSeek's [128, 128]) is supported, not per-tensor scales."
        )
    return BlockFp8((block[0], block[1]))


def scale_grid(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """Shape of a weight's scale_inv: one scale per block, partial edge blocks included."""
    rows, cols = shape
    return -(-rows // block[0]), -(-cols // block[1])


def check_scale(name: str, weight_shape: tuple[int, ...], scale_shape: tuple[int, ...],
                block: tuple[int, int] = BLOCK) -> None:
    """A scale_inv whose grid does not match its weight's shape is an error naming both."""
    if len(weight_shape) != 2:
        raise Fp8FormatError(f"FP8 tensor {name!r} has shape {list(weight_shape)}: block scaling needs a 2-D weight.")
    expected = scale_grid(weight_shape, block)
    if tuple(scale_shape) != expected:
        raise Fp8FormatError(
            f"{name}{SCALE_SUFFIX} has shape {list(scale_shape)} but weight {name!r} {list(weight_shape)} in "
            f"{list(block)} blocks needs {list(expected)}: the scales do not belong to this weight or block size."
        )


def quantize(weight: torch.Tensor, block: tuple[int, int] = BLOCK, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) → (Q [N, K] float8_e4m3fn, S [ceil(N/bn), ceil(K/bk)] float32).

    S = amax(|block|) / 448, Q = e4m3(W / S), 448 being e4m3's largest finite value, so a block's
    largest entry lands on ±448. DeepSeek's `act_quant` kernel divides by S like this; vLLM's
    `per_block_cast_to_fp8` computes the same S and multiplies by 1/S (same scales and bytes on the
    samples compared) and gives an all-zero block a tiny scale where this gives 1 (transformers'
    choice; either way the block dequantises to zeros)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise Fp8FormatError(f"cannot quantise {name!r} ({weight.dtype}, shape {list(weight.shape)}): "
                             "block FP8 needs a 2-D floating-point weight.")
    w = weight.float()
    if not torch.isfinite(w).all():
        raise Fp8FormatError(f"cannot quantise {name!r}: it holds inf or NaN, which no FP8 block scale represents.")
    (rows, cols), (bn, bk) = w.shape, block
    grid_r, grid_c = scale_grid((rows, cols), block)
    # Zero padding to whole blocks leaves every block's amax unchanged (amax ≥ 0).
    padded = torch.nn.functional.pad(w, (0, grid_c * bk - cols, 0, grid_r * bn - rows))
    blocks = padded.view(grid_r, bn, grid_c, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    # Divided by a tensor, not the number: CUDA divides a tensor by a scalar as a multiplication by
    # its reciprocal, which rounds differently from the division (measured on an H200: scales off by
    # an ulp against the CPU's); elementwise division is correctly rounded on both.
    scale_inv = amax / torch.full_like(amax, E4M3_MAX)
    # An all-zero block (or one whose amax / 448 underflows) gets scale 1, transformers' choice:
    # its values quantise to 0 under any scale, and a zero scale would divide 0 by 0.
    scale_inv = torch.where(scale_inv > 0, scale_inv, torch.ones_like(scale_inv))
    # |W / S| ≤ 448 up to one float32 rounding, which e4m3 rounds back to 448: no clamp needed.
    q = (blocks / scale_inv[:, None, :, None]).to(FP8).view(grid_r * bn, grid_c * bk)[:rows, :cols].contiguous()
    return q, scale_inv


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
               dtype: torch.dtype = torch.float32, offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Q · S in float32, cast once to `dtype`, as DeepSeek's `weight_dequant` kernel and transformers'
    `Fp8Dequantize` do.

    `q` may be a window of the full weight starting at `offset` (row, column); `scale_inv` is always
    the full weight's grid. Works one block row at a time, so the peak is the output plus one
    float32 stripe of bn rows, never a float32 copy of the whole window.
    """
    if q.dtype != FP8 or scale_inv.dtype != torch.float32:
        raise Fp8FormatError(f"dequantize needs float8_e4m3fn values and float32 scales, got {q.dtype} and {scale_inv.dtype}.")
    (rows, cols), (r0, c0), (bn, bk) = q.shape, offset, block
    col_scale_index = torch.arange(c0, c0 + cols, device=q.device) // bk
    out = torch.empty((rows, cols), dtype=dtype, device=q.device)
    start = 0
    while start < rows:
        block_row = (r0 + start) // bn
        stop = min(rows, (block_row + 1) * bn - r0)
        row_scales = scale_inv[block_row].index_select(0, col_scale_index)
        out[start:stop] = (q[start:stop].float() * row_scales).to(dtype)
        start = stop
    return out


def quantize_pairs(pairs: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int] = BLOCK
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs → the FP8 release's pairs: a weight QUANTIZED_WEIGHT names becomes
    (name, Q) followed by (name + "_scale_inv", S); every other tensor passes through unchanged."""
    for name, tensor in pairs:
        if QUANTIZED_WEIGHT.match(name):
            q, scale_inv = quantize(tensor, block, name)
            yield name, q
            yield name + SCALE_SUFFIX, scale_inv
        else:
            yield name, tensor
