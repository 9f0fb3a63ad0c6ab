"""Checkpoint tools: merge distributed checkpoints (mrl's and Megatron-LM's) into HuggingFace
models, convert HF → checkpoint, FP8 ⇄ plain HF (docs/checkpoints.md)."""
