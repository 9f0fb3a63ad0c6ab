"""`mrl plan`: per-GPU memory of a recipe (actor and critic per pipeline stage, rollout engine),
computed from Megatron's and vLLM's own rules and checked against meta-device builds and measured
activations; an estimate of a step's time; and a search over layouts that fit, fastest first.

shapes (model sizes, pipeline chunks) → params (each rank's tensors) → ddp (buffers, optimizer
shards) and activations (saved tensors) and rollout (engine) → memory (phases, verdict) →
timing (rollout roofline, update proxy) → search, report.
"""

from mrl.plan.memory import Plan, Run, plan
from mrl.plan.shapes import ModelShape, PlanError, model_shape

__all__ = ["ModelShape", "Plan", "PlanError", "Run", "model_shape", "plan"]
