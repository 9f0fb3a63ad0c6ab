"""Allow the plain-torch norms of the local spec with sequence parallelism.

Upstream (megatron-core 0.16.1, `transformer/torch_norm.py`): `WrappedTorchNorm` asserts
`not config.sequence_parallel`. Without Transformer Engine or apex that rules out sequence
parallelism, and Megatron requires sequence parallelism for MoE with TP > 1, so MoE models could
not use TP at all on CPU.

Patch: build the same `torch.nn.RMSNorm` / `LayerNorm`, and mark its parameters
`sequence_parallel=True` as TE's norms do, so Megatron's DDP all-reduces their gradients over the
TP group (each TP rank sees only its slice of the sequence).

Drop when: upstream WrappedTorchNorm supports sequence parallelism (not up to 0.16.1).
"""

from __future__ import annotations

import dataclasses

CPU_ONLY = False  # also needed on GPUs without TE/apex


def apply() -> None:
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__
    if getattr(original_new, "_mrl_patched", False):
        return

    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        norm = original_new(cls, dataclasses.replace(config, sequence_parallel=False), hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    __new__._mrl_patched = True
    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)
