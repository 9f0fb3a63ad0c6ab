"""megatron_patches.apply(): explicit, idempotent, version-checked; CPU-only patches stay off on GPUs.

apply() changes megatron for the whole process, so these checks run in a fresh interpreter.
"""

import importlib
import subprocess
import sys
import textwrap

import pytest

import megatron_patches


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_idempotent_and_version_checked():
    proc = _run("""
        import megatron_patches as mp
        first = mp.apply()
        assert first == sorted(mp.PATCH_MODULES), first
        assert mp.apply() == first
        mp.megatron_version = lambda: "0.99.0"
        mp._applied.clear()
        try:
            mp.apply()
        except RuntimeError as err:
            print("REFUSED", err)
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REFUSED megatron_patches supports megatron-core 0.16.1, found 0.99.0" in proc.stdout


def test_cpu_only_patches_are_not_applied_when_cuda_is_present():
    proc = _run("""
        import torch, megatron_patches as mp
        torch.cuda.is_available = lambda: True
        print(",".join(mp.apply()))
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    applied = set(proc.stdout.strip().split(","))
    for name in megatron_patches.PATCH_MODULES:
        cpu_only = importlib.import_module(f"megatron_patches.{name}").CPU_ONLY
        assert (name in applied) != cpu_only, name


def test_unknown_skip_name_is_an_error():
    with pytest.raises(ValueError, match="unknown patch names"):
        megatron_patches.apply(skip=("no_such_patch",))


@pytest.mark.parametrize("name", [*megatron_patches.PATCH_MODULES, "sdpa_attention"])
def test_every_patch_documents_upstream_and_when_to_drop(name):
    module = importlib.import_module(f"megatron_patches.{name}")
    assert "Upstream" in module.__doc__ and "Drop when" in module.__doc__
    assert isinstance(module.CPU_ONLY, bool)
