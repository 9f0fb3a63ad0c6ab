"""The `agent` section's checks (mrl/agent/): what a run with episodes can and cannot do yet."""

from __future__ import annotations

from pathlib import Path

from mrl.config.schema import RunConfig

LOOPS = ("none", "single_turn", "tool_calling", "environment", "openai")
TOOLS = ("calculator", "python")
NOT_RESUMABLE = ("openai",)  # state outside the trajectory: the agent program's
NO_TURN_REWARDS = ("single_turn", "tool_calling", "openai")  # (a plain run's "none" is refused above)


def check_agent(cfg: RunConfig) -> list[str]:
    a = cfg.agent
    if a.loop == "none":
        unused = [("tools", "tool_calling")] * bool(a.tools) + [("environment", "environment")] * bool(a.environment)
        unused += [("openai_agent", "openai")] * bool(a.openai_agent)
        unused += [("turn_rewards", "environment")] * a.turn_rewards
        return [f"agent.{key} is set but agent.loop is none: set agent.loop: {loop}" for key, loop in unused]
    errors = []
    if a.loop not in LOOPS and ":" not in a.loop:
        errors.append(f"agent.loop {a.loop!r} is neither a built-in ({', '.join(LOOPS)}) nor 'package.module:function'")
    if a.loop == "tool_calling" and not cfg.data.chat_template:
        errors.append("agent.loop tool_calling appends chat-template turns to the prompt: set data.chat_template: true")
    if a.loop == "tool_calling" and not a.tools:
        errors.append(f"agent.loop tool_calling needs agent.tools (built-ins: {', '.join(TOOLS)}, or module:function)")
    errors += [f"agent.tools: {t!r} is neither a built-in ({', '.join(TOOLS)}) nor 'package.module:function'"
               for t in a.tools if t not in TOOLS and ":" not in t]
    if (a.loop == "environment") != (a.environment is not None):
        errors.append("agent.loop environment and agent.environment go together (e.g. loop: environment, "
                      "environment: guess_number)")
    if (a.loop == "openai") != (a.openai_agent is not None):
        errors.append("agent.loop openai and agent.openai_agent go together (e.g. loop: openai, "
                      "openai_agent: examples/openai_agent.py:agent)")
    elif a.openai_agent is not None and ":" not in a.openai_agent:
        errors.append(f"agent.openai_agent {a.openai_agent!r} is neither 'package.module:function', "
                      "'path/file.py:function' nor 'command: program args'")
    if a.episode_timeout_s <= 0:
        errors.append(f"agent.episode_timeout_s {a.episode_timeout_s} must be > 0")
    if a.max_turns < 1 or a.tool_timeout_s <= 0 or a.max_tool_response_chars < 1:
        errors.append("agent.max_turns and agent.max_tool_response_chars must be >= 1 and agent.tool_timeout_s > 0")
    if a.max_tokens is not None and not 0 < a.max_tokens <= cfg.rollout.max_model_len:
        errors.append(f"agent.max_tokens {a.max_tokens} must be in 1..rollout.max_model_len ({cfg.rollout.max_model_len})")
    specs = [a.loop, *a.tools] + [s for s in (a.environment, a.openai_agent) if s]
    errors += [f"agent: file {spec.rpartition(':')[0]} not found (from {spec!r}): check the path"
               for spec in specs if spec.rpartition(":")[0].endswith(".py") and not Path(spec.rpartition(":")[0]).is_file()]
    if a.turn_rewards and a.loop in NO_TURN_REWARDS:
        errors.append(f"agent.turn_rewards: loop {a.loop} gives no per-turn rewards (loop environment does, "
                      "as does a loop that calls Trajectory.reward_turn): set agent.turn_rewards: false")
    if a.turn_batching == "rounds" and (a.loop == "openai" or cfg.async_.streaming):
        errors.append("agent.turn_batching rounds gives the engine one call at a time, and "
                      + ("the openai loop's endpoint makes calls at once" if a.loop == "openai" else
                         "async.streaming's engine takes calls at once") + ": set agent.turn_batching: streaming")
    if cfg.async_.partial_rollout and a.loop in NOT_RESUMABLE:  # (a user loop says so itself: mrl.agent.loop.resumable)
        errors.append(f"agent.loop {a.loop} cannot go on after a weight push cuts a turn (built-ins that can: "
                      "single_turn, tool_calling, environment): set async.partial_rollout: false")
    return errors
