"""Replace Transformer Engine placeholders that are MagicMocks by None when TE is not installed.

Upstream (megatron-core 0.16.1): `extensions/transformer_engine.py` substitutes `te = MagicMock()`
when Transformer Engine is missing, so `from megatron.core.extensions.transformer_engine import
TELinear` *succeeds* and yields MagicMock objects. Modules such as
`transformer/multi_latent_attention.py` then set `HAVE_TE = True` and call
`isinstance(x, TELinear)`, which raises "isinstance() arg 2 must be a type" — MLA cannot be built
without TE.

Patch: when `transformer_engine` is not importable, every MagicMock-valued module attribute in
loaded `megatron.core` modules becomes None and their `HAVE_TE` flags become False, which is what
upstream's own `except ImportError` branches set.

Drop when: upstream stops exporting MagicMock placeholders (not up to 0.16.1).
"""

from __future__ import annotations

import importlib.util
import sys
from unittest.mock import MagicMock

CPU_ONLY = False  # any machine without TE, GPU or not


def apply() -> None:
    if importlib.util.find_spec("transformer_engine") is not None:
        return
    import megatron.core.transformer.multi_latent_attention  # noqa: F401 - load the affected modules

    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.core") or name == "megatron.core.extensions.transformer_engine":
            continue
        placeholders = [k for k, v in vars(module).items() if isinstance(v, MagicMock)]
        for key in placeholders:
            setattr(module, key, None)
        if placeholders and getattr(module, "HAVE_TE", False):
            module.HAVE_TE = False
