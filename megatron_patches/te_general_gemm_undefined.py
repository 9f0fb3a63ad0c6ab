"""Define `te_general_gemm = None` in megatron's MoE utilities when Transformer Engine is absent.

Upstream (megatron-core 0.16.1, `transformer/moe/moe_utils.py`): `te_general_gemm` is imported
only inside `try: import transformer_engine`, but the fp32 router GEMM (`RouterGatingLinearFunction`
used with `moe_router_dtype="fp32"`) tests `te_general_gemm is not None` unconditionally, so every
MoE forward without TE raises `NameError: name 'te_general_gemm' is not defined`.

Patch: bind the name to None when the import failed, which selects upstream's torch fallback.

Drop when: upstream initialises the name in its `except ImportError` branch.
"""

from __future__ import annotations

CPU_ONLY = False  # GPU machines without TE hit the same NameError


def apply() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
