"""The agent loop (mrl/agent/loop.py, runner.py) on a scripted engine: a tool-calling episode's tokens
equal its conversation's template render, only the policy's tokens train, limits end episodes, a
crashing agent fails its episode only; the trainer batch (mrl.experience) masks what the tools wrote."""

import asyncio
import functools
from types import SimpleNamespace

import pytest

from mrl.agent.loop import AgentLimits, EpisodeContext, Trajectory, single_turn, tool_calling
from mrl.agent.runner import AgentSettings, EpisodeRunner
from mrl.rollout.engine import Generation, SamplingSettings, Task

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123456789*987654321"}}\n</tool_call>'
ANSWER = "121932631112635269"


@functools.cache
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    from mrl.models.tiny import _CHAT_TEMPLATE, build_tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), chat_template=_CHAT_TEMPLATE,
                                   eos_token="<|im_end|>")


class ScriptedEngine:
    """Answers turn k of an episode with script[k] (ending with <|im_end|>), log-prob -0.5 a token,
    weight version 3; records every call's prompt and settings."""

    def __init__(self, script: list[str]):
        self.script, self.calls = script, []
        self.llm = SimpleNamespace(get_tokenizer=tokenizer)

    def generate(self, prompts, sampling):
        settings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        return [[self._answer(p, s)] for p, s in zip(prompts, settings)]

    def _answer(self, prompt, sampling):
        self.calls.append((list(prompt), sampling))
        turn = tokenizer().decode(prompt).count("<|im_start|>assistant") - 1
        text = self.script[min(turn, len(self.script) - 1)]
        ids = tokenizer().encode(text, add_special_tokens=False)[: sampling.max_tokens - 1]
        text = tokenizer().decode(ids)
        ids += tokenizer().encode("<|im_end|>", add_special_tokens=False)
        return Generation(list(prompt), ids, text, [-0.5] * len(ids), "stop", 3, [3] * len(ids))


def run_episode(engine: ScriptedEngine, limits: AgentLimits = AgentLimits()):
    from mrl.agent.chat import ChatRenderer
    from mrl.agent.tools import Toolbox, load_tool

    chat = ChatRenderer(tokenizer())
    prompt = chat.prompt_ids([{"role": "user", "content": "What is 123456789*987654321?"}])

    async def generate(ids, sampling):
        return (await asyncio.to_thread(engine.generate, [ids], sampling))[0][0]

    ctx = EpisodeContext(generate, SamplingSettings(temperature=1.0, max_tokens=128, seed=7), chat,
                         Toolbox([load_tool("calculator")]), limits)
    return chat, asyncio.run(tool_calling({"prompt_ids": prompt}, ctx))


def test_a_tool_episode_is_its_conversation_and_trains_only_the_policys_tokens():
    from mrl.experience import rollout_batch

    engine = ScriptedEngine([CALL, ANSWER])
    chat, trajectory = run_episode(engine)
    assert trajectory.turns == 2 and trajectory.tool_calls == 1 and trajectory.tool_errors == 0
    assert [m["role"] for m in trajectory.messages] == ["assistant", "tool", "assistant"]
    assert trajectory.messages[1]["content"] == ANSWER and trajectory.text == ANSWER
    # every turn is generated from the episode's context, and the whole episode renders as its conversation
    assert engine.calls[1][0] == trajectory.prompt_ids + trajectory.token_ids[: len(engine.calls[1][0]) -
                                                                                len(trajectory.prompt_ids)]
    conversation = [{"role": "user", "content": "What is 123456789*987654321?"}, *trajectory.messages]
    chat.check(conversation, trajectory.prompt_ids + trajectory.token_ids)
    # each turn stops at the template's end of turn and draws with a seed of its own, the first the episode's
    assert all(s.stop_token_ids == tuple(chat.end_of_turn_ids()) for _, s in engine.calls)
    assert engine.calls[0][1].seed == 7 and engine.calls[1][1].seed != 7

    sample = trajectory.to_generation()
    appended = [i for i, m in enumerate(sample.loss_mask) if not m]
    tool_text = tokenizer().decode([sample.token_ids[i] for i in appended])
    assert ANSWER in tool_text and "<|im_start|>tool" in tool_text and "<|im_start|>assistant" in tool_text
    assert all(sample.logprobs[i] == 0.0 for i in appended) and sample.token_versions == [3] * len(sample.token_ids)
    batch = rollout_batch([[sample]], [1.0])
    start = len(sample.prompt_ids) - 1
    row = batch["response_mask"][0, start : start + len(sample.token_ids)]
    assert row.tolist() == [float(m) for m in sample.loss_mask]
    assert batch["response_mask"][0].sum() == sum(sample.loss_mask)
    assert batch["token_level_rewards"][0, start + len(sample.token_ids) - 1] == 1.0  # the answer's last token


