"""Agentic RL: multi-turn episodes with tools, token-in/token-out (docs/agents.md)."""
