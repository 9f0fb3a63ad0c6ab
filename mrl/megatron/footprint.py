"""What Megatron itself allocates for one rank's model state, found without allocating it.

The model is built on the meta device (no memory), wrapped in megatron-core's own
DistributedDataParallel, and handed to the distributed optimizer's own sharding (the classmethods
DistributedOptimizer uses in its constructor), all under a torch function mode that puts every
tensor megatron creates on the meta device. What comes back is read off Megatron's objects: the
param and grad buffers' sizes and the fp32 main-parameter shards it made. mrl.plan computes the
same numbers from its own rules; tests/distributed/test_plan_static.py holds the two equal,
up to DeepSeek-V3 671B.

The optimizer is not constructed as a whole: its constructor wants gloo process groups, which a
fake (peer-less) world cannot create, and Adam creates its moments at the first step, which meta
tensors cannot take. They are counted as two fp32 tensors the size of each optimized parameter
shard (torch's and TE's Adam: exp_avg, exp_avg_sq); test_plan_static.py checks that on a real CPU
build after a step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mrl.megatron.model import BuiltModel

# What Megatron's distributed optimizer accepts (it checks `param.type()`; meta tensors report
# "torch.meta....", which it would refuse).
ADAM_MOMENT_BYTES = 2 * 4  # exp_avg and exp_avg_sq, fp32, per optimized element
_CUDA_TYPE = {torch.bfloat16: "torch.cuda.BFloat16Tensor", torch.float16: "torch.cuda.HalfTensor",
              torch.float32: "torch.cuda.FloatTensor"}


class _OnMeta(TorchFunctionMode):
    """Every factory call with a device lands on meta; meta tensors report a CUDA tensor type."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and func is not torch.Tensor.to:
            kwargs["device"] = "meta"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "meta":
            return _CUDA_TYPE[args[0].dtype]
        return func(*args, **kwargs)


