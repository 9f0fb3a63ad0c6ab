"""The agent loop: one async function per episode, and the trajectory it builds.

An agent is `async def episode(sample: dict, ctx: EpisodeContext) -> Trajectory`. It asks the engine
for turns (`ctx.turn`: token ids in, the turn's tokens, log-probs and weight versions out), appends
what the world answers as token deltas (`ctx.append`: tool results, environment or user turns,
rendered with the model's chat template, never re-tokenising a generated token) and returns the
trajectory: the first prompt, then every later token with a loss mask (1: the policy generated it).
Built-ins: `single_turn` (one answer), `tool_calling` (turns until the model calls no tool, each
call answered by the Toolbox) and `environment` (a gym-like environment, mrl/agent/env.py, sets the
task, answers every turn and gives the reward). The episode ends at its last generated token, so
what the model never answered is not trained on. Limits: max turns and a context budget (prompt +
every token, capping each turn's max_tokens); an episode reaching either is `truncated`. A weight
push may cut a turn (async.partial_rollout): a `resumable` loop runs again on the cut trajectory
(`trajectory_of`; `environment` replays its finished turns into a fresh environment), and its next
`ctx.turn` goes on with the cut turn.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable

import numpy as np

from mrl.rollout.engine import Generation, SamplingSettings, _mix

Generate = Callable[[list[int], SamplingSettings], Awaitable[Generation]]


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 4  # model turns an episode may take
    max_tokens: int = 4096  # the context budget: prompt + generated + appended tokens


@dataclass
class Trajectory:
    """An episode as the trainer sees it. `token_ids` follow `prompt_ids`: policy tokens (mask 1,
    the engine's log-probs and versions) and appended ones (mask 0, log-prob 0.0, the version of
    the turn before them). `text` is the last turn's text: what the run's reward function scores."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    routed_experts: np.ndarray | None = None
    reward: float | None = None  # an environment's; None: the run's reward function scores `text`
    # (index in token_ids, reward): where parts of `reward` were earned (reward_turn; agent.turn_rewards)
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0  # malformed calls and calls that failed
    tool_s: float = 0.0
    gen_s: float = 0.0
    truncated: bool = False
    nonlinear: bool = False  # an openai-loop episode of which only the last linked calls train (openai_loop.py)
    messages: list[dict] = field(default_factory=list)  # the conversation by role, for traces
    # async.partial_rollout: the last turn's tokens when a weight push cut it (None: not cut); the
    # episode comes back unfinished and goes on from here on the new weights (resume)
    interrupted: int | None = None
    last_turn: Generation | None = field(default=None, repr=False)

    @classmethod
    def resume(cls, unfinished: Generation) -> Trajectory:
        """The episode an interrupted sample was cut from, to go on with its last turn."""
        kept = {k: v for k, v in unfinished.agent.items() if k in cls.__dataclass_fields__}  # stats(): by name
        return cls(list(unfinished.prompt_ids), list(unfinished.token_ids), list(unfinished.loss_mask),
                   list(unfinished.logprobs), unfinished.versions(), unfinished.text,
                   routed_experts=unfinished.routed_experts, **kept | {"messages": [dict(m) for m in kept["messages"]]})

    def context(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def add_turn(self, turn: Generation) -> None:
        """A generated turn whose prompt was this trajectory's context (finish_reason None: cut by
        a weight push, to go on after it)."""
        if turn.prompt_ids != self.context():
            raise ValueError(f"turn {self.turns + 1}'s prompt ({len(turn.prompt_ids)} tokens) is not the episode's "
                             f"context ({len(self.context())} tokens): generate from trajectory.context()")
        self.token_ids += turn.token_ids
        self.loss_mask += [1] * len(turn.token_ids)
        self.logprobs += list(turn.logprobs)
        self.token_versions += turn.versions()
        self.text, self.finish_reason, self.turns = turn.text, turn.finish_reason, self.turns + 1
        self.last_turn = turn
        # the last turn forwarded the whole context: its routes cover every earlier position too
        self.routed_experts = turn.routed_experts
        self.messages.append({"role": "assistant", "content": turn.text})
        self.interrupted = len(turn.token_ids) if turn.finish_reason is None else None

    def go_on(self, rest: Generation, text: str, kept: int | None = None) -> Generation:
        """The interrupted last turn, gone on with `rest` (generated from this context): the whole
        turn as one Generation, its `text` decoded from all its tokens; `kept`: its tokens up to
        the one completing a stop string that spans the cut (the engine saw only `rest`'s text)."""
        if kept is not None and kept < self.interrupted + len(rest.token_ids):
            rest = _stopped(rest, max(kept - self.interrupted, 0))
        cut = len(self.token_ids) - self.interrupted
        versions = self.token_versions[cut:] + rest.versions()
        turn = Generation(self.context()[:len(self.prompt_ids) + cut], self.token_ids[cut:] + rest.token_ids, text,
                          self.logprobs[cut:] + list(rest.logprobs), rest.finish_reason, min(versions, default=None),
                          versions, rest.routed_experts)
        del self.token_ids[cut:], self.loss_mask[cut:], self.logprobs[cut:], self.token_versions[cut:]
        self.turns -= 1
        self.messages.pop()
        self.add_turn(turn)
        return turn

    def reward_turn(self, reward: float) -> None:
        """Add `reward` to the episode's, earned by the turn just generated: with agent.turn_rewards
        the trainer puts it on that turn's last token (its other tokens and earlier turns do not get
        the credit under GAE or reinforce); otherwise the episode's sum is on its last token."""
        self.reward = (self.reward or 0.0) + reward
        self.turn_rewards.append((len(self.token_ids) - 1, reward))

    def add_appended(self, ids: list[int], messages: list[dict]) -> None:
        version = self.token_versions[-1] if self.token_versions else 0
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.token_versions += [version] * len(ids)
        self.messages += messages

    def to_generation(self) -> Generation:
        """The episode as one sample. One turn and nothing appended: that turn's sample as the engine
        returned it. Cut by a weight push: every token, finish_reason None (async.partial_rollout
        goes on with it, `resume`). Otherwise cut after its last generated token, finishing by its
        last turn's reason, or by "length" or "error" without a turn."""
        if self.turns == 1 and all(self.loss_mask) and self.last_turn is not None:
            return replace(self.last_turn, loss_mask=list(self.loss_mask), agent=self.stats())
        if self.interrupted is not None:  # every token kept: the episode goes on from all of them
            return Generation(list(self.prompt_ids), list(self.token_ids), self.text, list(self.logprobs), None,
                              min(self.token_versions, default=None), list(self.token_versions), self.routed_experts,
                              loss_mask=list(self.loss_mask), agent=self.stats())
        end = max((i + 1 for i, m in enumerate(self.loss_mask) if m), default=0)
        versions = self.token_versions[:end]
        routes = self.routed_experts
        if routes is not None:
            routes = routes[: len(self.prompt_ids) + end - 1]
        finish = self.finish_reason or ("length" if self.truncated or self.turns else "error")
        return Generation(list(self.prompt_ids), self.token_ids[:end], self.text, self.logprobs[:end],
                          finish, min(versions) if versions else None, versions, routes,
                          loss_mask=self.loss_mask[:end], agent=self.stats())

    def stats(self) -> dict[str, Any]:
        """Per-episode numbers for the agent/* metrics and the trace."""
        return {"turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "tool_s": self.tool_s, "gen_s": self.gen_s, "truncated": self.truncated,
                "nonlinear": self.nonlinear, "reward": self.reward, "turn_rewards": self.turn_rewards,
                "messages": self.messages, "interrupted": self.interrupted}


@dataclass
class EpisodeContext:
    """What an agent gets for one episode: the engine, the step's sampling settings (seeded per
    episode), the chat template as token deltas (mrl.agent.chat.ChatRenderer), the tools."""

    generate: Generate
    sampling: SamplingSettings
    chat: Any = None  # ChatRenderer
    tools: Any = None  # mrl.agent.tools.Toolbox
    limits: AgentLimits = AgentLimits()
    environment: Any = None  # a factory of mrl.agent.env.Environment (agent.environment)

    async def turn(self, trajectory: Trajectory) -> Generation | None:
        """The model's next turn, appended to `trajectory`; None (and `truncated`) when the episode
        is out of turns or context, and None when a weight push cut the turn (the episode comes back
        unfinished; async.partial_rollout resumes it here, where this goes on with the cut turn).
        Each turn draws with a seed of its own; the first with the episode's, so a one-turn episode
        samples what a plain generate call does."""
        cut, context = trajectory.interrupted or 0, trajectory.context()
        room = self.limits.max_tokens - len(context)
        if trajectory.interrupted is None and (trajectory.turns >= self.limits.max_turns or room <= 0):
            trajectory.truncated = True
            return None
        seed = self.sampling.seed
        if seed is not None and trajectory.turns:
            seed = _mix(seed, trajectory.turns)
        stops = self.sampling.stop_token_ids + (tuple(self.chat.end_of_turn_ids()) if self.chat else ())
        sampling = replace(self.sampling, n=1, seed=seed, max_tokens=min(self.sampling.max_tokens - cut, room),
                           stop_token_ids=tuple(dict.fromkeys(stops)))
        if cut and sampling.stop:  # the engine checks stop strings in a continuation's own text only
            sampling = replace(sampling, stop=await asyncio.to_thread(
                self.chat.continuation_stop, context, sampling.stop))
        start = time.perf_counter()
        turn = await self.generate(context, sampling)
        trajectory.gen_s += time.perf_counter() - start
        if trajectory.interrupted is None:
            trajectory.add_turn(turn)
        else:  # the whole turn's text and stop string, as one uncut request would have them
            before = len(context) - cut
            whole = await asyncio.to_thread(self.chat.whole_turn, context[:before], context[before:] + turn.token_ids,
                                            self.sampling.stop, turn.finish_reason == "stop")
            turn = trajectory.go_on(turn, whole.text, whole.kept)
        return None if trajectory.interrupted is not None else turn

    async def append(self, trajectory: Trajectory, messages: list[dict]) -> bool:
        """Append `messages` (tool results, user or environment turns) and the next generation
        prompt as tokens; False (and `truncated`) when they would not leave room for a turn."""
        ended = bool(trajectory.token_ids) and trajectory.token_ids[-1:] == self.chat.end_of_turn_ids()
        ids = await self.chat.append_ids_async(messages, self.tools.schemas() if self.tools else None,
                                               truncated=not ended)
        if len(trajectory.context()) + len(ids) >= self.limits.max_tokens:
            trajectory.truncated = True
            return False
        trajectory.add_appended(ids, messages)
        return True


def _stopped(rest: Generation, tokens: int) -> Generation:
    """`rest` ended by a stop string after its first `tokens` tokens."""
    routes = rest.routed_experts
    return replace(rest, token_ids=rest.token_ids[:tokens], logprobs=list(rest.logprobs)[:tokens],
                   token_versions=rest.versions()[:tokens], finish_reason="stop",
                   routed_experts=None if routes is None else routes[:len(rest.prompt_ids) + tokens - 1])


def trajectory_of(sample: dict) -> Trajectory:
    """The episode's trajectory: new, or the one a weight push cut. async.partial_rollout goes on
    with a cut episode by running its loop again on that trajectory: a loop that starts here and
    keeps all its state in the trajectory says so with `resumable` (single_turn, tool_calling,
    environment)."""
    return sample.get("resume") or Trajectory(list(sample["prompt_ids"]))


def resumable(loop: Callable) -> Callable:
    """Mark an agent loop as one async.partial_rollout may cut and run again (trajectory_of)."""
    loop.resumable = True
    return loop


@resumable
async def single_turn(sample: dict, ctx: EpisodeContext) -> Trajectory:
    """One answer to the prompt: the plain RL sample as an episode."""
    trajectory = trajectory_of(sample)
    await ctx.turn(trajectory)
    return trajectory


@resumable
async def tool_calling(sample: dict, ctx: EpisodeContext) -> Trajectory:
    """Turns until the model calls no tool (or the limits end the episode); every call in a turn is
    answered, malformed ones by an error message the model sees."""
    trajectory = trajectory_of(sample)
    while (turn := await ctx.turn(trajectory)) is not None:
        calls, errors = ctx.tools.parse(turn.text, ctx.chat.family, id_prefix=f"call_{trajectory.turns}_")
        if not calls and not errors:
            break
        start = time.perf_counter()
        results = await ctx.tools.call_all(calls)
        trajectory.tool_s += time.perf_counter() - start
        trajectory.tool_calls += len(calls) + len(errors)
        trajectory.tool_errors += len(errors) + sum(r.error is not None for r in results)
        answers = [r.to_message() for r in results] + [{"role": "tool", "content": f"Error: {e}"} for e in errors]
        if not await ctx.append(trajectory, answers):
            break
    return trajectory


@resumable
async def environment(sample: dict, ctx: EpisodeContext) -> Trajectory:
    """A fresh environment per episode: its first observation is the prompt (reset gets the
    sample), each turn's text goes to its step, whose observation is appended until it says done;
    the episode's reward is the sum of the steps' (it replaces the run's reward function's score),
    each step's kept with the turn it answered (Trajectory.reward_turn). A cut episode goes on in
    a fresh environment that its finished turns are replayed into (replay_env)."""
    from mrl.agent.env import make_env, reset_env, step_env

    env = make_env(ctx.environment)
    try:
        first = await reset_env(env, sample)
        if "resume" in sample:
            trajectory = await replay_env(env, sample["resume"], first)
        else:
            trajectory = Trajectory(await ctx.chat.prompt_ids_async(first, ctx.tools.schemas() if ctx.tools else None))
            trajectory.messages, trajectory.reward = list(first), 0.0
        while (turn := await ctx.turn(trajectory)) is not None:
            start = time.perf_counter()
            observation, reward, done = await step_env(env, turn.text)
            trajectory.tool_s += time.perf_counter() - start
            trajectory.reward_turn(reward)
            if done or not await ctx.append(trajectory, observation):
                break
        return trajectory
    finally:  # an environment holding processes or sockets lets them go with its episode
        await asyncio.to_thread(getattr(env, "close", lambda: None))


async def replay_env(env: Any, cut: Trajectory, first: list[dict]) -> Trajectory:
    """`cut` (an episode a weight push cut), its finished turns' texts stepped again through `env`
    (just reset) so that it stands where the episode was. The environment must answer as it did
    (deterministic given the sample, as guess_number is): its observations and rewards are checked,
    and one that answers otherwise fails the episode, naming the turn."""
    from mrl.agent.env import EnvFailure, step_env

    name = type(env).__name__
    fix = "a cut episode goes on only in an environment that answers alike (or set async.partial_rollout: false)"
    if cut.messages[:len(first)] != first:
        raise EnvFailure(f"{name}.reset answered otherwise on replay: {fix}")
    at = len(first)  # the conversation: the first observation, then each turn's answer and observation
    for turn, (_, earned) in enumerate(cut.turn_rewards, 1):
        observation, reward, _ = await step_env(env, cut.messages[at]["content"])
        at += 1
        if cut.messages[at:at + len(observation)] != observation or reward != earned:
            raise EnvFailure(f"{name}.step answered turn {turn} otherwise on replay: {fix}")
        at += len(observation)
    return cut


BUILT_IN = {"single_turn": single_turn, "tool_calling": tool_calling, "environment": environment}
