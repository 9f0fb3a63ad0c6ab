"""Checkpoints written by Megatron-LM's training loop (its layout: mrl/megatron_lm_dir.py): their
pickled files read without trusting them, their `args` checked against an HF config, and the
legacy per-rank format read as global tensors.

What Megatron-LM pickles (megatron/training/checkpointing.py, `generate_state_dict`): `common.pt`
of a torch_dist checkpoint, and each legacy `mp_rank_*/model_optim_rng.pt`, hold `args` (the
run's argparse.Namespace: torch dtypes, megatron enums, ...), `iteration`, `checkpoint_version`,
the scheduler and RNG states; a legacy file also holds the rank's `model` (`model0`, `model1`, ...
per virtual pipeline chunk: the chunk's local state dict) and optimizer state. They are read by
torch.load through a restricted pickle module: tensors, containers, dtypes and Namespace are
built, every other class the file names becomes an inert `Opaque` record, and nothing the file
names is ever called.
"""

from __future__ import annotations

import argparse
import codecs
import collections
import pickle
import re
import types
from pathlib import Path
from typing import Any, Callable

import torch

from checkpoints_tools.errors import CheckpointError
from checkpoints_tools.torch_dist import TensorInfo
from mrl import megatron_lm_dir as mlm
from mrl.bridge.mapping import MappingError, Split, canonical_name, lookup, table_for
from mrl.models.registry import ModelSpec

# ---------------------------------------------------------------- restricted unpickling
# Globals a Megatron-LM pickle may build for real: what tensors, containers and args are made of.
_REAL_OBJECTS = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): torch._utils._rebuild_parameter_with_state,
    ("torch", "Size"): torch.Size, ("torch", "device"): torch.device,
    ("collections", "OrderedDict"): collections.OrderedDict, ("argparse", "Namespace"): argparse.Namespace,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "slice"): slice,
    ("builtins", "complex"): complex, ("builtins", "bytearray"): bytearray,
    ("_codecs", "encode"): codecs.encode,  # protocol 2 pickles bytes as _codecs.encode(str, "latin1")
}


class Opaque:
    """An instance of a class a checkpoint names but that is never imported or run (a megatron enum,
    a numpy RNG state, a TE extra state): what it was built from is kept as plain data."""

    qualname = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> "Opaque":
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualname}{self.args!r}>"


class _RestrictedUnpickler(pickle.Unpickler):
    _stubs: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _REAL_OBJECTS:
            return _REAL_OBJECTS[module, name]
        key = (module, name)
        if key not in self._stubs:
            self._stubs[key] = type(name, (Opaque,), {"qualname": f"{module}.{name}"})
        return self._stubs[key]


# torch.load takes a pickle *module*; it subclasses its Unpickler (and handles storages itself).
_PICKLE = types.ModuleType("mrl_restricted_pickle")
_PICKLE.Unpickler = _RestrictedUnpickler
_PICKLE.load = lambda f, **kw: _RestrictedUnpickler(f, **kw).load()
_PICKLE.__name__ = "mrl_restricted_pickle"


def load_pickled(path: Path, mmap: bool = False) -> Any:
    """A torch.save file of Megatron-LM, unpickled without trusting it (see the module docstring).
    `mmap` maps tensors from the file instead of reading them: a legacy rank file's tensors then
    cost memory only when read."""
    try:
        return torch.load(path, map_location="cpu", pickle_module=_PICKLE, weights_only=False, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {err}): the file is damaged or "
                              "not a torch.save file; restore it") from None


def read_args(ckpt: mlm.MegatronLMCheckpoint) -> dict[str, Any]:
    """The run's arguments as a dict (common.pt, or the first legacy rank file)."""
    if ckpt.format == "torch_dist":
        path = ckpt.directory / "common.pt"
    else:
        path = next(iter(sorted(ckpt.directory.glob(f"mp_rank_*/{mlm.RANK_FILE}"))))
    common = load_pickled(path, mmap=ckpt.format == "torch")
    args = common.get("args") if isinstance(common, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{path} holds no Megatron-LM `args` (an argparse.Namespace): it was not written by "
                              "Megatron-LM's training loop; pass a Megatron-LM or an mrl checkpoint")
    return vars(args) | {"iteration": common.get("iteration")}


