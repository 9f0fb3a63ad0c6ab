"""The weight bridge: Megatron shards ⇄ HuggingFace tensors, driven by one set of mapping tables."""
