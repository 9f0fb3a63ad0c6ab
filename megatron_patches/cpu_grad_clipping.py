"""Let Megatron's optimizer clip CPU gradients.

Upstream (megatron-core 0.16.1): `optimizer/clip_grads.py::clip_grad_by_total_norm_fp32` asserts
`param.grad.type() == 'torch.cuda.FloatTensor'` and scales through apex/TE's CUDA
`multi_tensor_applier` with a CUDA overflow buffer, so any `OptimizerConfig(clip_grad > 0)` step
fails on CPU with an AssertionError. `optimizer/optimizer.py` imports the function by name.

Patch: on a torch build without CUDA, both names point at a version that checks the grads are fp32
and scales them in place by `max_norm / (total_norm + 1e-6)` when that is below 1, which is the
upstream arithmetic (the norm itself is still computed by upstream's get_grad_norm_fp32).

Drop when: megatron-core clips without CUDA-only kernels (not up to 0.16.1).
"""

from __future__ import annotations

import torch

CPU_ONLY = True


def clip_grad_by_total_norm_cpu(parameters, max_norm: float, total_norm: float, use_decoupled_grad: bool = False) -> None:
    """Scale the fp32 grads of `parameters` in place so their total norm is at most `max_norm`."""
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = []
    for param in parameters:
        grad = getattr(param, attr, None)
        if grad is not None:
            if grad.dtype != torch.float32 and not use_decoupled_grad:
                raise TypeError(f"gradient clipping expects fp32 grads, got {grad.dtype}")
            grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def apply() -> None:
    if torch.cuda.is_available():  # force_cpu on a GPU machine: never shadow real CUDA
        return
    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_cpu
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_cpu