# ---------------------------------------------------------------- args against the HF config
# (Megatron-LM argument, its value for the HF config's ModelSpec, the HF config's name for it). A
# setting absent from either side is not compared: args differ between Megatron-LM versions.
ARGS_VS_SPEC: list[tuple[str, Callable[[ModelSpec], Any], str]] = [
    ("num_layers", lambda s: s.config["num_layers"], "num_hidden_layers"),
    ("hidden_size", lambda s: s.config["hidden_size"], "hidden_size"),
    ("num_attention_heads", lambda s: s.config["num_attention_heads"], "num_attention_heads"),
    ("num_query_groups", lambda s: s.config.get("num_query_groups") or s.config["num_attention_heads"],
     "num_key_value_heads"),
    ("kv_channels", lambda s: None if s.mla else s.config["kv_channels"], "head_dim"),
    ("ffn_hidden_size", lambda s: s.config["ffn_hidden_size"], "intermediate_size"),
    ("num_experts", lambda s: s.num_experts, "num_experts / n_routed_experts"),
    ("moe_ffn_hidden_size", lambda s: s.config.get("moe_ffn_hidden_size"), "moe_intermediate_size"),
    ("swiglu", lambda s: s.config["gated_linear_unit"], "hidden_act (silu: SwiGLU)"),
    ("untie_embeddings_and_output_weights", lambda s: not s.tie_word_embeddings, "tie_word_embeddings"),
    ("add_qkv_bias", lambda s: s.config.get("add_qkv_bias"), "attention biases (Qwen2)"),
    ("qk_layernorm", lambda s: s.config.get("qk_layernorm"), "q_norm/k_norm (Qwen3)"),
    ("multi_latent_attention", lambda s: s.mla, "architectures (MLA: DeepSeek-V3)"),
    ("q_lora_rank", lambda s: s.config.get("q_lora_rank"), "q_lora_rank"),
    ("kv_lora_rank", lambda s: s.config.get("kv_lora_rank"), "kv_lora_rank"),
    ("qk_head_dim", lambda s: s.config.get("qk_head_dim"), "qk_nope_head_dim"),
    ("qk_pos_emb_head_dim", lambda s: s.config.get("qk_pos_emb_head_dim"), "qk_rope_head_dim"),
    ("v_head_dim", lambda s: s.config.get("v_head_dim"), "v_head_dim"),
    ("rotary_base", lambda s: s.config.get("rotary_base") or s.rope.get("rotary_base"), "rope_theta"),
    ("norm_epsilon", lambda s: s.config["layernorm_epsilon"], "rms_norm_eps"),
]


def effective_args(args: dict[str, Any]) -> dict[str, Any]:
    """Args as the model saw them: without --group-query-attention every head is its own group."""
    if "group_query_attention" in args and not args["group_query_attention"]:
        args = args | {"num_query_groups": args.get("num_attention_heads")}
    return args


def check_args(args: dict[str, Any], spec: ModelSpec, hf_dir: Path, directory: Path) -> None:
    """The first setting in which the run's args and the HF config disagree, as one error."""
    args = effective_args(args)
    for name, from_spec, hf_name in ARGS_VS_SPEC:
        ours, theirs = from_spec(spec), args.get(name)
        if ours is None or theirs is None or ours == theirs:
            continue
        raise CheckpointError(
            f"{directory} was trained with {name}={theirs!r} (its args) but the HF config in {hf_dir} gives "
            f"{ours!r} ({hf_name}): pass the HF config of the model that was trained (--hf-config)"
        )


# ---------------------------------------------------------------- the legacy per-rank format
_EXTRA_STATE = re.compile(r"\._extra_state$")
_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


