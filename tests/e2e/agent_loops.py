"""Agent loops the e2e tests run (as `agent.loop: tests/e2e/agent_loops.py:<name>`)."""

from mrl.agent.loop import resumable, trajectory_of


@resumable
async def go_on(sample, ctx):
    """Turns with "Go on." between them, up to agent.max_turns. Its state is its trajectory, so
    async.partial_rollout may cut any turn and go on with it (mrl.agent.loop.trajectory_of)."""
    trajectory = trajectory_of(sample)
    while await ctx.turn(trajectory) is not None:
        if not await ctx.append(trajectory, [{"role": "user", "content": "Go on."}]):
            break
    return trajectory