def test_limits_end_an_episode_and_say_so():
    _, looping = run_episode(ScriptedEngine([CALL]), AgentLimits(max_turns=3))
    assert looping.turns == 3 and looping.truncated and looping.tool_calls == 3
    engine = ScriptedEngine([CALL])
    _, short = run_episode(engine, AgentLimits(max_turns=10, max_tokens=120))
    assert short.truncated and len(short.prompt_ids) + len(short.token_ids) <= 120
    assert all(len(p) + s.max_tokens <= 120 for p, s in engine.calls)  # a turn never outgrows the budget
    sample = short.to_generation()
    assert sample.loss_mask[-1] == 1  # cut after the last generated token: nothing unanswered is kept


def test_a_malformed_call_is_answered_and_counted():
    _, trajectory = run_episode(ScriptedEngine(['<tool_call>{"name": "calculator"', ANSWER]))
    assert trajectory.turns == 2 and trajectory.tool_errors == 1
    assert trajectory.messages[1]["content"].startswith("Error:")


def test_the_runner_runs_n_episodes_a_prompt_and_a_crash_fails_only_its_episode(monkeypatch):
    from mrl.agent import runner

    from mrl.agent.chat import ChatRenderer

    prompt = ChatRenderer(tokenizer()).prompt_ids([{"role": "user", "content": "What is 123456789*987654321?"}])
    good = EpisodeRunner(ScriptedEngine([CALL, ANSWER]), AgentSettings("tool_calling", ("calculator",)))
    groups = good.generate([prompt, prompt], SamplingSettings(n=3, seed=5, max_tokens=128))
    assert [len(g) for g in groups] == [3, 3] and all(s.agent["turns"] == 2 for g in groups for s in g)
    assert len({s.seed for _, s in good.engine.calls}) == 6  # 3 samples x 2 turns, the same for both prompts

    async def crash(sample, ctx):
        raise RuntimeError("the environment fell over")

    monkeypatch.setitem(runner.BUILT_IN, "crash", crash)
    bad = EpisodeRunner(ScriptedEngine([ANSWER]), AgentSettings("crash"))
    (failed,) = bad.generate([prompt], SamplingSettings())[0]
    assert failed.token_ids == [] and failed.agent["error"] == "RuntimeError: the environment fell over"
    assert failed.finish_reason == "error"  # None would be a sample to continue after a push: a stalled step


@pytest.mark.parametrize("streaming", [False, True])
def test_episodes_turn_together_and_an_environment_task_follows_the_prompts_seed(streaming):
    """Every episode's turn is in the engine at once: in one call on a plain engine, in calls that run
    at once on a streaming one (not asyncio's CPUs + 4 threads). The task seed is the prompt's seed of
    the step: the same for a GRPO group, another for another step."""
    import threading

    class Gathering(ScriptedEngine):
        def __init__(self, script, expected):
            super().__init__(script)
            self.streaming, self.expected, self.in_flight, self.sizes = streaming, expected, 0, []
            self.changed = threading.Condition()

        def generate(self, prompts, sampling):
            with self.changed:  # returns only once every episode's turn is in (an error per episode otherwise)
                self.in_flight += len(prompts)
                self.sizes.append(len(prompts))
                self.changed.notify_all()
                assert self.changed.wait_for(lambda: self.in_flight >= self.expected, timeout=20)
            return super().generate(prompts, sampling)

    seeds = []

    async def record(sample, ctx):
        seeds.append(sample["seed"])
        trajectory = Trajectory(list(sample["prompt_ids"]))
        await ctx.turn(trajectory)
        return trajectory

    runner = EpisodeRunner(Gathering([ANSWER], expected=24), AgentSettings("single_turn"))
    runner.loop = record
    groups = runner.generate([[1, 2], [3, 4], [5, 6]], [SamplingSettings(n=8, seed=s) for s in (10, 10, 20)])
    assert all(g.agent.get("error") is None and g.agent["turns"] == 1 for group in groups for g in group)
    assert sorted(seeds) == [10] * 16 + [20] * 8
    assert streaming or runner.engine.sizes == [24]


