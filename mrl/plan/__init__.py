"""`mrl plan`: per-GPU memory of a recipe, computed from Megatron's and vLLM's own rules.

shapes (model sizes, pipeline chunks) → params (each rank's tensors) → ddp (buffers, optimizer
shards).
"""

from mrl.plan.shapes import ModelShape, PlanError, model_shape

__all__ = ["ModelShape", "PlanError", "model_shape"]
