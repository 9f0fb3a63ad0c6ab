"""Environments for agents: the protocol, the checked calls that turn a failure into EnvFailure, the
built-in GuessNumber example and loading by name."""

from __future__ import annotations

import asyncio
import textwrap
import time

import pytest

from mrl.agent.env import (EnvFailure, Environment, GuessNumber, load_environment, make_env, reset_env,
                           step_env)


def play(env: Environment, sample: dict, turns: list[str]) -> list[tuple]:
    async def main():
        steps = [await reset_env(env, sample)]
        for text in turns:
            steps.append(await step_env(env, text))
        return steps

    return asyncio.run(main())


def test_guess_number_episode():
    env = make_env(load_environment("guess_number"))
    steps = play(env, {"secret": 42, "max_guesses": 5}, ["I guess 50.", "hmm", "Then 40", "It is 42"])
    first = ("I am thinking of an integer from 1 to 100. You have 5 guesses; after each I say higher or "
             "lower. Answer with your guess.")
    assert steps[0] == [{"role": "user", "content": first}]
    assert steps[1:] == [
        ([{"role": "user", "content": "Lower. 4 guesses left."}], 0.0, False),
        ([{"role": "user", "content": "Please answer with a number. 3 guesses left."}], 0.0, False),
        ([{"role": "user", "content": "Higher. 2 guesses left."}], 0.0, False),
        ([{"role": "user", "content": "Yes, it is 42."}], 1.0, True),
    ]


def test_guess_number_runs_out_and_seeds_are_reproducible():
    steps = play(GuessNumber(), {"secret": 3, "low": 1, "high": 10, "max_guesses": 2}, ["5", "4"])
    assert steps[-1] == ([{"role": "user", "content": "No guesses left; it was 3."}], 0.0, True)
    first, second = GuessNumber(), GuessNumber()
    first.reset({"seed": 7})
    second.reset({"seed": 7})
    assert first.secret == second.secret and 1 <= first.secret <= 100


class Scripted:
    """An environment whose step returns whatever the test gives it (or raises it)."""

    def __init__(self, result):
        self.result = result

    def reset(self, sample: dict):
        return [{"role": "system", "content": "rules"}, {"role": "user", "content": sample["q"]}]

    def step(self, text: str):
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


@pytest.mark.parametrize("result, message", [
    (KeyError("board"), "Scripted.step raised KeyError: 'board'"),
    (SystemExit(2), "Scripted.step raised SystemExit: 2"),
    (("obs", 1.0), "Scripted.step returned tuple: return (observation, reward, done)"),
    (("obs", float("nan"), True), "returned the reward nan: return a finite number"),
    (("obs", "1", True), "returned the reward '1'"),
    (("obs", 1.0, "yes"), "returned done='yes': return True or False"),
    ((42, 1.0, True), "returned a int observation: return a string or a list of chat messages"),
    (([{"role": "assistant", "content": "hi"}], 1.0, True), "each needs a role of user, tool, system"),
])
def test_a_failing_environment_raises_env_failure(result, message):
    with pytest.raises(EnvFailure, match=message.replace("(", r"\(").replace(")", r"\)")):
        play(Scripted(result), {"q": "?"}, ["turn"])


def test_messages_observations_pass_through():
    tool_turn = [{"role": "tool", "content": "42"}]
    steps = play(Scripted((tool_turn, 0.5, False)), {"q": "what?"}, ["turn"])
    assert steps == [[{"role": "system", "content": "rules"}, {"role": "user", "content": "what?"}],
                     (tool_turn, 0.5, False)]


def test_async_environments_and_timeouts():
    class Async:
        async def reset(self, sample: dict) -> str:
            return "start"

        async def step(self, text: str):
            await asyncio.sleep(10 if text == "slow" else 0)
            return text.upper(), 1, 1

    class SlowSync(Scripted):
        def step(self, text: str):
            time.sleep(0.3)
            return "late", 0.0, True

    assert play(Async(), {}, ["go"]) == [[{"role": "user", "content": "start"}],
                                         ([{"role": "user", "content": "GO"}], 1.0, True)]

    async def timed_out(env):
        await reset_env(env, {"q": "?"})
        start = time.monotonic()
        with pytest.raises(EnvFailure, match=r"\.step did not answer within 0.05 s"):
            await step_env(env, "slow", timeout_s=0.05)
        return time.monotonic() - start

    assert asyncio.run(timed_out(Async())) < 0.25
    assert asyncio.run(timed_out(SlowSync(None))) < 0.25


def test_make_env_checks_the_factory():
    def broken():
        raise RuntimeError("no board")

    with pytest.raises(EnvFailure, match="creating the environment .*broken raised RuntimeError: no board"):
        make_env(broken)
    with pytest.raises(EnvFailure, match=r"made a dict, which has no reset\(sample\) and step\(text\)"):
        make_env(dict)
    assert isinstance(make_env(GuessNumber), Environment)


def test_load_environment_from_a_file_and_errors(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(textwrap.dedent('''
        class Echo:
            def reset(self, sample):
                return sample["prompt"]

            def step(self, text):
                return text, 1.0, True
    '''))
    env = make_env(load_environment(f"{path}:Echo"))
    assert play(env, {"prompt": "hi"}, ["bye"])[1] == ([{"role": "user", "content": "bye"}], 1.0, True)
    with pytest.raises(ValueError, match="environment 'guess' is neither a built-in"):
        load_environment("guess")
    with pytest.raises(ValueError, match="has no callable 'Nope' \\(from environment"):
        load_environment(f"{path}:Nope")
