"""Let megatron-core's optimizer offload (HybridDeviceOptimizer) split parameters on a CPU build.

Upstream (megatron-core 0.16.1): `optimizer/cpu_offloading/hybrid_optimizer.py::HybridDeviceOptimizer`
decides what to offload with `param.is_cuda`: the threshold is `offload_fraction` of the CUDA
parameters' elements, and every non-CUDA parameter goes to the CPU sub-optimizer as itself.
`_set_sub_optimizer_grads` then looks each CPU-optimizer parameter up as the copy of a device
parameter, so with CPU parameters the first step fails with a KeyError
(`cpu_copys_map_gpu_param[param]`), and `.pin_memory()` needs CUDA.

Patch: without CUDA, host memory is "the device" (`split_on_host`), so the offload bookkeeping runs
for real on CPU; only the device the copies live on differs from a GPU run.

Drop when: megatron-core's HybridDeviceOptimizer splits by an explicit device instead of
`param.is_cuda` (not up to 0.16.1).
"""

from __future__ import annotations

import torch

CPU_ONLY = True


def split_on_host(self, offload_fraction: float) -> tuple[list, list, dict, dict, dict]:
    """HybridDeviceOptimizer._get_sub_optimizer_param_groups for CPU parameters: returns
    (cpu groups, device groups, device param → host copy, host copy → device param,
    param → its fp32 copy), the five values upstream's split returns.

    Upstream gives offloaded parameters a pinned host copy and puts every non-CUDA parameter in the
    CPU sub-optimizer as itself. Here the model's parameters stay in the device sub-optimizer, and
    the first `offload_fraction` of their elements get a separate host copy (pinned only when
    `pin_cpu_params` and CUDA allow it) in the CPU sub-optimizer, with the same maps upstream builds:
    gradients are copied to the copies, the CPU optimizer steps them, the results are copied back
    into the model's parameters."""
    params = [param for group in self.param_groups for param in group["params"]]
    threshold = sum(param.numel() for param in params) * offload_fraction
    offloaded_numel = 0
    cpu_groups, device_groups = [], []
    to_copy, from_copy, to_fp32 = {}, {}, {}
    for group in self.param_groups:
        cpu_group, device_group = dict(group, params=[]), dict(group, params=[])
        for param in group["params"]:
            inner = param
            offload = offloaded_numel < threshold
            if offload:
                inner = param.detach().clone()
                if self.pin_cpu_params and torch.cuda.is_available():
                    inner = inner.pin_memory()
                offloaded_numel += param.numel()
            if self.param_update_in_fp32 and inner.dtype != torch.float32:
                inner = inner.detach().clone().float()
                to_fp32[param] = inner
            if offload:
                to_copy[param], from_copy[inner] = inner, param
                cpu_group["params"].append(inner)
            else:
                device_group["params"].append(inner)
        cpu_groups += [cpu_group] if cpu_group["params"] else []
        device_groups += [device_group] if device_group["params"] else []
    return cpu_groups, device_groups, to_copy, from_copy, to_fp32


def apply() -> None:
    if torch.cuda.is_available():  # force_cpu on a GPU machine: never shadow real CUDA
        return
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    hybrid_optimizer.HybridDeviceOptimizer._get_sub_optimizer_param_groups = split_on_host
