"""A Megatron checkpoint (any layout) → a HuggingFace directory; the library behind `mrl-merge`
(mrl/cli/merge.py) and the trainer's final export.

Reads mrl's own checkpoints and those of Megatron-LM's training loop (torch_dist, or the legacy
per-rank torch format: checkpoints_tools/megatron_lm.py), the latter with the model's HF config
and tokenizer from `hf_config`. CPU only, no process group. Before anything is written, the plan
(every checkpoint tensor → the HF tensors it makes, with shapes from the metadata alone) is checked
against the HF model the config describes, and a Megatron-LM run's args against the config. Then,
one Megatron tensor at a time (per layer, per expert), exactly the chunks that tensor needs are
read (torch_dist: by byte range from the .distcp files, checkpoints_tools/torch_dist.py),
converted to HF tensors with the mapping tables of the live bridge (mrl/bridge/mapping.py,
`segments` with one shard) and appended to the current safetensors shard. Peak memory: the
tensors in flight plus one output shard. Output goes to a temporary directory that is renamed
only after the self-check passed. The output dtype is the checkpoint's own unless asked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file

from checkpoints_tools import megatron_lm
from checkpoints_tools.errors import CheckpointError
from checkpoints_tools.torch_dist import TorchDistReader
from mrl import checkpoint_dir as cd
from mrl.bridge.mapping import MappingError, Rule, Split, SplitDims, hf_shapes, lookup, segments, table_for
from mrl.models.registry import ModelSpec, UnsupportedModelError, model_spec_from_hf

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
KEEP_FP32 = re.compile(r"e_score_correction_bias$")  # Megatron's router expert_bias: an fp32 buffer
# Megatron 0.16.1 keys: a model whose layers are all alike stacks them along a leading axis
# ("decoder.layers.mlp..." of shape [L, ...]); otherwise keys carry the layer number. A layer's
# experts are stacked along the next axis under "mlp.experts.experts.linear_fc1.weight".
_STACKED_LAYERS = re.compile(r"^decoder\.layers\.(?!\d)")
# The model's own keys (GPTModel's top-level modules); a training checkpoint also holds optimizer
# state ("optimizer.state.exp_avg.decoder...") and per-rank objects, which a merge leaves alone.
_MODEL_KEY = re.compile(r"^(embedding|decoder|output_layer)\.")
_STACKED_EXPERTS = re.compile(r"\.mlp\.experts\.experts\.(linear_fc[12]\.weight)$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

Reader = TorchDistReader | megatron_lm.LegacyReader  # `tensors` (key → TensorInfo), `read(key, index)`
EMBEDDING = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class Item:
    """One Megatron tensor in global naming, and where it lives in the checkpoint."""

    name: str  # global Megatron name the mapping table knows
    key: str  # checkpoint key
    index: tuple[int, ...]  # position along the stacked (layer, expert) axes of `key`
    rule: Rule
    hf_names: tuple[str, ...]


# ---------------------------------------------------------------- planning and converting
def plan_items(reader: Reader, spec: ModelSpec) -> list[Item]:
    """Every exported Megatron tensor of the checkpoint, per layer and per expert, in key order."""
    table = table_for(spec)
    items = []
    for key, meta in reader.tensors.items():
        if not _MODEL_KEY.match(key):
            continue
        names = [(key, ())]
        if _STACKED_LAYERS.match(key):
            names = [(f"decoder.layers.{layer}.{key[len('decoder.layers.'):]}", (layer,)) for layer in range(meta.size[0])]
        if _STACKED_EXPERTS.search(key):
            names = [(_STACKED_EXPERTS.sub(rf".mlp.experts.local_experts.{e}.\1", name), index + (e,))
                     for name, index in names for e in range(meta.size[len(index)])]
        for name, index in names:
            try:
                rule, hf_names = lookup(table, name, spec.arch)
            except MappingError as err:
                raise CheckpointError(f"{err} (is the checkpoint of another architecture than {spec.arch}? pass the HF "
                                      "config of the model that was trained, --hf-config)") from None
            if rule.export:
                items.append(Item(name, key, index, rule, hf_names))
    return items


def convert_item(reader: Reader, item: Item, dims: SplitDims, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one Megatron tensor (read, split by the mapping table, cast)."""
    full = reader.read(item.key, item.index)
    # The segments list the HF rows that the Megatron tensor's rows hold, in order: segment i
    # starts at Megatron row `offset`, and HF rows of one tensor may come from several segments.
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    offset = 0
    for seg in segments(item.rule.split, item.hf_names, tuple(full.shape), 0, 1, dims):
        rows = full[offset : offset + seg.rows]
        offset += seg.rows
        if seg.hf is None:
            continue  # vocabulary padding rows
        pieces.setdefault(seg.hf, []).append((seg.start, rows if seg.cols is None else rows[:, seg.cols[0] : seg.cols[1]]))
    out = []
    for name in item.hf_names:
        ordered = [t for _, t in sorted(pieces[name], key=lambda p: p[0])]
        target = torch.float32 if KEEP_FP32.search(name) else dtype
        out.append((name, torch.cat(ordered).to(target) if len(ordered) > 1 else ordered[0].to(target).contiguous().clone()))
    return out


