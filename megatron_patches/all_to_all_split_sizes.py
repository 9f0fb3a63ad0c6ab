"""Give `all_to_all_single` its split sizes as Python lists, as gloo's binding requires.

Upstream (megatron-core 0.16.1): the MoE alltoall token dispatcher keeps its input/output split
sizes as tensors (on GPUs they are moved to the host as numpy arrays at a sync point; on a CPU
they stay tensors) and `tensor_parallel/mappings.py::_AllToAll.forward` passes them straight to
`torch.distributed.all_to_all_single`. The gloo binding accepts only sequences of ints, so every
expert-parallel (EP > 1) forward fails with "all_to_all_single(): incompatible function arguments".

Patch: `_AllToAll.forward` converts tensor or numpy split sizes to lists of ints first; the
backward pass reuses the same forward, so it is covered too.

Drop when: upstream converts split sizes itself (not up to 0.16.1).
"""

from __future__ import annotations

CPU_ONLY = True


def _as_list(sizes):
    return None if sizes is None else [int(s) for s in sizes.tolist()] if hasattr(sizes, "tolist") else sizes


def apply() -> None:
    from megatron.core.tensor_parallel import mappings

    original = mappings._AllToAll.forward
    if getattr(original, "_mrl_patched", False):
        return

    def forward(ctx, group, input, output_split_sizes, input_split_sizes):
        return original(ctx, group, input, _as_list(output_split_sizes), _as_list(input_split_sizes))

    forward._mrl_patched = True
    mappings._AllToAll.forward = staticmethod(forward)
