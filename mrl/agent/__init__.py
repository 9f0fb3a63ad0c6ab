"""Agentic RL: multi-turn episodes with tools, token-in/token-out (issue 40)."""
