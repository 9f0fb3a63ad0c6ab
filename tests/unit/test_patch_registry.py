"""megatron_patches.apply(): explicit, idempotent, version-checked; CPU-only patches stay off on GPUs.

Most checks run in this process against the registry alone: the `registry` fixture gives apply()
a fresh record and replaces every patch module's apply() by a recorder, so nothing in megatron or
torch is changed. The check that real patches are idempotent runs in a fresh interpreter, because
apply() changes megatron for the whole process.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import megatron_patches

PATCH_DIR = Path(megatron_patches.__file__).parent
NOT_MONKEYPATCHES = ("sdpa_attention",)  # put into the layer spec by mrl.megatron.model
CPU_ONLY = {name: megatron_patches._patch_module(name).CPU_ONLY for name in megatron_patches.PATCH_MODULES}


@pytest.fixture
def registry(monkeypatch) -> list[str]:
    """Names whose module apply() ran, in order; megatron_patches' record starts empty."""
    calls: list[str] = []
    monkeypatch.setattr(megatron_patches, "_applied", set())
    monkeypatch.delenv("MRL_SKIP_PATCHES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in megatron_patches.PATCH_MODULES:
        monkeypatch.setattr(megatron_patches._patch_module(name), "apply", lambda name=name: calls.append(name))
    return calls


def test_apply_is_idempotent(registry):
    first = megatron_patches.apply()
    assert first == sorted(megatron_patches.PATCH_MODULES)
    assert registry == list(megatron_patches.PATCH_MODULES)  # in registry order
    assert megatron_patches.apply() == first
    assert registry == list(megatron_patches.PATCH_MODULES), "a second apply() ran patches again"
    assert megatron_patches.applied() == first


def test_refuses_an_unsupported_megatron_version(registry, monkeypatch):
    monkeypatch.setattr(megatron_patches, "megatron_version", lambda: "0.99.0")
    with pytest.raises(RuntimeError) as refused:
        megatron_patches.apply()
    message = str(refused.value)
    assert "supports megatron-core 0.16.1, found 0.99.0" in message
    assert "review each patch" in message  # says what to do, not only what is wrong
    assert registry == [] and megatron_patches.applied() == []  # refused before patching anything


def test_cpu_only_patches_are_not_applied_when_cuda_is_available(registry, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_gpu = megatron_patches.apply()
    assert on_gpu == sorted(name for name, cpu_only in CPU_ONLY.items() if not cpu_only)
    assert set(registry) == set(on_gpu)
    # force_cpu (tests only) adds the CPU-only ones.
    assert megatron_patches.apply(force_cpu=True) == sorted(megatron_patches.PATCH_MODULES)


def test_both_kinds_of_patch_exist():
    # Otherwise the CUDA gating test above would prove nothing.
    assert set(CPU_ONLY.values()) == {True, False}


def test_forced_tensor_cuda_patch_never_shadows_real_cuda(monkeypatch):
    from megatron_patches import tensor_cuda_method

    cuda_method = torch.Tensor.cuda
    monkeypatch.setattr(torch.Tensor, "cuda", cuda_method)  # restored even if the patch misbehaves
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    tensor_cuda_method.apply()
    assert torch.Tensor.cuda is cuda_method


def test_skip_argument_holds_for_one_call_and_environment_for_every_call(registry, monkeypatch):
    everything = sorted(megatron_patches.PATCH_MODULES)
    assert "cpu_rng_tracker" not in megatron_patches.apply(skip=("cpu_rng_tracker",))
    # A later plain apply() (initialize_layout makes one) applies what the argument skipped ...
    assert megatron_patches.apply() == everything
    # ... so spawned workers skip through the environment, which every call reads.
    monkeypatch.setattr(megatron_patches, "_applied", set())
    registry.clear()
    monkeypatch.setenv("MRL_SKIP_PATCHES", "te_placeholders,cpu_rng_tracker")
    for _ in range(2):
        assert megatron_patches.apply() == [n for n in everything if n not in ("te_placeholders", "cpu_rng_tracker")]
    assert "te_placeholders" not in registry and "cpu_rng_tracker" not in registry


@pytest.mark.parametrize("via", ["argument", "environment"])
def test_unknown_skip_name_is_an_error(registry, monkeypatch, via):
    if via == "environment":
        monkeypatch.setenv("MRL_SKIP_PATCHES", "no_such_patch")
    with pytest.raises(ValueError, match=r"unknown patch names \['no_such_patch'\]"):
        megatron_patches.apply(skip=("no_such_patch",) if via == "argument" else ())
    assert registry == []


def test_real_patches_are_idempotent():
    """Applying twice changes nothing; re-running a module's own apply() stacks no second wrapper."""
    code = """
        import torch, megatron_patches as mp
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.tensor_parallel import mappings, random
        from megatron.core.transformer import torch_norm
        from megatron.core.transformer.moe import moe_utils
        from megatron.core.transformer.moe.router_replay import RouterReplay

        def patched():
            return {
                "tracker.add": random.CudaRNGStatesTracker.add,
                "tracker.fork": random.CudaRNGStatesTracker.fork,
                "schedules.torch": schedules.torch,
                "Tensor.cuda": torch.Tensor.cuda,
                "WrappedTorchNorm.__new__": torch_norm.WrappedTorchNorm.__new__,
                "te_general_gemm": getattr(moe_utils, "te_general_gemm", "unbound"),
                "_AllToAll.forward": mappings._AllToAll.forward,
                "_gather_along_first_dim": mappings._gather_along_first_dim,
                "_reduce_scatter_along_first_dim": mappings._reduce_scatter_along_first_dim,
                "group_limited_topk": moe_utils.group_limited_topk,
                "RouterReplay.get_replay_topk": RouterReplay.get_replay_topk,
            }

        upstream = patched()
        first = mp.apply()
        assert first == sorted(mp.PATCH_MODULES), first
        after_first = patched()
        changed = sorted(k for k in upstream if upstream[k] is not after_first[k])
        assert changed == sorted(upstream), f"not patched: {set(upstream) - set(changed)}"
        assert mp.apply() == first
        assert patched() == after_first, "a second apply() changed megatron"
        for name in mp.PATCH_MODULES:
            mp._patch_module(name).apply()
        again = patched()
        stacked = [k for k in after_first if again[k] is not after_first[k]]
        assert not stacked, f"re-running the modules' apply() re-wrapped {stacked}"
        print("OK")
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


def test_every_patch_module_is_registered():
    modules = {p.stem for p in PATCH_DIR.glob("*.py") if p.stem != "__init__"}
    assert modules == set(megatron_patches.PATCH_MODULES) | set(NOT_MONKEYPATCHES)
    assert len(set(megatron_patches.PATCH_MODULES)) == len(megatron_patches.PATCH_MODULES)


@pytest.mark.parametrize("name", [*megatron_patches.PATCH_MODULES, *NOT_MONKEYPATCHES])
def test_every_patch_documents_upstream_and_when_to_drop(name):
    # Read from the source: importing sdpa_attention would import megatron into this process.
    tree = ast.parse((PATCH_DIR / f"{name}.py").read_text())
    doc = ast.get_docstring(tree) or ""
    assert "Upstream" in doc and "Drop when" in doc, f"{name}: docstring lacks 'Upstream' / 'Drop when'"
    cpu_only = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["CPU_ONLY"]
        and isinstance(node.value, ast.Constant)
    ]
    assert len(cpu_only) == 1 and isinstance(cpu_only[0], bool), f"{name}: needs one module-level CPU_ONLY = True/False"
    if name in megatron_patches.PATCH_MODULES:
        assert CPU_ONLY[name] is cpu_only[0]
