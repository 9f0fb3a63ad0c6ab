"""HF safetensors → this rank's Megatron shards, reading only the rows and columns the rank owns.

DeepSeek-style FP8 checkpoints load too: HFCheckpoint dequantises each slice as it is read.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from mrl.bridge.hf_checkpoint import CheckpointError, HFCheckpoint
from mrl.bridge.local_tensors import LocalTensor, local_tensors
from mrl.bridge.mapping import SplitDims, hf_shapes, segments
from mrl.megatron.model import BuiltModel
from mrl.megatron.parallel import RankCoords
from mrl.models.registry import ModelSpec

# Tensors a checkpoint may carry that the model does not use.
_ALWAYS_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def ignorable(name: str, spec: ModelSpec, value_head: bool = False) -> bool:
    """Rotary caches, DeepSeek-V3 multi-token-prediction layers (indices past the last layer), and
    the LM head when a critic (value_head) starts from a policy checkpoint."""
    if _ALWAYS_IGNORED.search(name) or (value_head and name == "lm_head.weight"):
        return True
    m = _LAYER_INDEX.match(name)
    return spec.arch == "deepseek_v3" and m is not None and int(m.group(1)) >= spec.config["num_layers"]


def expected_hf_shapes(tensors: list[LocalTensor], dims: SplitDims) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for t in tensors:
        shapes.update(hf_shapes(t.split, t.hf_names, t.global_shape, t.shards, dims))
    return shapes


def check_checkpoint(ckpt: HFCheckpoint, expected: dict[str, tuple[int, ...]], spec: ModelSpec,
                     value_head: bool = False) -> None:
    """FP8 weights without their scales, missing, unexpected and mis-shaped tensors, each named,
    before any tensor is read."""
    ckpt.check_quantized()
    present = set(ckpt.names())
    missing = sorted(set(expected) - present)
    if missing:
        raise CheckpointError(
            f"checkpoint {ckpt.directory} lacks {len(missing)} tensor(s) the {spec.arch} model needs, "
            f"first {missing[0]!r}: the weights do not match config.json (or a shard file is missing)."
        )
    unexpected = sorted(n for n in present - set(expected) if not ignorable(n, spec, value_head))
    if unexpected:
        raise CheckpointError(
            f"checkpoint {ckpt.directory} has {len(unexpected)} tensor(s) the {spec.arch} model does not "
            f"use, first {unexpected[0]!r}: config.json does not describe these weights."
        )
    for name, shape in expected.items():
        actual = ckpt.shape(name)
        if actual != shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {list(actual)} but config.json implies {list(shape)}: "
                "the config does not match the weights."
            )


def load_hf_weights(built: BuiltModel, coords: RankCoords, hf_dir: str) -> int:
    """Fill this rank's parameters from an HF directory; return the number of bytes read.

    Collective: every rank gathers the expected HF layout so the checkpoint is checked as a whole
    (an unexpected tensor is only unexpected with respect to all ranks) before anything is read.
    """
    ckpt = HFCheckpoint(hf_dir)
    dims = SplitDims.of(built.spec)
    tensors = local_tensors(built, coords)
    mine = expected_hf_shapes(tensors, dims)
    gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, mine)
    expected: dict[str, tuple[int, ...]] = {}
    for part in gathered:
        expected.update(part)
    check_checkpoint(ckpt, expected, built.spec, built.value_head)

    read = 0
    with torch.no_grad():
        for t in tensors:
            trailing = t.global_shape[1:]
            parts = [
                ckpt.read_segment(seg, trailing, t.tensor.dtype)
                for seg in segments(t.split, t.hf_names, t.global_shape, t.shard, t.shards, dims)
            ]
            shard = torch.cat(parts) if len(parts) > 1 else parts[0]
            t.tensor.copy_(shard.view(t.tensor.shape))
            read += shard.numel() * shard.element_size()
    return read