# ---------------------------------------------------------------- writing safetensors shards
def parse_size(text: str) -> int:
    """'5GB' → 5·10⁹ bytes, '500MiB' → 500·2²⁰."""
    m = _SIZE.match(text)
    unit = m.group(2).upper() if m else ""
    if not m or (unit and not unit.endswith("B")) or unit not in _UNITS:
        raise CheckpointError(f"--max-shard-size {text!r} is not a size: use e.g. 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[unit])


class ShardWriter:
    """Accumulates tensors and writes a safetensors file whenever the next one would overflow."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"part-{len(self.files) + 1:05d}.safetensors"
        write_shard(self.pending, self.directory / name)
        self.files.append((name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> dict[str, str]:
        """Rename the parts to model-0000i-of-0000n and write the index; return the weight map."""
        self.flush()
        count, weight_map = len(self.files), {}
        for i, (part, names) in enumerate(self.files, 1):
            final = "model.safetensors" if count == 1 else f"model-{i:05d}-of-{count:05d}.safetensors"
            os.rename(self.directory / part, self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return weight_map


def write_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file (a module-level function so tests can simulate a full disk)."""
    save_file(tensors, str(path), metadata={"format": "pt"})


# ---------------------------------------------------------------- self-check
def expected_hf_layout(hf_config_dir: Path, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the HF model's weights, from transformers on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mrl.bridge.hf_import import ignorable

    config = AutoConfig.from_pretrained(hf_config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in model.state_dict().items():
        if not ignorable(name, spec):
            shapes.update(_per_expert(name, tuple(tensor.shape)))
    if spec.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


_FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def _per_expert(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """transformers 5 fuses experts in memory ([E, 2I, H] gate_up, [E, H, I] down); files keep
    one tensor per expert and projection, which is what a merge writes."""
    m = _FUSED_EXPERTS.match(name)
    if not m:
        return {name: shape}
    prefix, experts = m.group(1), shape[0]
    if m.group(2) == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": shape[1:] for e in range(experts)}
    half = (shape[1] // 2, shape[2])
    return {f"{prefix}.{e}.{p}_proj.weight": half for e in range(experts) for p in ("gate", "up")}


def check_layout(written: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], arch: str) -> None:
    missing, extra = sorted(set(expected) - set(written)), sorted(set(written) - set(expected))
    if missing or extra:
        raise CheckpointError(f"merged {arch} weights do not match the HF layout: {len(missing)} missing "
                         f"(first {missing[:1]}), {len(extra)} unexpected (first {extra[:1]})")
    for name, shape in expected.items():
        if written[name] != shape:
            raise CheckpointError(f"merged tensor {name!r} has shape {list(written[name])}, the HF model expects {list(shape)}")


# ---------------------------------------------------------------- the merge
def _in_order(fn, items: list, workers: int) -> Iterator:
    """fn(item) for each item, in order, with at most 2·workers results in flight."""
    if workers <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(workers) as pool:
        window = []
        for item in items:
            window.append(pool.submit(fn, item))
            if len(window) >= 2 * workers:
                yield window.pop(0).result()
        for future in window:
            yield future.result()


@dataclass
class Source:
    """An opened checkpoint: where it is, the model it holds, and how to read it."""

    directory: Path  # the iteration directory
    kind: str  # "mrl" or "Megatron-LM"
    step: int | None
    spec: ModelSpec
    hf_dir: Path  # config and tokenizer of the HF model to write
    reader: Reader
    args: dict | None = None  # a Megatron-LM run's arguments

    @property
    def dtype(self) -> torch.dtype:
        """The checkpoint's parameter dtype (its embedding's; the router's expert bias is fp32 anyway)."""
        return self.reader.tensors[EMBEDDING].dtype


def open_checkpoint(ckpt: str | Path, hf_config: str | Path | None = None) -> Source:
    """Resolve and open an mrl or a Megatron-LM checkpoint (raises CheckpointError, one line)."""
    try:
        located = cd.locate(ckpt)
    except cd.CheckpointDirError as err:
        raise CheckpointError(str(err)) from None
    if located.megatron_lm is None:
        return _open_mrl(located.directory, hf_config)
    return _open_megatron_lm(located.megatron_lm, hf_config)


def _open_mrl(directory: Path, hf_config: str | Path | None) -> Source:
    try:
        manifest = cd.read_manifest(directory)
        note = cd.verify_checksums(directory, manifest)  # a flipped bit merges into wrong weights otherwise
    except cd.CheckpointDirError as err:
        raise CheckpointError(str(err)) from None
    if note:
        print(note, file=sys.stderr)
    if manifest.get("value_head"):
        raise CheckpointError(f"{directory} is a PPO critic checkpoint (a value head, no LM head): there is no HF causal "
                              "LM to write; merge the actor's checkpoint (the parent of its critic/ directory)")
    hf_dir = _hf_dir(hf_config) if hf_config is not None else directory / "hf"
    spec = _spec(hf_dir)
    if manifest.get("arch") not in (None, spec.arch):
        raise CheckpointError(f"{directory} is a {manifest['arch']} checkpoint but the config in {hf_dir} describes a "
                              f"{spec.arch} model: pass the config the checkpoint was trained with")
    return Source(directory, "mrl", manifest.get("step"), spec, hf_dir, TorchDistReader(directory))


def _open_megatron_lm(ckpt: Any, hf_config: str | Path | None) -> Source:
    if hf_config is None:
        raise CheckpointError(f"{ckpt.directory} is a Megatron-LM checkpoint, which holds no HF config: pass --hf-config "
                              "with the model's HF directory (config.json and tokenizer)")
    hf_dir = _hf_dir(hf_config)
    spec = _spec(hf_dir)
    args = megatron_lm.read_args(ckpt)
    reader = TorchDistReader(ckpt.directory) if ckpt.format == "torch_dist" else megatron_lm.LegacyReader(ckpt, args, spec)
    step = ckpt.iteration if ckpt.iteration is not None else args.get("iteration")
    return Source(ckpt.directory, "Megatron-LM", step, spec, hf_dir, reader, args)


def _hf_dir(hf_config: str | Path) -> Path:
    path = Path(hf_config)
    return path if path.is_dir() else path.parent


def _spec(hf_dir: Path) -> ModelSpec:
    try:
        return model_spec_from_hf(hf_dir)
    except (UnsupportedModelError, FileNotFoundError, KeyError) as err:
        raise CheckpointError(f"cannot read the HF config in {hf_dir} ({err}); pass --hf-config with the model's "
                              "HF config directory") from None


def plan(source: Source) -> tuple[list[Item], dict[str, tuple[int, ...]]]:
    """Every tensor to convert, and the HF layout it must make, checked against each other (and a
    Megatron-LM run's args against the config) from metadata alone: before anything is read."""
    source.reader.check_files()
    items = plan_items(source.reader, source.spec)
    expected = expected_hf_layout(source.hf_dir, source.spec)
    check_plan(items, source, expected)
    if source.args is not None:
        megatron_lm.check_args(source.args, source.spec, source.hf_dir, source.directory)
    return items, expected


def check_plan(items: list[Item], source: Source, expected: dict[str, tuple[int, ...]]) -> None:
    """The first checkpoint tensor that would make an HF tensor the config does not describe, or the
    first HF tensor no checkpoint tensor makes, as one error naming it and the fix."""
    dims, fix = SplitDims.of(source.spec), "pass the HF config of the model that was trained (--hf-config)"
    planned: set[str] = set()
    for item in items:
        shape = source.reader.tensors[item.key].size[len(item.index):]
        if item.rule.split is Split.VOCAB and shape[0] < dims.vocab_size:
            raise CheckpointError(f"checkpoint tensor {item.name!r} has {shape[0]} vocabulary rows, fewer than vocab_size "
                                  f"{dims.vocab_size} of the HF config in {source.hf_dir}: {fix}")
        for hf, got in hf_shapes(item.rule.split, item.hf_names, shape, 1, dims).items():
            if hf not in expected:
                raise CheckpointError(f"checkpoint tensor {item.name!r} makes HF tensor {hf!r}, which the {source.spec.arch} "
                                      f"model of {source.hf_dir} does not have: {fix}")
            if got != expected[hf]:
                raise CheckpointError(f"checkpoint tensor {item.name!r} of shape {list(shape)} makes {hf} of shape "
                                      f"{list(got)}, but the HF config in {source.hf_dir} gives {list(expected[hf])}: {fix}")
            planned.add(hf)
    missing = [name for name in expected if name not in planned]
    if missing:
        raise CheckpointError(f"no checkpoint tensor makes {missing[0]} ({len(missing)} HF tensors missing), which the HF "
                              f"config in {source.hf_dir} describes: {fix}")


def merge(ckpt: str | Path, out: str | Path, *, dtype: str | None = None, max_shard_size: str = "5GB",
          workers: int = 1, force: bool = False, hf_config: str | Path | None = None, progress: bool = True) -> dict:
    """Merge checkpoint `ckpt` into HF directory `out`; return a summary (raises CheckpointError).
    `dtype` None keeps the checkpoint's parameter dtype."""
    from tqdm import tqdm

    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    max_bytes = parse_size(max_shard_size)
    out = Path(out)
    if out.exists() and not force:
        raise CheckpointError(f"output {out} already exists: pass --force to replace it")
    start = time.perf_counter()
    source = open_checkpoint(ckpt, hf_config)
    items, expected = plan(source)
    target = DTYPES[dtype] if dtype is not None else source.dtype
    dims = SplitDims.of(source.spec)
    staging = out.parent / f"{out.name}.tmp-merge-{os.getpid()}"
    try:
        with cd.atomic_dir(staging) as tmp:
            writer, written = ShardWriter(tmp, max_bytes), {}
            bar = tqdm(total=len(items), unit="tensor", desc="mrl-merge", disable=not progress)
            for converted in _in_order(lambda it: convert_item(source.reader, it, dims, target), items, workers):
                for name, tensor in converted:
                    if name in written:
                        raise CheckpointError(f"two checkpoint tensors map onto HF tensor {name!r}: the mapping is ambiguous")
                    written[name] = tuple(tensor.shape)
                    writer.add(name, tensor)
                bar.update()
            bar.close()
            check_layout(written, expected, source.spec.arch)
            writer.finish()
            cd.copy_hf_metadata(source.hf_dir, tmp)  # the weights are written above, never FP8
        if out.exists():
            shutil.rmtree(out)
        os.rename(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    seconds = time.perf_counter() - start
    return {"checkpoint": str(source.directory), "format": source.kind, "out": str(out), "arch": source.spec.arch,
            "step": source.step, "dtype": DTYPE_NAMES[target], "tensors": len(written), "shards": len(writer.files),
            "bytes": writer.total_bytes, "seconds": round(seconds, 3)}


# ---------------------------------------------------------------- --verify
def check_verifiable(ckpt: str | Path) -> None:
    """--verify loads the checkpoint into Megatron with dist_checkpointing, which reads torch_dist
    only: refuse a legacy Megatron-LM checkpoint before the merge starts."""
    try:
        located = cd.locate(ckpt)
    except cd.CheckpointDirError as err:
        raise CheckpointError(str(err)) from None
    if located.megatron_lm is not None and located.megatron_lm.format != "torch_dist":
        raise CheckpointError(f"--verify loads {located.directory} into Megatron with dist_checkpointing, which reads "
                              "torch_dist only, not this legacy torch checkpoint: merge without --verify, then run "
                              "`mrl verify --hf OUT` on the result")


def _megatron_logits(rank: int, world: int, directory: str, hf_dir: str, dtype: str) -> torch.Tensor:
    from mrl.bridge.verify import probe_tokens
    from mrl.layout import ParallelLayout
    from mrl.megatron.checkpoint import load_policy_weights
    from mrl.megatron.forward import forward_logits
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import initialize_layout

    layout = ParallelLayout()
    initialize_layout(layout)
    spec = model_spec_from_hf(hf_dir)
    built = build_model(spec, layout)
    load_policy_weights(directory, built)
    with torch.no_grad():  # the merged file holds weights rounded to `dtype`: round Megatron's the same way
        for name, p in list(built.chunks[0].named_parameters()) + list(built.chunks[0].named_buffers()):
            if p.is_floating_point() and not name.endswith("expert_bias"):
                p.copy_(p.to(DTYPES[dtype]).float())
    return forward_logits(built, probe_tokens(spec.vocab_size))


def verify_merged(directory: str | Path, out: str | Path, dtype: str, tol: float = 1e-4) -> dict:
    """Logits of the merged HF model `out` (transformers) vs the checkpoint iteration `directory`
    loaded in Megatron (TP1, with the config written to `out`)."""
    from mrl.megatron.local_launch import run_local
    from mrl.bridge.verify import probe_tokens, reference_logits

    megatron = run_local(_megatron_logits, 1, str(directory), str(out), dtype)[0]
    spec = model_spec_from_hf(Path(out))
    diff = (megatron - reference_logits(str(out), probe_tokens(spec.vocab_size))).abs().max().item()
    return {"max_abs_diff": diff, "tol": tol, "ok": diff <= tol}
