"""Make `Tensor.cuda()` keep tensors on the CPU when torch has no CUDA.

Upstream (megatron-core 0.16.1): `LanguageModule.setup_embeddings_and_output_layer` moves the tied
embedding copy with `weight.data.cuda()` before all-reducing it between the first and last
pipeline stages (tied embeddings with PP > 1), and `tensor_parallel/data.py` moves broadcast data
with `.cuda()`. On a CPU build that raises "Torch not compiled with CUDA enabled".

Patch: on a torch build without CUDA, `Tensor.cuda(...)` returns the tensor itself. The method
could only raise on such a build, so no working code path changes.

Drop when: megatron-core places tensors through a device abstraction (not up to 0.16.1).
"""

from __future__ import annotations

import torch

CPU_ONLY = True


def _stay_on_cpu(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return self


def apply() -> None:
    if torch.cuda.is_available():  # force_cpu on a GPU machine: never shadow real CUDA
        return
    torch.Tensor.cuda = _stay_on_cpu
