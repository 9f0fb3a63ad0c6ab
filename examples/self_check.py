"""A two-turn agent for `agent.loop`: the model answers, is asked to check its answer, answers again.

    mrl train configs/tiny_cpu_grpo.yaml agent.loop=examples/self_check.py:episode data.chat_template=true

Only the model's two answers train; the request between them is appended as chat-template tokens.
The run's reward function scores the last answer (docs/agents.md).
"""

from mrl.agent.loop import EpisodeContext, Trajectory


async def episode(sample: dict, ctx: EpisodeContext) -> Trajectory:
    trajectory = Trajectory(list(sample["prompt_ids"]))
    if await ctx.turn(trajectory) is not None:
        if await ctx.append(trajectory, [{"role": "user", "content": "Check it. Your final answer?"}]):
            await ctx.turn(trajectory)
    return trajectory
