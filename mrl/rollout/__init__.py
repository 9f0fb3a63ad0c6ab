"""Rollout engines (vLLM) and the weight sync that feeds them."""
