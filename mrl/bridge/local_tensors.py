"""This rank's Megatron tensors under their global names, each with its mapping rule and shard."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from mrl.bridge.mapping import Rule, Split, canonical_name, global_shape, lookup, table_for
from mrl.megatron.model import BuiltModel
from mrl.megatron.parallel import RankCoords
from mrl.megatron.value_head import NOT_IN_HF

# Buffers that carry weights (not statistics); every other buffer stays out of the bridge.
WEIGHT_BUFFERS = re.compile(r"\.router\.expert_bias$")
_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


@dataclass
class LocalTensor:
    """A Megatron tensor on this rank, located in the global model."""

    name: str  # global Megatron name: layers and experts counted over all PP/VPP/EP ranks
    tensor: torch.Tensor
    rule: Rule
    hf_names: tuple[str, ...]
    split: Split  # the rule's split, or REPLICATED for a parameter duplicated on TP ranks
    shard: int  # this rank's index in the group that splits the tensor (TP or expert TP)
    shards: int
    chunk: int  # virtual pipeline chunk

    @property
    def global_shape(self) -> tuple[int, ...]:
        return global_shape(self.split, tuple(self.tensor.shape), self.shards)


def local_tensors(built: BuiltModel, coords: RankCoords) -> list[LocalTensor]:
    """Every parameter (and weight buffer) of this rank, in model order."""
    table = table_for(built.spec)
    experts_per_rank = (built.spec.num_experts or 0) // built.layout.ep
    found = []
    for chunk_index, chunk in enumerate(built.chunks):
        layer_numbers = [layer.layer_number for layer in chunk.decoder.layers]
        named = list(chunk.named_parameters()) + [
            (n, b) for n, b in chunk.named_buffers() if WEIGHT_BUFFERS.search(n)
        ]
        for local_name, tensor in named:
            if getattr(tensor, NOT_IN_HF, False):
                continue  # a critic's value head
            name = _globalise(canonical_name(local_name), layer_numbers, coords.ep * experts_per_rank)
            rule, hf_names = lookup(table, name, built.spec.arch)
            split = rule.split
            if split is not Split.REPLICATED and not getattr(tensor, "tensor_model_parallel", True):
                split = Split.REPLICATED  # e.g. TE's duplicated MLA down-projections
            shard, shards = (coords.etp, built.layout.expert_tp) if rule.expert else (coords.tp, built.layout.tp)
            if split is Split.REPLICATED:
                shard, shards = 0, 1
            found.append(LocalTensor(name, tensor, rule, hf_names, split, shard, shards, chunk_index))
    return found


def _globalise(name: str, layer_numbers: list[int], expert_offset: int) -> str:
    """Replace the chunk-local layer index and the rank-local expert index by global ones."""
    name = _LOCAL_LAYER.sub(lambda m: f"decoder.layers.{layer_numbers[int(m.group(1))] - 1}.", name, count=1)
    return _LOCAL_EXPERT.sub(lambda m: f".local_experts.{int(m.group(1)) + expert_offset}.", name, count=1)
