"""Weight updates inside vLLM's workers: the functions mrl/rollout/vllm_engine.py runs on every
worker through `collective_rpc` (module level, so that they pickle by reference).

`sync.apply: load_weights` uses vLLM's layer-wise reload: `initialize_layerwise_reload` puts every
layer back into checkpoint format, each bucket goes through the model's own `load_weights` (which
slices for the engine's TP rank and routes per-expert tensors into its fused expert parameters),
and `finalize_layerwise_reload` re-runs post-load processing. That last step matters: vLLM derives
kernel-format copies from the loaded weights (MLA's W_UK/W_UV, CPU GEMM pre-packing, FP8
quantisation), and a plain `load_weights` after start-up would leave those stale.

`sync.apply: in_place` has no load_weights: a sync plan computed once (mrl/sync/plan.py) says where
each HF tensor's slices go, each worker copies them straight into its parameters, reads them back,
and the architecture's post-apply hooks (POST_APPLY_HOOKS) rebuild the derived state.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from mrl.rollout.vllm_cpu import _check_cpu_experts, _prepack_cpu_experts, _repack_tied_lm_head
from mrl.sync.wire import (Bucket, checksums, checksums_match, describe, give_back_unopened, reused, shared_bytes,
                           unpack)


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
    worker_meta = {"params": params, "tp_rank": get_tensor_model_parallel_rank(),
                   "tp_size": get_tensor_model_parallel_world_size()}
    experts = _expert_layouts(model)
    if experts:  # expert parallel: which experts this worker holds
        worker_meta["experts"] = experts
    return worker_meta


def _expert_layouts(model: torch.nn.Module) -> dict[str, dict]:
    """Per fused-MoE module of an expert-parallel engine, which experts its local slots hold, read
    from vLLM's own expert map (linear or round-robin placement alike): "ids", the global expert id
    of each local slot; its EP rank and size; and what an EPLB engine would differ in (physical
    slots numbering redundant copies, moved at run time), which the sync plan refuses."""
    layouts = {}
    for name, module in model.named_modules():
        manager = getattr(module, "expert_map_manager", None)
        if manager is None or not manager.use_ep or not list(module.parameters(recurse=False)):
            continue  # the layer's wrapper shares the map with the module holding the experts
        expert_map = manager.expert_map.tolist()
        ids = sorted((slot, g) for g, slot in enumerate(expert_map[: manager.global_num_experts]) if slot >= 0)
        config = module.moe_config
        layouts[name] = {"ids": [g for _, g in ids], "ep_rank": manager.ep_rank, "ep_size": manager.ep_size,
                         "eplb": bool(config.moe_parallel_config.enable_eplb),
                         "physical": manager.global_num_experts, "logical": config.num_logical_experts}
    return layouts


# --- in-place apply (sync.apply: in_place): the sync plan's copies, no load_weights ---

def _install_plan(worker: Any, plans: dict[int, list], shapes: dict[str, list[int]]) -> int:
    """Keep this TP rank's copies, by HF name, and the HF shapes they assume in the worker; and the
    names only other workers copy (an expert-parallel engine's other experts: skipped here)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    by_hf: dict[str, list] = {}
    for c in plans[get_tensor_model_parallel_rank()]:
        if c.hf_name is not None:  # padding: nothing to write
            by_hf.setdefault(c.hf_name, []).append(c)
    worker.mrl_sync_plan = by_hf
    worker.mrl_sync_elsewhere = {c.hf_name for plan in plans.values() for c in plan} - set(by_hf) - {None}
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
        if name in worker.mrl_sync_elsewhere:
            return [], []
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


def _zero_kv_cache(worker: Any) -> None:
    for cache in worker.model_runner.kv_caches:
        cache.zero_()


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
