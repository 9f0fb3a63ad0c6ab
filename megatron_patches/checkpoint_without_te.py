"""Let Megatron's output-discarding checkpoint (selective "layernorm"/"moe_act" recompute) run without TE.

Upstream (megatron-core 0.16.1): `tensor_parallel/random.py::CheckpointWithoutOutput.__init__`
sets `self.fp8 = fp8 is not None`, and its callers (the transformer layer's norm recompute, the
experts' activation recompute) construct it with the default `fp8=False`, which is "not None". The
forward then calls Transformer Engine's `FP8GlobalStateManager`, which is only imported when TE is
installed: without TE, `model.recompute: selective` with "layernorm" fails in the first forward with
`NameError: name 'FP8GlobalStateManager' is not defined` (CPU, or a GPU without TE).

Patch: when `transformer_engine` is not importable, a new CheckpointWithoutOutput has `fp8 = False`
(no FP8 is possible without TE), so forward and recompute take upstream's plain-context branch. With
TE installed nothing changes.

Drop when: upstream tests `fp8` for truth instead of `is not None` (not up to 0.16.1).
"""

from __future__ import annotations

import functools
import importlib.util

CPU_ONLY = False  # any machine without TE, GPU or not


def apply() -> None:
    if importlib.util.find_spec("transformer_engine") is not None:
        return
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    original = CheckpointWithoutOutput.__init__
    if getattr(original, "_mrl_without_te", False):
        return

    @functools.wraps(original)
    def init_without_fp8(self, fp8=False):
        original(self, fp8)
        self.fp8 = False

    init_without_fp8._mrl_without_te = True
    CheckpointWithoutOutput.__init__ = init_without_fp8
