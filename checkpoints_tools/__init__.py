"""Checkpoint tools: merge distributed checkpoints into HuggingFace models, convert HF → checkpoint.

Not built yet (see README, "Status"); the package exists so the layout and imports are stable.
"""
