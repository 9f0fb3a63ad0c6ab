"""Route megatron-core's hard-wired CUDA calls to the CPU.

Upstream (megatron-core 0.16.1): many modules call `torch.cuda.current_device()` for tensor
placement, `torch.cuda.synchronize()`, CUDA streams and events, and create tensors with the
literal `device="cuda"` or with `pin_memory=True` for an upload (examples at ENTRY_MODULES). On a
CPU build each of these raises "Torch not compiled with CUDA enabled" (or "pin_memory=True
requires a CUDA or other accelerator backend").

Patch: in every loaded `megatron.core` module, the module-level name `torch` is replaced by a thin
proxy of the torch module whose `cuda` namespace and tensor factories answer on the CPU
(`_make_proxy`). torch itself is untouched, so vLLM, transformers and mrl see the real module.

Drop when: megatron-core selects its device through an abstraction instead of literal CUDA calls
(not the case up to 0.16.1).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import torch

CPU_ONLY = True

# Importing these pulls in every megatron.core module mrl uses; all of them get the proxy. Only
# megatron modules imported by `apply()` (and their imports) are covered, which is why `apply()` must
# run before models are built. CUDA calls they make include the literal `device="cuda"` of the token
# counter in `pipeline_parallel/schedules.py`, the shape exchange in `p2p_communication.py`, MoE
# router buffers and the global memory buffer in `utils.py`, and `pin_memory=True` for context
# parallelism's rotary indices in `rope_utils.py`.
ENTRY_MODULES = (
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.multi_latent_attention",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.strategies.torch",  # torch_dist save: preload_tensors synchronizes
)
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint", "as_tensor")


class _NoOpStreamOrEvent:
    """Stands in for torch.cuda.Stream / Event: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        # wait_stream, record_event, synchronize, ...: nothing to wait for; return an event.
        return lambda *args, **kwargs: _NoOpStreamOrEvent()

    def __eq__(self, other) -> bool:
        # There is one CPU "stream": code that compares streams must see no side stream.
        return isinstance(other, _NoOpStreamOrEvent)

    def __hash__(self) -> int:
        return 0

    def elapsed_time(self, other) -> float:
        return 0.0

    def query(self) -> bool:
        return True


class _CudaOnCpu(types.SimpleNamespace):
    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _cpu_device(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int):  # a CUDA ordinal from current_device()
        return "cpu"
    return device


def _on_cpu(factory):
    def call(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):  # a staging copy for a CUDA upload (CP's rotary indices): plain memory
            kwargs["pin_memory"] = False
        return factory(*args, **kwargs)

    return call


def _make_proxy() -> types.ModuleType:
    """The torch module as megatron.core sees it: its `cuda` namespace answers on the CPU
    (current_device → "cpu", synchronize → no-op, streams/events → no-op objects) and its tensor
    factories map `device="cuda"` to the CPU and pin no memory."""
    proxy = types.ModuleType("torch")
    proxy.__dict__.update({k: v for k, v in torch.__dict__.items() if not k.startswith("__")})
    proxy.__getattr__ = lambda name: getattr(torch, name)  # attributes added to torch later
    for name in _FACTORIES:
        setattr(proxy, name, _on_cpu(getattr(torch, name)))
    proxy.cuda = _CudaOnCpu(
        current_device=lambda: "cpu",
        device_count=lambda: 0,
        is_available=lambda: False,
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        Stream=_NoOpStreamOrEvent,
        Event=_NoOpStreamOrEvent,
        current_stream=lambda *a, **k: _NoOpStreamOrEvent(),
        default_stream=lambda *a, **k: _NoOpStreamOrEvent(),
        stream=lambda *a, **k: contextlib.nullcontext(),
        nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None),
        memory_allocated=lambda *a, **k: 0,
        max_memory_allocated=lambda *a, **k: 0,
    )
    return proxy


PROXY = None


def apply() -> None:
    global PROXY
    for name in ENTRY_MODULES:
        importlib.import_module(name)
    PROXY = PROXY or _make_proxy()
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = PROXY