def static_footprint(built: BuiltModel) -> dict[str, Any]:
    """Megatron's DDP buffers and distributed-optimizer main shards for `built` (built on meta,
    Megatron's process groups initialised), with mrl's DDP settings (make_trainable).

    Returns {"buffers": [{param_dtype, grad_dtype, expert, dp, numel, numel_unpadded}],
    "weight_bytes", "grad_bytes", "main_param_bytes", "optimized_elements", "optimizer_bytes"}: the
    parameter and gradient buffers, the fp32 main copies this DP rank keeps, the parameter elements
    whose Adam moments it keeps, and main copies plus moments.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    model_config = built.chunks[0].config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    optimizer_config = OptimizerConfig(optimizer="adam", bf16=model_config.bf16, params_dtype=model_config.params_dtype,
                                       use_distributed_optimizer=True)
    result = dict(buffers=[], weight_bytes=0, grad_bytes=0, main_param_bytes=0, optimized_elements=0)
    with _OnMeta():
        chunks = [DistributedDataParallel(model_config, ddp_config, chunk, disable_bucketing=index > 0)
                  for index, chunk in enumerate(built.chunks)]
        # get_megatron_optimizer builds one DistributedOptimizer over every chunk's dense buffers
        # and one over the expert buffers; each shards its buffers independently.
        for kind in ("buffers", "expert_parallel_buffers"):
            buffers = [b for chunk in chunks for b in getattr(chunk, kind)]
            for b in buffers:
                result["buffers"].append(dict(param_dtype=str(b.param_dtype), grad_dtype=str(b.grad_dtype),
                                              expert=kind != "buffers", dp=b.data_parallel_world_size,
                                              numel=b.numel, numel_unpadded=b.numel_unpadded))
                result["weight_bytes"] += b.param_data.numel() * b.param_data.element_size()
                result["grad_bytes"] += b.grad_data.numel() * b.grad_data.element_size()
            if buffers:
                main, optimized = _main_shards(DistributedOptimizer, buffers, optimizer_config)
                result["main_param_bytes"] += main
                result["optimized_elements"] += optimized
    result["optimizer_bytes"] = result["main_param_bytes"] + ADAM_MOMENT_BYTES * result["optimized_elements"]
    return result


def _main_shards(optimizer_class: Any, buffers: list, config: Any) -> tuple[int, int]:
    """DistributedOptimizer.__init__'s sharding: (bytes of the fp32 main copies it makes, elements
    it optimizes: those copies plus the slices of fp32 parameters, which are their own main copy)."""
    gbuf_ranges = [optimizer_class._build_gbuf_range_map(b) for b in buffers]
    param_gbuf_map = optimizer_class._build_model_param_gbuf_map(gbuf_ranges)
    params = [p for b in buffers for p in b.params]
    _, group_ranges = optimizer_class._build_optimizer_group_ranges([{"params": params}], gbuf_ranges)
    _, _, _, shard_fp32, shard_main = optimizer_class._build_model_and_main_param_groups(
        gbuf_ranges, param_gbuf_map, group_ranges, config)
    main = [t for group in shard_main for t in group]
    fp32 = [t for group in shard_fp32 for t in group]
    return (sum(t.numel() * t.element_size() for t in main), sum(t.numel() for t in main + fp32))


class SavedTensorMeter:
    """Live bytes of the tensors autograd holds for backward, and their peak: activation memory,
    measured where no allocator statistics exist (CPU).

    A context manager around forward and backward passes (torch.autograd.graph.saved_tensors_hooks).
    Each storage counts once however many ops save a view of it; parameters and buffers in
    `exclude` are not activations and do not count. A save lasts as long as autograd keeps its
    packed handle: until the backward pass has used it, or the graph is freed (some saves, such
    as the router's indices, are never read back), so `peak` is the most held at once (with a
    pipeline schedule: all in-flight micro-batches).
    """

    def __init__(self, exclude: list[torch.Tensor]):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._saves: dict[int, int] = {}  # storage pointer → handles alive
        self._sizes: dict[int, int] = {}
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda handle: handle.tensor)

    def _pack(self, tensor: torch.Tensor) -> "_Saved":
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._exclude or storage.nbytes() == 0:
            return _Saved(tensor, None, None)
        if key not in self._saves:
            self._saves[key], self._sizes[key] = 0, storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self._saves[key] += 1
        return _Saved(tensor, key, self)

    def _release(self, key: int) -> None:
        self._saves[key] -= 1
        if self._saves[key] == 0:
            del self._saves[key]
            self.live -= self._sizes.pop(key)

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class _Saved:
    """Autograd's packed form of one saved tensor; the meter counts it until autograd drops it."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: int | None, meter: SavedTensorMeter | None):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        if self.meter is not None:
            self.meter._release(self.key)


def activation_peak(built: BuiltModel, micro_batches: list[dict], loss_fn) -> int:
    """Peak bytes autograd holds for backward while Megatron's pipeline schedule runs one forward
    and backward pass over `micro_batches` (equal-shaped dicts with "tokens" [b, s]) with
    `loss_fn(output, micro_batch) -> (loss, metrics)`; with CP each micro-batch is first cut to
    this rank's positions, as train_step does. No optimizer step (it saves nothing for
    backward, and megatron-core refuses bf16 parameters on a CPU)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mrl.megatron.context_parallel import local_positions, split_micro_batch

    size, seq = micro_batches[0]["tokens"].shape
    positions = local_positions(seq).unsqueeze(0).to(built.device)

    def forward_step(iterator, model):
        micro = split_micro_batch(next(iterator), built.device)  # CP: this rank's part of each sequence, as train_step
        return model(micro["tokens"], positions, None), lambda output: loss_fn(output, micro)

    chunks = built.chunks
    state = [t for chunk in chunks for t in (*chunk.parameters(), *chunk.buffers())]
    iterators = [iter(micro_batches) for _ in chunks]  # every virtual chunk walks the micro-batches
    with SavedTensorMeter(exclude=state) as meter:
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(micro_batches),
            seq_length=seq, micro_batch_size=size, forward_only=False)
    return meter.peak