def test_without_an_agent_a_rollout_is_one_engine_call_of_plain_samples():
    """agent.loop none: the single_turn loop, the engine's samples unchanged (no mask, no episode stats),
    every sample in one call with the seeds vLLM gives an n-request's (seed + i)."""
    engine = ScriptedEngine([ANSWER])
    runner = EpisodeRunner(engine, AgentSettings())
    groups = runner.generate([[1, 2], [3, 4]], SamplingSettings(n=3, seed=5, max_tokens=64))
    assert [len(g) for g in groups] == [3, 3] and len(engine.calls) == 6 and runner.chat is None
    assert [s.seed for _, s in engine.calls] == [5, 6, 7, 5, 6, 7] and all(s.n == 1 for _, s in engine.calls)
    assert groups[1][0] == engine._answer([3, 4], engine.calls[3][1])  # the engine's own sample, unchanged
    assert all(g.loss_mask is None and g.agent is None for group in groups for g in group)
    with pytest.raises(TypeError, match="rollout prompts are token ids"):
        runner.generate(["12+7="], SamplingSettings())


@pytest.mark.parametrize("loop", ["none", "tool_calling"])
def test_an_engine_that_fails_fails_the_generate_call_not_an_episode(loop):
    class Failing(ScriptedEngine):
        def generate(self, prompts, sampling):
            raise RuntimeError("engine core died")

    runner = EpisodeRunner(Failing([ANSWER]), AgentSettings(loop, ("calculator",) if loop != "none" else ()))
    with pytest.raises(RuntimeError, match="engine core died"):
        runner.generate([[1, 2]], SamplingSettings(n=2))


def test_the_reward_sits_on_the_last_token_the_policy_generated():
    from mrl.experience import rollout_batch

    sample = Generation([1, 2], [3, 4, 5, 6], "x", [-0.5, -0.5, 0.0, 0.0], "stop", 0, [0] * 4, loss_mask=[1, 1, 0, 0])
    batch = rollout_batch([[sample]], [1.0])
    assert batch["token_level_rewards"][0].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]  # label of token 4: position 2
    assert batch["response_mask"][0].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]


def test_a_loop_that_cannot_be_found_is_named():
    from mrl.agent.runner import load_loop

    with pytest.raises(ValueError, match="agent.loop 'nowhere:episode': importing nowhere failed"):
        load_loop("nowhere:episode")
    with pytest.raises(ValueError, match="json has no callable 'nothing' \\(from agent.loop 'json:nothing'"):
        load_loop("json:nothing")
    assert load_loop("tool_calling").__name__ == "tool_calling"


