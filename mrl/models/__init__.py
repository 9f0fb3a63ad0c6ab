"""HF config.json → Megatron model description, per architecture; the tiny model zoo."""

from mrl.models.registry import SUPPORTED_ARCHITECTURES, ModelSpec, UnsupportedModelError, model_spec_from_hf

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelSpec", "UnsupportedModelError", "model_spec_from_hf"]
