"""Training checkpoints of the Megatron actor (docs/checkpoint-format.md), save and resume.

Megatron dist_checkpointing (torch_dist) holds the model and optimizer as sharded tensors with
global keys, so a checkpoint loads onto any TP/PP/EP layout; the scheduler, step, data position and
run config are common entries, and every rank's RNG states are a ShardedObject indexed by rank
(restored only when the world size is unchanged: on another layout the RNG streams differ anyway).

Directory mechanics (temporary directory, fsync, manifest last, rename, `latest`) are those of
mrl.checkpoint_dir; rank 0 does them, every rank writes its shards. Async saves snapshot the state
(a copy in CPU memory) before returning, write in a background thread, and publish (manifest,
rename, `latest`) only in `wait()`, which every rank calls at the same point (it is collective).
Each rank checksums the shard files it wrote right after writing them (from the page cache, in
parallel over ranks); rank 0 gathers the digests into the manifest and hashes the few files left.
"""

from __future__ import annotations

import os
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mrl import checkpoint_dir as cd
from mrl.megatron.training import Trainable

if TYPE_CHECKING:
    from mrl.megatron.model import BuiltModel

# Optimizer checkpoint format, for save and load alike: "fully_reshardable" keys every Adam state by
# its parameter's global key (the distributed optimizer gathers over DP to write it), so optimizer
# state loads onto any TP/PP/EP/DP layout; without "chained_optim_avoid_prefix" Megatron prefixes
# keys with the index of the chained (dense/expert) optimizer. Plain Adam ignores the sharding type.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
CONTENTS = ["model", "optimizer", "scheduler", "rng", "data"]
WRITE_TIMEOUT_S = 1800.0  # a background write that takes longer than this is reported as hung


class CheckpointMismatchError(ValueError):
    """A checkpoint that does not fit the model it is loaded into."""


def nest_chunks(per_chunk: list[dict]) -> dict:
    """Per-chunk state dicts as one: one chunk's as is; with VPP, {"chunk<i>": chunk i's}.

    Files index tensors by their global ShardedTensor keys, so this nesting does not reach the
    checkpoint's contents; it only keeps VPP chunks apart, whose dict keys are local ("decoder.layers.0…"
    in every chunk) and would overwrite each other in one flat dict.
    """
    return per_chunk[0] if len(per_chunk) == 1 else {f"chunk{i}": state for i, state in enumerate(per_chunk)}


def unnest_chunks(nested: dict, count: int) -> list[dict]:
    """The inverse of nest_chunks, for `count` chunks."""
    return [nested] if count == 1 else [nested[f"chunk{i}"] for i in range(count)]


def model_sharded_state_dict(built: BuiltModel) -> dict:
    """The model's sharded state dict, chunks nested (nest_chunks): the one keying of VPP chunks,
    for training checkpoints and `mrl convert` alike."""
    return nest_chunks([chunk.sharded_state_dict() for chunk in built.chunks])


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        # As tensors and plain numbers: the checkpoint must load with torch.load(weights_only=True).
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded(state: Any) -> Any:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


def _layout_dict(trainable: Trainable) -> dict:
    layout = trainable.built.layout
    return {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "etp": layout.etp, "vpp": layout.vpp, "cp": layout.cp}


def _broadcast_path(path: Path | None) -> Path:
    box = [str(path) if path is not None else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return Path(box[0])


@dataclass
class PendingSave:
    """A save whose files may still be in flight; `wait()` publishes it (collective: every rank)."""

    target: Path
    tmp: Path
    manifest: dict
    request: Any
    hf_dir: str | None
    thread: threading.Thread | None = None
    error: list = field(default_factory=list)
    checksums: dict = field(default_factory=dict)  # this rank's shard files → xxh3-64
    done: bool = False

    def wait(self, timeout_s: float = WRITE_TIMEOUT_S) -> Path:
        """Finish writing, finalize Megatron's metadata, then (rank 0) manifest, rename, `latest`."""
        if self.done:
            return self.target
        if self.thread is not None:
            self.thread.join(timeout_s)
            if self.thread.is_alive():
                raise TimeoutError(f"checkpoint write to {self.tmp} did not finish in {timeout_s:.0f}s")
        failed = torch.tensor([1 if self.error else 0])
        torch.distributed.all_reduce(failed)  # every rank must agree before anything is published
        if failed.item():
            raise RuntimeError(f"checkpoint write to {self.tmp} failed on {failed.item()} rank(s): {self.error[:1]}")
        for finalize in self.request.finalize_fns:  # Megatron's .metadata, written by rank 0
            finalize()
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, self.checksums)
        if torch.distributed.get_rank() == 0:
            checksums = {name: digest for part in gathered for name, digest in part.items()}
            _publish(self.tmp, self.target, self.manifest | {"checksums": checksums}, self.hf_dir)
        torch.distributed.barrier()
        self.done = True
        return self.target


def _publish(tmp: Path, target: Path, manifest: dict, hf_dir: str | None) -> None:
    if hf_dir is not None:
        cd.copy_hf_metadata(hf_dir, tmp / "hf")
    cd._fsync_tree(tmp)
    cd.write_manifest(tmp, **manifest)
    tmp.rename(target)
    cd._fsync_path(target.parent)
    cd.write_latest(target.parent, target.name)