def test_the_agent_section_is_checked_before_anything_starts():
    from mrl.config import ConfigError, load_config

    def errors(*overrides):
        try:
            load_config("configs/tiny_cpu_grpo.yaml", list(overrides), check_files=False)
        except ConfigError as err:
            return str(err)
        return ""

    assert errors("agent.loop=tool_calling", "agent.tools=[calculator]", "data.chat_template=true") == ""
    assert "set data.chat_template: true" in errors("agent.loop=tool_calling", "agent.tools=[calculator]")
    assert "agent.tools is set but agent.loop is none: set agent.loop: tool_calling" in errors("agent.tools=[calculator]")
    assert "agent.loop environment and agent.environment go together" in errors("agent.loop=environment")
    assert errors("agent.loop=environment", "agent.environment=guess_number", "agent.turn_rewards=true") == ""
    assert errors("agent.loop=tool_calling", "agent.tools=[calculator]", "data.chat_template=true",
                  "agent.turn_batching=rounds") == ""
    assert "agent.turn_batching rounds gives the engine one call at a time, and async.streaming's" in errors(
        "agent.loop=tool_calling", "agent.tools=[calculator]", "data.chat_template=true", "agent.turn_batching=rounds",
        "trainer.mode=fully_async", "async.streaming=true")
    assert "agent.turn_rewards: loop tool_calling gives no per-turn rewards" in errors(
        "agent.loop=tool_calling", "agent.tools=[calculator]", "data.chat_template=true", "agent.turn_rewards=true")
    assert "agent.loop tool_calling needs agent.tools" in errors("agent.loop=tool_calling")
    assert "agent.tools: 'shell' is neither a built-in" in errors("agent.loop=tool_calling", "agent.tools=[shell]")
    assert "agent.loop openai cannot go on after a weight push" in errors(
        "agent.loop=openai", "agent.openai_agent=examples/openai_agent.py:agent", "async.partial_rollout=true",
        "trainer.mode=fully_async")
    assert errors("agent.loop=environment", "agent.environment=guess_number", "async.partial_rollout=true",
                  "trainer.mode=fully_async") == ""
    assert errors("agent.loop=tool_calling", "agent.tools=[calculator]", "data.chat_template=true",
                  "async.partial_rollout=true", "trainer.mode=fully_async") == ""
    from mrl.agent.loop import BUILT_IN
    from mrl.config.agent_checks import NOT_RESUMABLE

    assert all(getattr(loop, "resumable", False) for loop in BUILT_IN.values()) and NOT_RESUMABLE == ("openai",)


def test_an_environment_sets_the_task_answers_each_turn_and_gives_the_reward():
    """guess_number: the engine guesses 50, then 75 (scripted); the secret is 75 (from the sample)."""
    engine = ScriptedEngine(["My guess is 50.", "75"])
    runner = EpisodeRunner(engine, AgentSettings("environment", environment="guess_number"))
    runner.environment = lambda: _Fixed(75)
    (sample,) = runner.generate([[1, 2, 3]], SamplingSettings(max_tokens=16))[0]
    assert sample.agent["turns"] == 2 and sample.agent["reward"] == 1.0 and "error" not in sample.agent
    roles = [m["role"] for m in sample.agent["messages"]]
    assert roles == ["user", "assistant", "user", "assistant"] and sample.agent["messages"][2]["content"].startswith("Higher")
    assert "thinking of an integer" in tokenizer().decode(sample.prompt_ids)  # the first observation is the prompt
    assert sum(sample.loss_mask) < len(sample.token_ids)  # the hint between the guesses is not trained


def test_an_environments_rewards_stay_with_the_turns_that_earned_them():
    """A shaped guess_number: 0.25 for the first (wrong) guess, 1.0 for the right one; with
    agent.turn_rewards each sits on its turn's last token, otherwise their sum on the episode's."""
    from mrl.experience import rollout_batch

    engine = ScriptedEngine(["My guess is 50.", "75"])
    runner = EpisodeRunner(engine, AgentSettings("environment", environment="guess_number"))
    runner.environment = lambda: _Fixed(75, hint_reward=0.25)
    (sample,) = runner.generate([[1, 2, 3]], SamplingSettings(max_tokens=16))[0]
    first, last = sample.loss_mask.index(0) - 1, len(sample.token_ids) - 1  # the turns' last tokens
    assert sample.agent["reward"] == 1.25 and sample.agent["turn_rewards"] == [(first, 0.25), (last, 1.0)]
    start = len(sample.prompt_ids) - 1
    placed = rollout_batch([[sample]], [1.25], turn_rewards=True)["token_level_rewards"][0]
    assert placed[start + first] == 0.25 and placed[start + last] == 1.0 and placed.sum() == 1.25
    summed = rollout_batch([[sample]], [1.25])["token_level_rewards"][0]
    assert summed[start + last] == 1.25 and summed.sum() == 1.25


class _Fixed:
    def __init__(self, secret, hint_reward=0.0):
        from mrl.agent.env import GuessNumber

        self.game = GuessNumber()
        self.secret, self.hint_reward = secret, hint_reward

    def reset(self, sample):
        return self.game.reset({"secret": self.secret})

    def step(self, text):
        observation, reward, done = self.game.step(text)
        return observation, reward if done else self.hint_reward, done


