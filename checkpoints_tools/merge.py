"""An mrl checkpoint (any layout) → a HuggingFace directory; the library behind `mrl-merge`
(mrl/cli/merge.py) and the trainer's final export.

CPU only, no process group. The torch_dist metadata (a pickle) is read through a restricted
unpickler; then, one Megatron tensor at a time (per layer, per expert), exactly the chunks that
tensor needs are read from the .distcp files by byte range, converted to HF tensors with the
mapping tables of the live bridge (mrl/bridge/mapping.py, `segments` with one shard) and appended
to the current safetensors shard. Peak memory: the tensors in flight plus one output shard.
Output goes to a temporary directory that is renamed only after the self-check passed.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file

from mrl import checkpoint_dir as cd
from mrl.bridge.mapping import MappingError, Rule, SplitDims, lookup, segments, table_for
from mrl.models.registry import ModelSpec, UnsupportedModelError, model_spec_from_hf

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
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


class MergeError(ValueError):
    """Bad input or a failed self-check; the message names the problem and the fix."""


# ---------------------------------------------------------------- reading the torch_dist checkpoint
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
        "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex", "StorageMeta",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "dict", "list", "tuple"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Only the torch.distributed.checkpoint metadata classes (and torch dtypes) may be built."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise MergeError(f"checkpoint .metadata refers to {module}.{name}, which a torch_dist metadata never "
                         "holds: refusing to unpickle it (the file is damaged or not trustworthy)")


@dataclass(frozen=True)
class Item:
    """One Megatron tensor in global naming, and where it lives in the checkpoint."""

    name: str  # global Megatron name the mapping table knows
    key: str  # dist_checkpointing key
    index: tuple[int, ...]  # position along the stacked (layer, expert) axes of `key`
    rule: Rule
    hf_names: tuple[str, ...]


class TorchDistReader:
    """Chunks of tensors of one torch_dist checkpoint directory, read by byte range."""

    def __init__(self, directory: Path):
        self.directory = directory
        backend = json.loads((directory / "metadata.json").read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise MergeError(f"{directory} was saved with the {backend!r} backend; mrl-merge reads torch_dist")
        with open(directory / ".metadata", "rb") as f:
            self.metadata = _MetadataUnpickler(f).load()
        self.tensors = {k: v for k, v in self.metadata.state_dict_metadata.items() if hasattr(v, "chunks")}
        # One saved chunk often holds several experts (all of one EP rank's): the experts are read
        # one after another, so each thread keeps the chunk it read last instead of re-reading it.
        self._last = threading.local()

    def read(self, key: str, index: tuple[int, ...] = ()) -> torch.Tensor:
        """The global tensor `key`, or its slice at `index` along the leading (stacked) axes."""
        meta = self.tensors[key]
        lead = len(index)
        out = torch.empty(tuple(meta.size)[lead:], dtype=meta.properties.dtype)
        filled = 0
        for chunk in meta.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if not all(o <= i < o + n for i, o, n in zip(index, offsets, sizes)):
                continue
            data = self._chunk(key, chunk.offsets)[tuple(i - o for i, o in zip(index, offsets))]
            out[tuple(slice(o, o + n) for o, n in zip(offsets[lead:], data.shape))] = data
            filled += data.numel()
        if filled != out.numel():
            raise MergeError(f"checkpoint tensor {key!r}{list(index) or ''} has chunks covering {filled} of "
                             f"{out.numel()} elements: the checkpoint is incomplete")
        return out

    def _chunk(self, key: str, offsets: torch.Size) -> torch.Tensor:
        last = getattr(self._last, "chunk", None)
        if last is not None and last[0] == (key, tuple(offsets)):
            return last[1]
        self._last.chunk = None  # drop the previous chunk before reading the next
        data = self._read_chunk(key, offsets)
        self._last.chunk = ((key, tuple(offsets)), data)
        return data

    def _read_chunk(self, key: str, offsets: torch.Size) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.metadata.storage_data[MetadataIndex(key, offsets)]
        if info.transform_descriptors:
            raise MergeError(f"{key} is stored with transforms {info.transform_descriptors}: not supported")
        path = self.directory / info.relative_path
        with open(path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        if len(raw) != info.length:
            raise MergeError(f"checkpoint file {path} is truncated: {key} needs bytes up to "
                             f"{info.offset + info.length}; restore the file")
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)


def plan_items(reader: TorchDistReader, spec: ModelSpec) -> list[Item]:
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
                raise MergeError(f"{err} (is the checkpoint of another architecture than {spec.arch}?)") from None
            if rule.export:
                items.append(Item(name, key, index, rule, hf_names))
    return items


def convert_item(reader: TorchDistReader, item: Item, dims: SplitDims, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
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
        raise MergeError(f"--max-shard-size {text!r} is not a size: use e.g. 5GB, 500MB or 2GiB")
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
        raise MergeError(f"merged {arch} weights do not match the HF layout: {len(missing)} missing "
                         f"(first {missing[:1]}), {len(extra)} unexpected (first {extra[:1]})")
    for name, shape in expected.items():
        if written[name] != shape:
            raise MergeError(f"merged tensor {name!r} has shape {list(written[name])}, the HF model expects {list(shape)}")


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


def open_checkpoint(ckpt: str | Path, config: str | Path | None) -> tuple[Path, dict, ModelSpec, Path]:
    """Resolve and check a checkpoint; return (iteration dir, manifest, spec, HF config dir)."""
    try:
        directory = cd.resolve(ckpt)
        manifest = cd.read_manifest(directory)
    except cd.CheckpointDirError as err:
        raise MergeError(str(err)) from None
    if manifest.get("value_head"):
        raise MergeError(f"{directory} is a PPO critic checkpoint (a value head, no LM head): there is no HF causal "
                         "LM to write; merge the actor's checkpoint (the parent of its critic/ directory)")
    hf_dir = directory / "hf"
    if config is not None:
        config = Path(config)
        hf_dir = config if config.is_dir() else config.parent
    try:
        spec = model_spec_from_hf(hf_dir)
    except (UnsupportedModelError, FileNotFoundError, KeyError) as err:
        raise MergeError(f"cannot read the HF config in {hf_dir} ({err}); pass --config with the model's "
                         "HF config directory") from None
    if manifest.get("arch") not in (None, spec.arch):
        raise MergeError(f"{directory} is a {manifest['arch']} checkpoint but the config in {hf_dir} describes a "
                         f"{spec.arch} model: pass the config the checkpoint was trained with")
    return directory, manifest, spec, hf_dir


def merge(ckpt: str | Path, out: str | Path, *, dtype: str = "bf16", max_shard_size: str = "5GB", workers: int = 1,
          force: bool = False, config: str | Path | None = None, progress: bool = True) -> dict:
    """Merge checkpoint `ckpt` into HF directory `out`; return a summary (raises MergeError)."""
    from tqdm import tqdm

    if dtype not in DTYPES:
        raise MergeError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    max_bytes = parse_size(max_shard_size)
    out = Path(out)
    directory, manifest, spec, hf_dir = open_checkpoint(ckpt, config)
    if out.exists() and not force:
        raise MergeError(f"output {out} already exists: pass --force to replace it")
    start = time.perf_counter()
    reader = TorchDistReader(directory)
    items = plan_items(reader, spec)
    expected = expected_hf_layout(hf_dir, spec)
    dims = SplitDims.of(spec)
    staging = out.parent / f"{out.name}.tmp-merge-{os.getpid()}"
    try:
        with cd.atomic_dir(staging) as tmp:
            writer, written = ShardWriter(tmp, max_bytes), {}
            bar = tqdm(total=len(items), unit="tensor", desc="mrl-merge", disable=not progress)
            for converted in _in_order(lambda it: convert_item(reader, it, dims, DTYPES[dtype]), items, workers):
                for name, tensor in converted:
                    if name in written:
                        raise MergeError(f"two checkpoint tensors map onto HF tensor {name!r}: the mapping is ambiguous")
                    written[name] = tuple(tensor.shape)
                    writer.add(name, tensor)
                bar.update()
            bar.close()
            check_layout(written, expected, spec.arch)
            writer.finish()
            cd.copy_hf_metadata(hf_dir, tmp)  # the weights are written above, never FP8
        if out.exists():
            shutil.rmtree(out)
        os.rename(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    seconds = time.perf_counter() - start
    return {"checkpoint": str(directory), "out": str(out), "arch": spec.arch, "step": manifest.get("step"),
            "dtype": dtype, "tensors": len(written), "shards": len(writer.files), "bytes": writer.total_bytes,
            "seconds": round(seconds, 3)}


# ---------------------------------------------------------------- --verify
def _megatron_logits(rank: int, world: int, directory: str, vocab_rows: int, dtype: str) -> torch.Tensor:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from mrl.bridge.verify import probe_tokens
    from mrl.layout import ParallelLayout
    from mrl.megatron.checkpoint import model_sharded_state_dict
    from mrl.megatron.forward import forward_logits
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import initialize_layout

    layout = ParallelLayout()
    initialize_layout(layout)
    spec = model_spec_from_hf(Path(directory) / "hf")
    built = build_model(spec, layout, vocab_divisor=vocab_rows)  # same padded vocabulary as the checkpoint
    sharded = {"model": model_sharded_state_dict(built)}  # one chunk: no VPP in this layout
    loaded = dist_checkpointing.load(sharded, directory, strict=StrictHandling.IGNORE_ALL)
    built.chunks[0].load_state_dict(loaded["model"], strict=False)
    with torch.no_grad():  # the merged file holds weights rounded to `dtype`: round Megatron's the same way
        for name, p in list(built.chunks[0].named_parameters()) + list(built.chunks[0].named_buffers()):
            if p.is_floating_point() and not name.endswith("expert_bias"):
                p.copy_(p.to(DTYPES[dtype]).float())
    return forward_logits(built, probe_tokens(spec.vocab_size))


def verify_merged(directory: str | Path, out: str | Path, dtype: str, tol: float = 1e-4) -> dict:
    """Logits of the merged HF model (transformers) vs the checkpoint loaded in Megatron (TP1)."""
    from mrl.megatron.local_launch import run_local
    from mrl.bridge.verify import probe_tokens, reference_logits

    directory = cd.resolve(directory)
    reader = TorchDistReader(directory)
    vocab_rows = reader.tensors["embedding.word_embeddings.weight"].size[0]
    megatron = run_local(_megatron_logits, 1, str(directory), vocab_rows, dtype)[0]
    spec = model_spec_from_hf(Path(out))
    diff = (megatron - reference_logits(str(out), probe_tokens(spec.vocab_size))).abs().max().item()
    return {"max_abs_diff": diff, "tol": tol, "ok": diff <= tol}
