"""Environments an agent talks to over several turns (tasks, games, user simulators), gym-like.

An Environment is made fresh for each episode by a factory (a class or a function of no
arguments). reset(sample) gives the first observation; step(text) takes the model's turn (its
text) and gives the next observation, a reward and whether the episode is done. An observation is
a string (the next user message) or a list of chat messages of role user, tool or system, appended
as they are. Methods may be sync (run in a thread, off the event loop) or async.
A crashing environment fails its episode, not the run: make_env/reset_env/step_env raise
EnvFailure (a raise, a wrong return shape, a timeout) and the caller records that episode as
failed, counts it and goes on. A sync method that times out cannot be stopped: its thread runs on.
Built-in example: GuessNumber ("guess_number"). docs/agents.md has the longer story.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import random
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol, Union, runtime_checkable

Observation = Union[str, list[dict]]
_OBSERVATION_ROLES = ("user", "tool", "system")
_THREADS = 32  # sync environment calls in flight at once, across every episode of the process
_EXECUTOR: ThreadPoolExecutor | None = None


@runtime_checkable
class Environment(Protocol):
    def reset(self, sample: dict) -> Observation:
        """The first observation of an episode on `sample` (a row of the dataset)."""

    def step(self, text: str) -> tuple[Observation, float, bool]:
        """The model's turn in, (observation, reward, done) out."""


class EnvFailure(RuntimeError):
    """The environment failed: the episode fails (counted by the caller), the run goes on."""


def make_env(factory: Callable[[], Any]) -> Environment:
    """A fresh environment from its factory, checked to have reset and step."""
    try:
        env = factory()
    except Exception as exc:
        raise EnvFailure(f"creating the environment {_name(factory)} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(env, Environment):
        raise EnvFailure(f"{_name(factory)}() made a {type(env).__name__}, which has no reset(sample) and "
                         "step(text) methods: return an Environment.")
    return env


async def reset_env(env: Environment, sample: dict, timeout_s: float = 60.0) -> list[dict]:
    """The first observation as chat messages; EnvFailure if the environment fails."""
    return as_messages(await _call(env, "reset", sample, timeout_s), f"{type(env).__name__}.reset")


async def step_env(env: Environment, text: str, timeout_s: float = 60.0) -> tuple[list[dict], float, bool]:
    """(messages, reward, done) for the model's turn `text`; EnvFailure if the environment fails."""
    where = f"{type(env).__name__}.step"
    result = await _call(env, "step", text, timeout_s)
    if not isinstance(result, tuple) or len(result) != 3:
        raise EnvFailure(f"{where} returned {type(result).__name__}: return (observation, reward, done).")
    observation, reward, done = result
    if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise EnvFailure(f"{where} returned the reward {reward!r}: return a finite number.")
    if not isinstance(done, (bool, numbers.Integral)):
        raise EnvFailure(f"{where} returned done={done!r}: return True or False.")
    return as_messages(observation, where), float(reward), bool(done)


def as_messages(observation: Any, where: str = "the environment") -> list[dict]:
    """An observation as chat messages: a string is one user message."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if not isinstance(observation, list):
        raise EnvFailure(f"{where} returned a {type(observation).__name__} observation: return a string or a "
                         "list of chat messages.")
    for message in observation:
        if not (isinstance(message, dict) and message.get("role") in _OBSERVATION_ROLES
                and isinstance(message.get("content"), str)):
            raise EnvFailure(f"{where} returned the message {str(message)[:120]!r}: each needs a role of "
                             f"{', '.join(_OBSERVATION_ROLES)} and a string content.")
    return observation


async def _call(env: Environment, method: str, argument: Any, timeout_s: float) -> Any:
    fn = getattr(env, method)
    where = f"{type(env).__name__}.{method}"
    if inspect.iscoroutinefunction(fn):
        work = fn(argument)
    else:  # not asyncio.to_thread: asyncio.run would wait at its end for a step that never returns
        work = asyncio.get_running_loop().run_in_executor(_threads(), fn, argument)
    task = asyncio.ensure_future(_contained(work, where))
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except BaseException:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise EnvFailure(f"{where} did not answer within {timeout_s:g} s (the episode fails).")
    try:
        return task.result()
    except (KeyboardInterrupt, EnvFailure):
        raise
    except BaseException as exc:  # the environment's own failure, SystemExit and cancellation included
        raise EnvFailure(f"{where} raised {type(exc).__name__}: {exc}") from exc


def _threads() -> ThreadPoolExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(_THREADS, thread_name_prefix="mrl-env")
    return _EXECUTOR


async def _contained(work: Any, where: str) -> Any:
    try:
        return await work
    except SystemExit as exc:  # a task re-raises SystemExit out of the event loop: stop it here
        raise EnvFailure(f"{where} raised SystemExit: {exc}") from None


def _name(factory: Callable[[], Any]) -> str:
    return getattr(factory, "__qualname__", type(factory).__name__)


class GuessNumber:
    """A built-in example: find a secret integer in [low, high] from "higher"/"lower" hints.

    sample: {"secret": int} or {"seed": int} (the secret drawn from it), and optionally "low" (1),
    "high" (100) and "max_guesses" (7). The last integer in the model's text is its guess; a turn
    without one gets a reminder and uses a guess. Reward 1.0 when found, 0.0 when out of guesses.
    """

    def reset(self, sample: dict) -> str:
        self.low, self.high = int(sample.get("low", 1)), int(sample.get("high", 100))
        if self.low > self.high:
            raise ValueError(f"guess_number sample has low {self.low} > high {self.high}: swap them.")
        secret = sample.get("secret")
        self.secret = int(secret) if secret is not None else random.Random(sample.get("seed", 0)).randint(
            self.low, self.high)
        self.guesses_left = int(sample.get("max_guesses", 7))
        return (f"I am thinking of an integer from {self.low} to {self.high}. You have {self.guesses_left} "
                "guesses; after each I say higher or lower. Answer with your guess.")

    def step(self, text: str) -> tuple[str, float, bool]:
        self.guesses_left -= 1
        numbers_in_text = re.findall(r"-?\d+", text)
        if numbers_in_text and int(numbers_in_text[-1]) == self.secret:
            return f"Yes, it is {self.secret}.", 1.0, True
        if self.guesses_left <= 0:
            return f"No guesses left; it was {self.secret}.", 0.0, True
        if not numbers_in_text:
            return f"Please answer with a number. {self.guesses_left} guesses left.", 0.0, False
        hint = "higher" if int(numbers_in_text[-1]) < self.secret else "lower"
        return f"{hint.capitalize()}. {self.guesses_left} guesses left.", 0.0, False


_BUILTINS: dict[str, Callable[[], Any]] = {"guess_number": GuessNumber}


def load_environment(spec: str) -> Callable[[], Any]:
    """The factory a spec names: a built-in ("guess_number"), or a class or function of no
    arguments as "package.module:Name" or "path/to/file.py:Name" (imported here). A failure is a
    ValueError of one line naming the fix."""
    if spec in _BUILTINS:
        return _BUILTINS[spec]
    if ":" not in spec:
        raise ValueError(f"environment {spec!r} is neither a built-in ({', '.join(_BUILTINS)}) nor an import "
                         "path: use 'package.module:Name' or 'path/to/file.py:Name'.")
    from mrl.rewards.sandbox import import_function

    return import_function(spec, kind="environment")
