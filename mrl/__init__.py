"""mrl: Megatron-centric reinforcement-learning post-training for dense and MoE language models."""

__version__ = "0.1.0"