def _rank_checksums(tmp: Path) -> dict[str, str]:
    """Checksums of the shard files this rank wrote (torch_dist names them __<rank>_<n>.distcp)."""
    return {path.name: cd.file_checksum(path) for path in tmp.glob(f"__{torch.distributed.get_rank()}_*.distcp")}


def _snapshot_buckets(buckets: list) -> list:
    """Copies of the write buckets' tensors: on CPU Megatron's preload keeps the live tensors."""
    return [(name, key, (data, [(item, tensor.detach().clone()) for item, tensor in tensors]))
            for name, key, (data, tensors) in buckets]


def save_checkpoint(
    root: str | Path,
    trainable: Trainable,
    *,
    step: int,
    data_state: dict | None = None,
    config: dict | None = None,
    hf_dir: str | None = None,
    async_save: bool = False,
) -> PendingSave:
    """Save `trainable` as ROOT/iter_<step> (collective). Sync saves return a finished PendingSave;
    async ones return once the state is snapshotted: call `.wait()` on every rank before the next
    save and before exit (only then are the manifest and `latest` written)."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    target = root / cd.iter_name(step)
    tmp = None
    if torch.distributed.get_rank() == 0:
        if target.exists():
            raise FileExistsError(f"{target} already exists: step {step} was saved before")
        root.mkdir(parents=True, exist_ok=True)
        cd.remove_stale_tmp(root)
        tmp = root / f"{cd.TMP_PREFIX}{target.name}-{os.getpid()}"
        tmp.mkdir()
    tmp = _broadcast_path(tmp)
    model_sd = model_sharded_state_dict(trainable.built)
    state = {
        "model": model_sd,
        "optimizer": trainable.optimizer.sharded_state_dict(model_sd, metadata=OPTIMIZER_METADATA),
        "scheduler": trainable.scheduler.state_dict(),
        "rng": _rng_sharded(_rng_state()),
        "step": step,
        "data": data_state or {},
        "config": config or {},
    }
    manifest = {"step": step, "arch": trainable.built.spec.arch, "value_head": trainable.built.value_head,
                "layout": _layout_dict(trainable),
                "params_dtype": str(trainable.built.chunks[0].config.params_dtype).removeprefix("torch."),
                "world_size": torch.distributed.get_world_size(), "contents": CONTENTS}
    request = dist_checkpointing.save(state, str(tmp), async_sharded_save=True)
    args = list(request.async_fn_args)
    args[1] = _snapshot_buckets(request.preload_fn())  # tensors staged: training may go on
    pending = PendingSave(target, tmp, manifest, request, hf_dir)

    def write() -> None:
        try:
            request.async_fn(*args, **request.async_fn_kwargs)
            pending.checksums = _rank_checksums(tmp)
        except BaseException as err:  # noqa: BLE001 - reported by wait() on every rank
            pending.error.append(repr(err))

    if async_save:
        pending.thread = threading.Thread(target=write, name=f"ckpt-{target.name}", daemon=True)
        pending.thread.start()
    else:
        write()
        pending.wait()
    return pending


class SavePolicy:
    """Save every `interval` steps, keep the newest `keep` iterations (older ones pruned by rank 0)."""

    def __init__(self, root: str | Path, interval: int, keep: int | None = None, async_save: bool = False):
        if interval < 1 or (keep is not None and keep < 1):
            raise ValueError(f"save interval ({interval}) and keep ({keep}) must be >= 1")
        self.root, self.interval, self.keep, self.async_save = Path(root), interval, keep, async_save
        self.pending: PendingSave | None = None

    def maybe_save(self, trainable: Trainable, step: int, **kwargs: Any) -> bool:
        """Save at multiples of the interval (finishing the previous async save first)."""
        if step % self.interval:
            return False
        self.finish()
        self.pending = save_checkpoint(self.root, trainable, step=step, async_save=self.async_save, **kwargs)
        if not self.async_save:
            self._prune()
        return True

    def finish(self) -> None:
        """Publish the in-flight save, if any (collective), then prune."""
        if self.pending is not None and not self.pending.done:
            self.pending.wait()
            self._prune()

    def _prune(self) -> None:
        if self.keep is not None and torch.distributed.get_rank() == 0:
            cd.prune(self.root, self.keep)
        torch.distributed.barrier()


def _checked_manifest(directory: Path, built: BuiltModel, *, value_head: bool) -> dict:
    """The checkpoint's manifest, after checking it holds this architecture, and a critic
    (value_head) or a policy as asked."""
    manifest = cd.read_manifest(directory)
    if manifest.get("arch") != built.spec.arch:
        raise CheckpointMismatchError(
            f"checkpoint {directory} holds a {manifest.get('arch')!r} model but the model being loaded is "
            f"{built.spec.arch!r}: pass a checkpoint of this architecture or build the matching model"
        )
    if bool(manifest.get("value_head")) != value_head:
        kinds = {True: "a PPO critic (value head)", False: "a policy (LM head)"}
        raise CheckpointMismatchError(
            f"checkpoint {directory} holds {kinds[bool(manifest.get('value_head'))]} but {kinds[value_head]} is "
            "needed here: a critic's checkpoints are under the run's checkpoint.dir/critic"
        )
    return manifest


def load_policy_weights(path: str | Path, built: BuiltModel) -> None:
    """The weights alone of a policy checkpoint, into `built` (collective): the frozen reference,
    or a critic's transformer, whose value head (its output_layer) keeps its initialisation, or the
    policy RL starts from. Optimizer and scheduler are untouched.

    `path` is an mrl checkpoint or a torch_dist checkpoint of Megatron-LM's training loop (its
    layout: mrl/megatron_lm_dir.py): both hold the model under the same global sharded keys. A
    Megatron-LM checkpoint was checked against the model's HF config on the driver before the
    workers started (checkpoints_tools.merge.plan); its common.pt (pickled run args) is not read."""
    from megatron.core import dist_checkpointing

    located = cd.locate(path)
    directory, common_strategy = located.directory, None
    if located.megatron_lm is None:
        _checked_manifest(directory, built, value_head=False)
    elif located.megatron_lm.format != "torch_dist":
        raise CheckpointMismatchError(
            f"{directory} is a legacy (torch format) Megatron-LM checkpoint, which only mrl-merge reads: merge it "
            "(mrl-merge CKPT --hf-config HF_DIR --out DIR) and start from the HF directory (model.path=DIR)")
    else:
        common_strategy = _weights_only_common()

    def skipped(key: str) -> bool:
        # A critic's own parameters are in no policy checkpoint; a Megatron-LM run's _extra_state
        # (Transformer Engine's FP8 scaling) is not the weights, and is not loaded with them.
        return built.value_head and key.startswith("output_layer.") or \
            located.megatron_lm is not None and key.endswith("_extra_state")

    requests = [{key: value for key, value in chunk.sharded_state_dict().items() if not skipped(key)}
                for chunk in built.chunks]
    loaded = dist_checkpointing.load({"model": nest_chunks(requests)}, str(directory),
                                     common_strategy=common_strategy)["model"]
    for chunk, state in zip(built.chunks, unnest_chunks(loaded, len(built.chunks)), strict=True):
        missing, unexpected = chunk.load_state_dict(state, strict=False)
        wrong = [key for key in missing if not skipped(key)] + list(unexpected)
        if wrong:
            raise CheckpointMismatchError(f"checkpoint {directory} does not fill these parameters: {wrong[:5]}")


def _weights_only_common() -> Any:
    """dist_checkpointing's common-state loader that returns nothing: Megatron-LM's common.pt pickles
    the run's args (classes of megatron.training and others), and loading weights needs none of it."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class WeightsOnly(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir: Any) -> dict:
            return {}

    return WeightsOnly()