class CuttingEngine(ScriptedEngine):
    """ScriptedEngine whose turns a weight push may cut: with `cut`, each call generates half of
    what its turn still lacks (finish None, version 3); without, the rest (version 4). A call's
    prompt may end inside a turn (a cut one going on): its answer is the turn's remaining tokens."""

    cut = False

    def _answer(self, prompt, sampling):
        from dataclasses import replace

        header = tokenizer().encode("<|im_start|>assistant\n", add_special_tokens=False)
        start = max(i + len(header) for i in range(len(prompt)) if prompt[i:i + len(header)] == header)
        begun = prompt[start:]
        whole = super()._answer(prompt[:start], replace(sampling, max_tokens=sampling.max_tokens + len(begun)))
        assert whole.token_ids[:len(begun)] == begun, "the cut turn went on from another turn's tokens"
        rest = whole.token_ids[len(begun):]
        rest, finish, version = (rest[:len(rest) // 2], None, 3) if self.cut else (rest, "stop", 4)
        return Generation(list(prompt), rest, tokenizer().decode(rest, skip_special_tokens=True),
                          [-0.5] * len(rest), finish, version, [version] * len(rest))


def test_a_tool_episode_cut_by_a_weight_push_goes_on_as_if_never_cut():
    """async.partial_rollout across turns: an episode cut mid-turn comes back unfinished with every
    token; given back as the prompt it goes on from there (twice here), and ends as the uncut
    episode: the same tokens, the tool called from the whole first turn, each token its version."""
    from mrl.agent.chat import ChatRenderer
    from mrl.modes.fully_async import continue_generation

    chat = ChatRenderer(tokenizer())
    prompt = chat.prompt_ids([{"role": "user", "content": "What is 123456789*987654321?"}])
    engine = CuttingEngine([CALL, ANSWER])
    runner = EpisodeRunner(engine, AgentSettings("tool_calling", ("calculator",)))
    engine.cut = True
    row = {"prompt": "What is 123456789*987654321?", "ground_truth": "121932631112635269", "metadata": {"id": 7}}
    (first,) = runner.generate([Task(prompt, row)], SamplingSettings(max_tokens=128, seed=5))[0]
    assert first.finish_reason is None and first.agent["turns"] == 1 and first.agent["interrupted"] == len(first.token_ids)
    (second,) = runner.generate([first], SamplingSettings(max_tokens=128, seed=9))[0]  # cut again, same turn
    assert second.finish_reason is None and second.token_ids[:len(first.token_ids)] == first.token_ids
    assert first.agent["row"] == second.agent["row"] == row  # the dataset row goes on with the episode
    engine.cut = False
    (whole,) = runner.generate([second], SamplingSettings(max_tokens=128, seed=9))[0]
    assert whole.finish_reason == "stop" and whole.agent["interrupted"] is None
    assert whole.agent["turns"] == 2 and whole.agent["tool_calls"] == 1 and whole.agent["tool_errors"] == 0
    assert [m["content"] for m in whole.agent["messages"]] == [CALL, ANSWER, ANSWER]
    conversation = [{"role": "user", "content": "What is 123456789*987654321?"}, *whole.agent["messages"]]
    chat.check(conversation, whole.prompt_ids + whole.token_ids)
    fresh = EpisodeRunner(ScriptedEngine([CALL, ANSWER]), AgentSettings("tool_calling", ("calculator",)))
    (uncut,) = fresh.generate([prompt], SamplingSettings(max_tokens=128, seed=5))[0]
    assert whole.token_ids == uncut.token_ids and whole.loss_mask == uncut.loss_mask
    cut = len(second.token_ids)
    assert whole.token_versions[:cut] == [3] * cut and set(whole.token_versions[cut:]) == {4}
    assert continue_generation(first, whole, None) is whole  # the mode's merge: the episode came back whole


class CutLaterTurns(CuttingEngine):
    """CuttingEngine that cuts turns after the first, `cuts` times in all."""

    cuts = 2

    def _answer(self, prompt, sampling):
        self.cut = tokenizer().decode(prompt).count("<|im_start|>assistant") > 1 and self.cuts > 0
        self.cuts -= self.cut
        return super()._answer(prompt, sampling)


def test_a_cut_environment_episode_goes_on_by_replaying_its_turns():
    """guess_number (secret 75, 0.25 a hint), its second guess cut twice: it goes on in a fresh environment
    its first turn is replayed into, and ends as the uncut episode; an environment that answers the
    replay otherwise fails the episode."""
    def runner(engine, secret=75):
        made = EpisodeRunner(engine, AgentSettings("environment", environment="guess_number"))
        made.environment = lambda: _Fixed(secret, hint_reward=0.25)
        return made

    script, sampling = ["My guess is 50.", "75"], SamplingSettings(max_tokens=16)
    (uncut,) = runner(ScriptedEngine(script)).generate([[1, 2, 3]], sampling)[0]
    cutting = runner(CutLaterTurns(script))
    (first,) = cutting.generate([[1, 2, 3]], sampling)[0]
    assert first.finish_reason is None and first.agent["turns"] == 2 and first.agent["turn_rewards"][0][1] == 0.25
    (second,) = cutting.generate([first], sampling)[0]
    (whole,) = cutting.generate([second], sampling)[0]
    assert second.finish_reason is None and whole.finish_reason == "stop"
    assert (whole.token_ids, whole.loss_mask) == (uncut.token_ids, uncut.loss_mask)
    assert (whole.agent["messages"], whole.agent["turn_rewards"]) == (uncut.agent["messages"], uncut.agent["turn_rewards"])
    assert whole.agent["reward"] == 1.25
    (failed,) = runner(CutLaterTurns(script), secret=40).generate([first], sampling)[0]
    assert failed.finish_reason == "error" and "_Fixed.step answered turn 1 otherwise" in failed.agent["error"]


def test_a_stop_string_spanning_a_cut_ends_the_turn_where_an_uncut_one_would():
    """The engine checks a continuation's stop strings in its own text only; the whole turn is checked."""
    from mrl.agent.chat import ChatRenderer

    text = "one two three four five six seven eight nine ten"
    engine = CuttingEngine([text])
    runner = EpisodeRunner(engine, AgentSettings("single_turn"))
    engine.cut = True
    prompt = ChatRenderer(tokenizer()).prompt_ids([{"role": "user", "content": "Count."}])
    (first,) = runner.generate([prompt], SamplingSettings(max_tokens=64, seed=1))[0]
    seen = tokenizer().decode(first.token_ids)
    stop = seen[-3:] + text[len(seen):len(seen) + 3]  # three characters either side of the cut
    assert text.startswith(seen) and text.count(stop) == 1
    engine.cut = False
    (whole,) = runner.generate([first], SamplingSettings(max_tokens=64, seed=1, stop=(stop,)))[0]
    assert whole.finish_reason == "stop" and whole.text == text[:text.index(stop)]
    assert stop in tokenizer().decode(whole.token_ids) and stop not in tokenizer().decode(whole.token_ids[:-1])
    assert len(whole.logprobs) == len(whole.token_versions) == len(whole.token_ids)


def test_an_episode_gets_its_dataset_row():
    seen = []

    async def loop(sample, ctx):
        seen.append(sample["row"])
        return await single_turn(sample, ctx)

    runner = EpisodeRunner(ScriptedEngine([ANSWER]), AgentSettings("single_turn"))
    runner.loop = loop
    row = {"prompt": "Hi", "ground_truth": "42", "metadata": {"source": "test"}}
    runner.generate([Task([1, 2, 3], row), [1, 2, 3]], SamplingSettings(max_tokens=8))
    assert seen == [row, None]  # a Task's episodes get its row; bare token ids come without one
    assert Task.of({"prompt_ids": [1], "prompt": "Hi", "ground_truth": "42", "metadata": {"source": "test"},
                    "sft_targets": [[5]]}) == Task([1], row)


def test_partial_rollout_refuses_a_loop_that_cannot_go_on_from_a_cut_turn():
    engine = ScriptedEngine([ANSWER])
    engine.interruptible = True  # the engine option async.partial_rollout sets
    with pytest.raises(ValueError, match="agent.loop examples/self_check.py:episode cannot go on from a cut one"):
        EpisodeRunner(engine, AgentSettings("examples/self_check.py:episode"))
    assert EpisodeRunner(engine, AgentSettings("tool_calling", ("calculator",))).loop.resumable
