"""The `openai` loop: an agent written against an OpenAI client, unchanged, as an episode.

`agent.loop: openai` with `agent.openai_agent: "package.module:function"` (or "path/file.py:function")
names `agent(base_url: str, sample: dict) -> None`, sync (run on a thread of its own) or async; it
makes any number of chat/completions calls at base_url. "command: ..." runs a program instead. Each rollout actor serves one OpenAIEndpoint
(openai_server.py) on 127.0.0.1, started with its first episode, in front of its engine. An episode
is opened there under an id of its own with the episode's sampling settings (its seed stream) and
limits (agent.max_turns calls, the agent.max_tokens context budget), and its recorded calls become
its Trajectory: a linear episode whole; a non-linear one (a call whose prompt does not extend the
previous call's prompt + completion) its last run of linked calls, flagged `nonlinear`. The reward
scores the last call's completion text; the routes are the last call's. `tool_s` is the episode's
time outside the engine (the agent's own work, its tools, HTTP). A crashing agent fails its
episode, unless a limit refused its call first (the episode is then kept, `truncated`).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import logging
import os
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mrl.agent.call_log import CallRecord, assemble
from mrl.agent.loop import EpisodeContext, Generate, Trajectory
from mrl.agent.openai_format import ChatContext, template_messages
from mrl.agent.openai_server import EpisodeSettings, LocalServer, OpenAIEndpoint

log = logging.getLogger(__name__)


COMMAND = "command:"  # agent.openai_agent "command: python my_agent.py": the agent as a program of its own


def load_agent(spec: str | None, workdir: str | None = None) -> Any:
    """The user's agent function a spec names, imported here, or a program's ("command: ..."); a
    one-line ValueError naming the fix."""
    from mrl.rewards.base import RewardLoadError
    from mrl.rewards.sandbox import import_function

    if not spec:
        raise ValueError("agent.loop openai needs agent.openai_agent: 'package.module:function' naming "
                         "agent(base_url, sample), or 'command: ...' running an agent program")
    if spec.startswith(COMMAND):
        return command_agent(shlex.split(spec[len(COMMAND):]), workdir)
    try:
        return import_function(spec, kind="agent.openai_agent")
    except RewardLoadError as err:
        raise ValueError(str(err)) from None


def command_agent(argv: list[str], workdir: str | None) -> Any:
    """An agent that is a program: run once per episode in `workdir` with OPENAI_BASE_URL set to the
    episode's endpoint (where an OpenAI client looks by default) and the sample as JSON on stdin
    ("python" is the run's interpreter);
    killed with its episode (agent.episode_timeout_s); a non-zero exit fails the episode, quoting
    the end of its stderr."""
    if not argv:
        raise ValueError("agent.openai_agent 'command:' names no program: write e.g. 'command: python my_agent.py'")
    if argv[0] in ("python", "python3"):  # the run's own Python (the one with openai installed), not PATH's
        argv = [sys.executable, *argv[1:]]

    async def agent(base_url: str, sample: dict) -> None:
        env = os.environ | {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": os.environ.get("OPENAI_API_KEY", "mrl")}
        process = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE, cwd=workdir, env=env,
                                                       stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            _, err = await process.communicate(json.dumps(sample, default=str).encode())
        finally:  # cancelled by the episode's timeout: the program goes with it
            if process.returncode is None:
                process.kill()
                await process.wait()
        if process.returncode:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["(no stderr)"]
            raise RuntimeError(f"agent command {shlex.join(argv)} exited with {process.returncode}: {tail[0]}")

    return agent


class OpenAILoop:
    """The loop's episode function (`await loop(sample, ctx)`) and the endpoint of one rollout actor.
    `generate` is the engine's turn (EpisodeRunner._generate), `chat` its ChatRenderer. The agent gets
    a copy of the runner's sample: "prompt_ids", "prompt" (their text) and "seed"."""

    def __init__(self, agent_spec: str | None, generate: Generate, chat: Any, generate_timeout_s: float = 600.0,
                 agent_threads: int = 256, workdir: str | None = None):
        self.spec, self.agent = agent_spec, load_agent(agent_spec, workdir)
        self.generate, self.chat, self.generate_timeout_s = generate, chat, generate_timeout_s
        self.endpoint: OpenAIEndpoint | None = None
        self.server: LocalServer | None = None
        self._ids = itertools.count()
        self._start_lock = threading.Lock()
        # sync agents block on HTTP: a pool of their own, so they never hold the engine calls' threads
        self._threads = ThreadPoolExecutor(agent_threads, thread_name_prefix="openai-agent")
        self._said_nonlinear = False

    def start(self) -> LocalServer:
        """The endpoint, served from its first use on (once per rollout actor)."""
        with self._start_lock:
            if self.server is None:
                self.endpoint = OpenAIEndpoint(self.generate, self.chat.tokenizer, renderer=self.chat,
                                               generate_timeout_s=self.generate_timeout_s, open_only=True)
                self.server = LocalServer(self.endpoint.app).start()
                log.info("OpenAI-compatible endpoint for agent %s on %s", self.spec, self.server.base_url("<episode>"))
            return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def __call__(self, sample: dict, ctx: EpisodeContext) -> Trajectory:
        server = self.start()
        assert self.endpoint is not None
        episode_id = f"{next(self._ids)}"
        episode = self.endpoint.open_episode(episode_id, ctx.sampling, ctx.limits.max_turns, ctx.limits.max_tokens)
        start = time.perf_counter()
        try:
            try:
                await self._run_agent(server.base_url(episode_id), dict(sample))
            except Exception as err:  # noqa: BLE001 - a refused call often ends an agent by raising
                if not episode.truncated:
                    raise
                log.debug("agent %s raised after episode %s was truncated (%s): %s", self.spec, episode_id,
                          episode.truncated, err)
        finally:  # also on cancellation (agent.episode_timeout_s): later calls of the episode are refused
            calls = self.endpoint.close_episode(episode_id)
        if not calls:
            raise ValueError(f"agent {self.spec} made no call in episode {episode_id}: it must call the chat or "
                             "completions API at the base_url it is given")
        return self._trajectory(calls, episode, time.perf_counter() - start)

    async def _run_agent(self, base_url: str, sample: dict) -> None:
        if inspect.iscoroutinefunction(self.agent):
            await self.agent(base_url, sample)
            return
        result = await asyncio.get_running_loop().run_in_executor(self._threads, self.agent, base_url, sample)
        if inspect.isawaitable(result):  # a callable object with an async __call__
            await result

    def _trajectory(self, calls: list[CallRecord], episode: EpisodeSettings, seconds: float) -> Trajectory:
        runs = assemble(calls)
        run = runs[-1]  # the calls that reach the end of the episode: their text is what the reward scores
        if len(runs) > 1 and not self._said_nonlinear:
            self._said_nonlinear = True
            log.warning("agent %s: an episode is not linear, only its last %d of %d calls train (%s); counted "
                        "as agent/nonlinear", self.spec, len(run.calls), len(calls), run.note)
        trajectory = Trajectory(run.prompt_ids, run.token_ids, run.loss_mask, run.logprobs,
                                run.token_versions if run.token_versions is not None else [], run.text,
                                run.finish_reason, run.routed_experts)
        trajectory.turns, trajectory.nonlinear = len(run.calls), len(runs) > 1
        trajectory.truncated = bool(episode.truncated)
        trajectory.gen_s = sum(c.generate_s for c in calls)
        trajectory.tool_s = max(0.0, seconds - trajectory.gen_s)
        trajectory.messages = _conversation(calls[-1])
        trajectory.tool_calls = sum(m.get("role") == "tool" for m in trajectory.messages)
        trajectory.tool_errors = sum(len(c.tool_call_errors) for c in calls)
        return trajectory


def _conversation(last: CallRecord) -> list[dict]:
    """The episode by role, for traces: the last chat call's messages and the reply it got."""
    if isinstance(last.context, ChatContext):
        return template_messages([*last.context.messages, last.context.reply])
    return [{"role": "assistant", "content": last.text}]