class LegacyReader:
    """A legacy (--ckpt-format torch) checkpoint's model tensors under global names, each assembled
    from its TP shards as a torch_dist checkpoint stores it: row- or column-shards concatenated,
    gated fc1 as [gate; up] over all ranks. Rank files are memory-mapped, so a tensor costs memory
    only while it is read.

    Global layer numbers: pipeline chunks hold consecutive layers in (virtual stage, pipeline rank)
    order, so a chunk's first layer is the count of layers in the chunks before it; this holds for
    even, first/last-uneven and interleaved splits alike. Global expert id = EP rank · E/EP + local.
    """

    def __init__(self, ckpt: mlm.MegatronLMCheckpoint, args: dict[str, Any], spec: ModelSpec):
        self.directory, self.spec = ckpt.directory, spec
        tp, pp, ep = (int(args.get(k) or 1) for k in (
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"))
        etp = int(args.get("expert_tensor_parallel_size") or tp)
        if etp not in (1, tp):
            raise CheckpointError(f"legacy checkpoint {self.directory} has expert tensor parallel size {etp} beside "
                                  f"TP {tp}; only ETP = TP or 1 is read: re-save it with --ckpt-format torch_dist")
        dirs = mlm.rank_dirs(self.directory, pipeline=pp > 1, expert=ep > 1)
        for rank in ((t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)):
            if rank not in dirs:
                raise CheckpointError(f"legacy checkpoint {self.directory} lacks the files of TP rank {rank[0]}, PP rank "
                                      f"{rank[1]}, EP rank {rank[2]} (its args say TP{tp} PP{pp} EP{ep}): restore them")
        self._tp, self._etp = tp, etp
        states = {rank: load_pickled(path / mlm.RANK_FILE, mmap=True) for rank, path in dirs.items()}
        self._shards: dict[str, dict[int, torch.Tensor]] = {}
        self._rules: dict[str, Split] = {}
        self._index(states, pp, ep)
        self.tensors = {name: TensorInfo(tuple(self._assemble_shape(name)), next(iter(shards.values())).dtype)
                        for name, shards in self._shards.items()}

    def check_files(self) -> None:
        """Nothing to check beyond what opening did (every rank file was read)."""

    def _index(self, states: dict[tuple[int, int, int], dict], pp: int, ep: int) -> None:
        chunks = [key for key in next(iter(states.values())) if re.fullmatch(r"model\d*", key)]
        chunks.sort(key=lambda k: int(k[5:] or 0))
        experts = self.spec.num_experts or 0
        offset = 0
        for chunk in chunks:  # virtual stage major, pipeline rank minor: the global layer order
            for p in range(pp):
                state = states[0, p, 0][chunk]
                layers = {int(m.group(1)) for k in state if (m := _LOCAL_LAYER.match(k))}
                for (t, rank_pp, e), rank_state in states.items():
                    if rank_pp == p:
                        self._add(rank_state[chunk], t, offset, e * (experts // ep))
                offset += len(layers)

    def _add(self, state: dict, tp_rank: int, layer_offset: int, expert_offset: int) -> None:
        table = table_for(self.spec)
        for local, tensor in state.items():
            if _EXTRA_STATE.search(local) or not isinstance(tensor, torch.Tensor):
                continue
            name = _LOCAL_LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", canonical_name(local), 1)
            name = _LOCAL_EXPERT.sub(lambda m: f".local_experts.{int(m.group(1)) + expert_offset}.", name, 1)
            try:
                rule, _ = lookup(table, name, self.spec.arch)
            except MappingError as err:
                raise CheckpointError(f"{err} (is the checkpoint of another architecture than {self.spec.arch}? pass "
                                      "the HF config of the model that was trained)") from None
            shards = self._tp if not rule.expert else self._etp
            if shards == 1 and tp_rank > 0:
                continue  # a copy held by every TP rank
            self._shards.setdefault(name, {})[tp_rank] = tensor
            self._rules[name] = rule.split

    def _assemble_shape(self, name: str) -> list[int]:
        shards, split = self._shards[name], self._rules[name]
        shape = list(shards[0].shape)
        if split is Split.REPLICATED or len(shards) == 1:
            return shape
        shape[1 if split is Split.ROW else 0] *= len(shards)
        return shape

    def read(self, key: str, index: tuple[int, ...] = ()) -> torch.Tensor:
        """The global tensor `key` (legacy keys are never stacked: `index` is empty)."""
        shards, split = self._shards[key], self._rules[key]
        parts = [shards[r] for r in sorted(shards)]
        if len(parts) != len(shards) or sorted(shards) != list(range(len(shards))):
            raise CheckpointError(f"legacy checkpoint tensor {key!r} lacks TP shards: the checkpoint is incomplete")
        if split is Split.REPLICATED or len(parts) == 1:
            return parts[0].clone()
        if split is Split.ROW:
            return torch.cat(parts, dim=1)
        if split is Split.GATED:  # each rank holds [its gate rows; its up rows]
            halves = [p.chunk(2, dim=0) for p in parts]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        return torch.cat(parts)
