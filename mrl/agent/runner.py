"""Episodes beside the engine: an engine call's prompts as concurrent agent episodes.

The rollout actor (mrl.launch.rollout_actor) hands a generate call's prompts here when the run has
an agent (the `agent` section): each of a prompt's n samples is an episode of its own (seed
`seed + i`, as vLLM draws an n-request's samples), all episodes run at once on one event loop, and
every turn is an engine.generate call on a thread of its own, so the engine's running batch holds
every episode's current turn (the engine must take concurrent calls: VLLMEngine's `streaming`).
An episode's turns stay on this engine, for its prefix cache. A crashing agent, tool or environment
fails that episode only: it comes back with no tokens and the error in `agent["error"]`.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from mrl.agent.loop import BUILT_IN, AgentLimits, EpisodeContext, Trajectory
from mrl.rollout.engine import Generation, SamplingSettings, per_prompt

log = logging.getLogger(__name__)
MAX_TURN_THREADS = 512  # turns of one engine call in flight at once (each waits in a thread)


@dataclass(frozen=True)
class AgentSettings:
    """The run's `agent` section as the rollout actor needs it (plain data: it crosses to Ray)."""

    loop: str = "single_turn"  # a built-in (mrl.agent.loop.BUILT_IN) or "package.module:function"
    tools: tuple[str, ...] = ()  # built-in tool names or "module:function" specs (mrl.agent.tools.load_tool)
    max_turns: int = 4
    max_tokens: int = 4096
    max_tool_response_chars: int = 1024
    tool_timeout_s: float = 10.0
    environment: str | None = None  # the environment loop's: a built-in (mrl.agent.env) or "module:Factory"
    openai_agent: str | None = None  # the openai loop's agent(base_url, sample): "module:function" (openai_loop.py)
    episode_timeout_s: float = 600.0
    chat_template_kwargs: dict = field(default_factory=dict)


def load_loop(spec: str) -> Any:
    """The episode function a spec names: a built-in's name, "package.module:function" or
    "path/to/file.py:function" (a one-line error naming the fix otherwise)."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    from mrl.rewards.sandbox import import_function

    return import_function(spec, kind="agent.loop")


class EpisodeRunner:
    """Runs an engine's share of a step as episodes (one runner per rollout actor)."""

    def __init__(self, engine: Any, settings: AgentSettings):
        from mrl.agent.chat import ChatRenderer
        from mrl.agent.tools import Toolbox, load_tool

        self.engine, self.settings = engine, settings
        # a tokenizer of its own: vLLM detokenises with the engine's on its stepping thread, and a Rust
        # tokenizer used from two threads at once raises "Already borrowed"
        tokenizer = copy.deepcopy(engine.llm.get_tokenizer())
        self.chat = ChatRenderer(tokenizer, template_kwargs=settings.chat_template_kwargs)
        if settings.loop == "openai":  # an OpenAI-client agent: this engine behind an endpoint of its own
            from mrl.agent.openai_loop import OpenAILoop

            self.loop = OpenAILoop(settings.openai_agent, self._generate, self.chat, settings.episode_timeout_s)
        else:
            self.loop = load_loop(settings.loop)
        self.tools = Toolbox([load_tool(t) for t in settings.tools], settings.max_tool_response_chars,
                             settings.tool_timeout_s) if settings.tools else None
        self.limits = AgentLimits(settings.max_turns, settings.max_tokens)
        self.environment = None
        if settings.environment:
            from mrl.agent.env import load_environment

            self.environment = load_environment(settings.environment)

    def generate(self, prompts: Sequence[list[int]],
                 sampling: SamplingSettings | Sequence[SamplingSettings]) -> list[list[Generation]]:
        """Per prompt, its n episodes as Generations (the engine's generate contract)."""
        return asyncio.run(self._all(prompts, per_prompt(sampling, len(prompts))))

    async def _all(self, prompts: Sequence[list[int]], settings: list[SamplingSettings]) -> list[list[Generation]]:
        # a thread for every episode's turn: asyncio's default pool (CPUs + 4) would let only a few
        # turns at a time into the engine's running batch
        threads = min(sum(s.n for s in settings), MAX_TURN_THREADS) + 4  # (+4: tokenising, environments)
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(threads, "mrl-episode"))
        episodes = [[self._episode(list(p), replace(s, n=1, seed=None if s.seed is None else s.seed + i), s.seed)
                     for i in range(s.n)] for p, s in zip(prompts, settings)]
        done = await asyncio.gather(*(e for group in episodes for e in group))
        it = iter(done)
        return [[next(it) for _ in group] for group in episodes]

    async def _episode(self, prompt_ids: list[int], sampling: SamplingSettings, task_seed: int | None) -> Generation:
        ctx = EpisodeContext(self._generate, sampling, self.chat, self.tools, self.limits, self.environment)
        try:
            # the sample: the prompt, and the prompt's seed of this step (an environment draws its task
            # from it: every episode of a GRPO group gets the same task, another each step and run)
            sample = {"prompt_ids": prompt_ids, "prompt": await asyncio.to_thread(self.chat._decode, prompt_ids),
                      "seed": task_seed}
            trajectory = await _within(self.loop(sample, ctx), self.settings.episode_timeout_s)
        except Exception as err:  # noqa: BLE001 - one episode's failure, never the run's
            log.warning("agent episode failed: %s: %s", type(err).__name__, err)
            failed = Trajectory(prompt_ids, finish_reason="error")
            generation = failed.to_generation()
            generation.agent = {**failed.stats(), "error": f"{type(err).__name__}: {err}"}
            return generation
        return trajectory.to_generation()

    def close(self) -> None:
        """The tools' threads (and an openai loop's endpoint) stop; the engine is its owner's."""
        if self.tools is not None:
            self.tools.close()
        getattr(self.loop, "close", lambda: None)()

    async def _generate(self, prompt_ids: list[int], sampling: SamplingSettings) -> Generation:
        groups = await asyncio.to_thread(self.engine.generate, [prompt_ids], sampling)
        return groups[0][0]


async def _within(episode: Any, timeout_s: float) -> Trajectory:
    """The episode's trajectory, or a TimeoutError naming agent.episode_timeout_s once it ran that long
    (the episode is cancelled: its cleanup runs before this returns)."""
    task = asyncio.ensure_future(episode)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=10.0)
        raise TimeoutError(f"the episode ran past agent.episode_timeout_s={timeout_s:g} s: raise it, or make the "
                           "agent end its episodes sooner")
    return task.result()


def episode_metrics(samples: Sequence[Generation]) -> dict[str, float]:
    """agent/* of a step's episodes (none when its samples are not episodes): turns, tool calls and
    errors per episode, seconds in tools against generation, truncated and failed episodes, tokens."""
    stats = [s.agent for s in samples if s.agent is not None]
    if not stats:
        return {}
    mean = lambda key: sum(float(a[key]) for a in stats) / len(stats)  # noqa: E731
    return {"agent/turns_mean": mean("turns"), "agent/turns_max": float(max(a["turns"] for a in stats)),
            "agent/tool_calls": mean("tool_calls"), "agent/tool_errors": mean("tool_errors"),
            "agent/tool_s": mean("tool_s"), "agent/gen_s": mean("gen_s"), "agent/truncated": mean("truncated"),
            "agent/failed": float(sum("error" in a for a in stats)),
            "agent/nonlinear": float(sum(bool(a.get("nonlinear")) for a in stats)),
            "agent/episode_tokens": sum(len(s.prompt_ids) + len(s.token_ids) for s in samples) / len(samples)}
