"""The CUDA path of the actor offload (mrl/megatron/offload.py): GPU memory is freed while the state
is away and the bytes come back unchanged. GPU-only: skipped without CUDA (no GPU was lent when this
was written, so it has not run yet)."""

from __future__ import annotations

import pytest
import torch

from mrl.megatron.offload import StateOffloader

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA offload path needs a GPU")


def test_cuda_storages_are_freed_and_restored():
    weights = torch.randn(64, 1 << 16, device="cuda")  # 16 MiB
    view, grads = weights[3:], torch.randn(1 << 20, device="cuda")
    host_only = torch.randn(1000)  # already in host memory: not moved, not counted
    before, expected = torch.cuda.memory_allocated(), weights.clone().cpu()
    parts = {"weights": [weights, view, host_only], "grads": [grads], "optimizer": [], "reference": []}
    offloader = StateOffloader(lambda part: parts[part])
    report = offloader.offload(["weights", "grads"])
    assert report["moved"] and report["by_part"] == {"weights": weights.numel() * 4, "grads": grads.numel() * 4}
    assert torch.cuda.memory_allocated() <= before - report["bytes"]
    assert all(h.host.is_pinned() for held in offloader.away.values() for h in held)
    back = offloader.onload()
    assert back["by_part"] == report["by_part"] and torch.cuda.memory_allocated() == before
    assert torch.equal(weights.cpu(), expected) and view.data_ptr() == weights.data_ptr() + 3 * weights.stride(0) * 4
