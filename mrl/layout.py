"""The parallel layout of a Megatron model, and the arithmetic checks it must pass.

Pure Python: validating a layout needs no megatron, no torch.distributed and no GPU, so every
error surfaces before a single worker starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


class LayoutError(ValueError):
    """A parallel layout that cannot hold the model; the message names the number and the fix."""


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the model-parallel dimensions. Data parallelism fills the rest of the world.

    tp: tensor parallel, pp: pipeline parallel, vpp: virtual pipeline chunks per stage,
    ep: expert parallel, etp: expert tensor parallel (defaults to tp, as in Megatron),
    cp: context parallel (each sequence split over cp ranks in 2·cp load-balanced chunks; attention
    gathers the keys and values of the whole sequence: mrl/megatron/context_parallel.py).
    first_stage_layers / last_stage_layers: an uneven pipeline (e.g. DeepSeek-V3's 61 layers as
    16+16+16+13); the other stages split the remaining layers evenly.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    cp: int = 1

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def sequence_multiple(self) -> int:
        """What a sequence's length must divide into: TP (sequence parallelism) × 2·CP (each CP rank
        holds two of the sequence's 2·CP equal chunks)."""
        return self.tp * (2 * self.cp if self.cp > 1 else 1)

    @property
    def virtual_stages(self) -> int | None:
        """Virtual pipeline chunks per stage, or None when the pipeline is not interleaved."""
        return self.vpp if self.vpp and self.vpp > 1 else None

    def megatron_sizes(self) -> dict[str, int | None]:
        """The sizes under the names both TransformerConfig and initialize_model_parallel use."""
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.virtual_stages,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.expert_tp,
        )

    def pipeline_split(self) -> dict[str, int | None]:
        """The uneven-pipeline TransformerConfig arguments (None: that stage gets an even share)."""
        return dict(
            num_layers_in_first_pipeline_stage=self.first_stage_layers,
            num_layers_in_last_pipeline_stage=self.last_stage_layers,
        )

    def data_parallel_size(self, world_size: int) -> int:
        """The ranks a batch splits over in a world of `world_size`: each TP·CP·PP group holds one
        replica (CP ranks share their sequences)."""
        return world_size // (self.tp * self.cp * self.pp)

    def min_world_size(self) -> int:
        """Smallest world that fits both the dense (tp·cp·pp) and the expert (etp·ep·pp) grid."""
        dense = self.tp * self.cp * self.pp
        expert = self.expert_tp * self.ep * self.pp
        return math.lcm(dense, expert)

    def rank_groups(self, world_size: int, kind: Literal["tp", "etp", "ep"]) -> list[list[int]]:
        """The global ranks of each group of `kind`, as Megatron forms them (initialize_model_parallel's
        default order tp-cp-ep-dp-pp): dense layers count ranks TP fastest, then CP, DP, PP; expert
        layers ETP fastest, then EP, expert DP, PP. So a TP group is tp consecutive ranks."""
        if kind == "tp":
            sizes = [self.tp, self.cp, world_size // (self.tp * self.cp * self.pp), self.pp]
        else:
            sizes = [self.expert_tp, self.ep, world_size // (self.expert_tp * self.ep * self.pp), self.pp]
        axis = 1 if kind == "ep" else 0
        stride, size = math.prod(sizes[:axis]), sizes[axis]
        return [[first + k * stride for k in range(size)]
                for first in range(world_size) if (first // stride) % size == 0]

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        if self.vpp:
            parts.append(f"VPP{self.vpp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        if self.etp is not None:
            parts.append(f"ETP{self.etp}")
        return "×".join(parts)

    def validate(self, dims: "ModelDims", world_size: int | None = None) -> None:
        """Raise LayoutError naming the first number that does not divide."""
        for name, value in (("tp", self.tp), ("pp", self.pp), ("ep", self.ep), ("etp", self.expert_tp), ("cp", self.cp)):
            if value < 1:
                raise LayoutError(f"--{name} must be >= 1, got {value}.")
        if self.vpp is not None and (self.vpp < 1 or (self.vpp > 1 and self.pp == 1)):
            raise LayoutError(f"--vpp {self.vpp} needs --pp > 1 (virtual stages interleave pipeline stages).")
        _divides(self.tp, dims.num_attention_heads, "attention heads", "--tp")
        if dims.num_query_groups % self.tp and self.tp % dims.num_query_groups:
            raise LayoutError(
                f"{dims.num_query_groups} KV heads cannot be split over --tp {self.tp}: "
                "use a TP size that divides the KV heads or is a multiple of them."
            )
        _divides(self.tp, dims.ffn_hidden_size, "MLP intermediate size (ffn_hidden_size)", "--tp")
        special = [n for n in (self.first_stage_layers, self.last_stage_layers) if n is not None]
        if special:
            if self.pp < 2 or self.virtual_stages or min(special) < 1:
                raise LayoutError("first/last stage layers need --pp >= 2, no --vpp, and at least 1 layer each.")
            rest, stages = dims.num_layers - sum(special), self.pp - len(special)
            if rest < stages or (stages and rest % stages) or (not stages and rest):
                raise LayoutError(
                    f"{dims.num_layers} layers minus first/last stage layers {special} leave {rest} for "
                    f"{stages} other stage(s): choose first/last stage layers so the rest divide evenly."
                )
        chunks = self.pp * (self.vpp or 1)
        if not special and dims.num_layers % chunks:
            raise LayoutError(
                f"{dims.num_layers} layers cannot be split into PP×VPP = {self.pp}×{self.vpp or 1} = "
                f"{chunks} equal pipeline chunks: choose --pp/--vpp whose product divides {dims.num_layers}."
            )
        if dims.num_experts:
            _divides(self.ep, dims.num_experts, "routed experts", "--ep")
            _divides(self.expert_tp, dims.moe_ffn_hidden_size, "expert intermediate size", "--etp")
        elif self.ep > 1 or self.etp is not None:
            raise LayoutError("--ep/--etp given for a dense model (no routed experts): drop them.")
        if world_size is not None:
            self.check_world_size(world_size)

    def check_world_size(self, world_size: int) -> None:
        if world_size % self.min_world_size():
            raise LayoutError(
                f"world size {world_size} does not fit layout {self.describe()}: it must be a multiple "
                f"of {self.min_world_size()} (TP·CP·PP for dense and ETP·EP·PP for expert layers)."
            )


@dataclass(frozen=True)
class ModelDims:
    """The model sizes a layout has to divide."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None


def _divides(size: int, total: int, what: str, flag: str) -> None:
    if total % size:
        raise LayoutError(f"{total} {what} are not divisible by {flag} {size}: choose a {flag} that divides {total}.")