def load_checkpoint(path: str | Path, trainable: Trainable, *, load_optimizer: bool = True) -> dict:
    """Restore model, optimizer, scheduler and (same world size) RNG from a checkpoint (collective).

    `path` is a checkpoint root (follows `latest`) or an iteration directory. Returns
    {"step", "data", "config", "manifest"}.
    """
    from megatron.core import dist_checkpointing

    directory = cd.resolve(path)
    manifest = _checked_manifest(directory, trainable.built, value_head=trainable.built.value_head)
    contents = set(manifest.get("contents", []))
    model_sd = model_sharded_state_dict(trainable.built)
    request: dict = {"model": model_sd}
    if load_optimizer and "optimizer" in contents and trainable.config.offload_fraction > 0 and not torch.cuda.is_available():
        # FP32Optimizer/Float16Optimizer around a HybridDeviceOptimizer (CPU: no distributed optimizer)
        # call its init_state_fn, which megatron leaves None, and the restored state is moved with .to("cuda").
        raise ValueError(f"{directory}: resuming optimizer state with optim.offload_fraction > 0 is not supported on "
                         "CPU (megatron-core 0.16.1's offload optimizer restores state only inside the distributed "
                         "optimizer, which needs CUDA); set optim.offload_fraction: 0 to resume on CPU")
    if load_optimizer and "optimizer" in contents:
        request["optimizer"] = trainable.optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata=OPTIMIZER_METADATA
        )
    same_world = manifest.get("world_size") == torch.distributed.get_world_size()
    if "rng" in contents and same_world:
        request["rng"] = _rng_sharded(_rng_state())
    loaded = dist_checkpointing.load(request, str(directory))
    chunks = trainable.built.chunks
    for chunk, state in zip(chunks, unnest_chunks(loaded["model"], len(chunks)), strict=True):
        chunk.load_state_dict(state, strict=True)
    if "optimizer" in request:
        trainable.optimizer.load_state_dict(loaded["optimizer"])
    if "scheduler" in loaded:
        trainable.scheduler.load_state_dict(loaded["scheduler"])
    if "rng" in request:
        _set_rng_state(loaded["rng"])
    trainable.step = int(loaded.get("step", manifest["step"]))
    return {"step": trainable.step, "data": loaded.get("data", {}), "config": loaded.get("config", {}),
            "manifest": manifest}
