"""Patches that let megatron-core 0.16.1 run on CPU with gloo, and compute what HF checkpoints mean.

Nothing else in mrl monkeypatches megatron. Each patch lives in its own module with a docstring
that says what upstream does, which versions need the patch and when to drop it. Call
:func:`apply` explicitly (once per process, before building a model); it is idempotent and refuses
an untested megatron-core version instead of guessing.

CPU-only patches never apply when CUDA is available: on a GPU, upstream code paths run unchanged.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

SUPPORTED_MEGATRON_VERSIONS = ("0.16.1",)

# Order matters only where a patch replaces a function another patch wraps; none do today.
PATCH_MODULES = (
    "cpu_rng_tracker",
    "cuda_calls_on_cpu",
    "tensor_cuda_method",
    "torch_norm_sequence_parallel",
    "te_general_gemm_undefined",
    "all_to_all_split_sizes",
    "uneven_sequence_collectives",
    "te_placeholders",
    "cpu_grad_clipping",
    "group_routing_top2",
    "cpu_hybrid_optimizer",
    "checkpoint_without_te",
    "mla_rope_key_gradient",
    "router_replay_fallback",
)

_applied: set[str] = set()


def megatron_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def _patch_module(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")


def apply(skip: tuple[str, ...] = (), *, force_cpu: bool = False) -> list[str]:
    """Apply every patch that this machine needs; return the names applied so far.

    skip: patch names to leave out. The environment variable MRL_SKIP_PATCHES (comma-separated)
    adds to it, so a test can show in spawned workers that each patch is needed.
    force_cpu: apply CPU-only patches even when CUDA is available (tests only).
    """
    skip = tuple(skip) + tuple(n for n in os.environ.get("MRL_SKIP_PATCHES", "").split(",") if n)
    unknown = set(skip) - set(PATCH_MODULES)
    if unknown:
        raise ValueError(f"unknown patch names {sorted(unknown)}; known: {', '.join(PATCH_MODULES)}")
    version = megatron_version()
    if version not in SUPPORTED_MEGATRON_VERSIONS:
        raise RuntimeError(
            f"megatron_patches supports megatron-core {', '.join(SUPPORTED_MEGATRON_VERSIONS)}, "
            f"found {version}. Install a supported version (scripts/setup_env.sh pins it) or "
            "review each patch in megatron_patches/ against the new release before adding it."
        )
    on_cpu = force_cpu or not torch.cuda.is_available()
    for name in PATCH_MODULES:
        if name in _applied or name in skip:
            continue
        module = _patch_module(name)
        if module.CPU_ONLY and not on_cpu:
            continue
        module.apply()
        _applied.add(name)
    return sorted(_applied)


def applied() -> list[str]:
    return sorted(_applied)
