"""The `openai` loop (mrl/agent/openai_loop.py) through EpisodeRunner on a scripted engine: an agent
written against the real `openai` client (sync and async) becomes one linear trajectory whose tokens
are its conversation's template render and whose loss mask leaves out the tool tokens; a non-linear
agent trains its last linked calls; a crashing, silent, slow or over-the-limit agent; concurrent
episodes. No Ray, no vLLM. The agents below are loaded by file path, as agent.openai_agent names them."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest

from mrl.rollout.engine import Generation, SamplingSettings, _mix

QWEN_TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "qwen2_5.jinja"
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
WAIT_S = 20


@functools.cache
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    from mrl.models.tiny import build_tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), eos_token="<|im_end|>", pad_token="<pad>")
    tok.chat_template = QWEN_TEMPLATE.read_text()
    return tok


# --- the agents (agent.openai_agent: "<this file>:<name>") ---

def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=WAIT_S)


def tool_agent(base_url: str, sample: dict) -> None:
    """Ask (greedy and seeded, which the rollout's settings override), run the add tool, answer."""
    chat = _client(base_url).chat.completions
    messages = [{"role": "user", "content": sample["prompt"]}]
    reply = chat.create(model="any", messages=messages, tools=TOOLS, temperature=0.0, seed=1).choices[0].message
    call = reply.tool_calls[0]
    args = json.loads(call.function.arguments)
    messages += [reply.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
    chat.create(model="any", messages=messages, tools=TOOLS, temperature=0.0, seed=1)


async def async_tool_agent(base_url: str, sample: dict) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=WAIT_S) as api:
        messages = [{"role": "user", "content": sample["prompt"]}]
        reply = (await api.chat.completions.create(model="any", messages=messages, tools=TOOLS)).choices[0].message
        call = reply.tool_calls[0]
        args = json.loads(call.function.arguments)
        messages += [reply, {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
        await api.chat.completions.create(model="any", messages=messages, tools=TOOLS)


def forgetful_agent(base_url: str, sample: dict) -> None:
    """Its second call drops the first call's reply: a new conversation, not linear."""
    chat = _client(base_url).chat.completions
    chat.create(model="any", messages=[{"role": "user", "content": sample["prompt"]}], tools=TOOLS)
    chat.create(model="any", messages=[{"role": "user", "content": "what is 2 plus 3?"}], tools=TOOLS)


def crashing_agent(base_url: str, sample: dict) -> None:
    _client(base_url).chat.completions.create(model="any", messages=[{"role": "user", "content": sample["prompt"]}])
    raise RuntimeError("the agent fell over")


def silent_agent(base_url: str, sample: dict) -> None:
    """Returns without calling the endpoint."""


def slow_agent(base_url: str, sample: dict) -> None:
    """Calls after agent.episode_timeout_s; writes what it got to the file $LATE_CALL names (this
    module is loaded afresh from its file: its globals are not the test's)."""
    time.sleep(1.0)
    try:
        _client(base_url).chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}])
        Path(os.environ["LATE_CALL"]).write_text("answered")
    except openai.NotFoundError as err:
        Path(os.environ["LATE_CALL"]).write_text(str(err))


# --- the engine ---

class ScriptedEngine:
    """A question "what is A plus B?" gets a call of the add tool, a tool response "the answer is R.",
    anything else "It stands."; then <|im_end|>, cut at max_tokens; log-prob -0.25 a token, weight
    version 2; each call sleeps `delay_s` (on the caller's thread, as the streaming engine does).
    Records every call; `peak`: the most at once."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s, self.calls, self.running, self.peak = delay_s, [], 0, 0
        self.llm = SimpleNamespace(get_tokenizer=tokenizer)
        self._lock = threading.Lock()

    def generate(self, prompts, sampling):
        (prompt,) = prompts
        with self._lock:
            self.calls.append((list(prompt), sampling))
            self.running += 1
            self.peak = max(self.peak, self.running)
        time.sleep(self.delay_s)
        with self._lock:
            self.running -= 1
        text = tokenizer().decode(prompt)
        last = text.rsplit("<|im_start|>", 2)[-2]
        if answer := re.search(r"<tool_response>\n(.*?)\n</tool_response>", last):
            reply = f"the answer is {answer.group(1)}."
        elif question := re.search(r"what is (\d+) plus (\d+)\?", last):
            reply = '<tool_call>\n{"name": "add", "arguments": {"a": %s, "b": %s}}\n</tool_call>' % question.groups()
        else:
            reply = "It stands."
        ids = tokenizer().encode(reply, add_special_tokens=False) + [tokenizer().convert_tokens_to_ids("<|im_end|>")]
        ids, finish = (ids, "stop") if len(ids) <= sampling.max_tokens else (ids[: sampling.max_tokens], "length")
        text = tokenizer().decode(ids, skip_special_tokens=True)
        return [[Generation(list(prompt), ids, text, [-0.25] * len(ids), finish, 2, [2] * len(ids))]]


@pytest.fixture
def runner():
    """runner(agent name, **AgentSettings) -> an EpisodeRunner of the openai loop; endpoints stopped after."""
    from mrl.agent.runner import AgentSettings, EpisodeRunner

    made = []

    def make(agent: str, delay_s: float = 0.0, **settings):
        spec = agent if ":" in agent else f"{__file__}:{agent}"
        made.append(EpisodeRunner(ScriptedEngine(delay_s), AgentSettings("openai", openai_agent=spec, **settings)))
        return made[-1]

    yield make
    for r in made:
        r.loop.close()


def prompt(a: int, b: int) -> list[int]:
    return tokenizer().encode(f"what is {a} plus {b}?", add_special_tokens=False)


SAMPLING = SamplingSettings(temperature=0.8, max_tokens=200, seed=5)


@pytest.mark.parametrize("agent", ["tool_agent", "async_tool_agent"])
def test_an_openai_agent_is_one_linear_trajectory_that_trains_only_the_policys_tokens(runner, agent):
    from mrl.agent.chat import ChatRenderer

    r = runner(agent)
    (sample,) = r.generate([prompt(12, 30)], SAMPLING)[0]
    assert "error" not in sample.agent, sample.agent
    assert sample.text == "the answer is 42." and sample.agent["turns"] == 2 and sample.agent["tool_calls"] == 1
    assert not sample.agent["nonlinear"] and not sample.agent["truncated"]
    chat = ChatRenderer(tokenizer())
    assert sample.prompt_ids == chat.prompt_ids([{"role": "user", "content": "what is 12 plus 30?"}], TOOLS)
    (first, _), (second, _) = r.engine.calls
    tool = chat.append_ids([{"role": "tool", "content": "42"}], TOOLS)
    assert second == first + sample.token_ids[: len(second) - len(first)]  # the episode's context, as generated
    n0 = len(second) - len(first) - len(tool)
    assert second[len(first) + n0:] == tool  # the tool result as template tokens, appended
    n1 = len(sample.token_ids) - n0 - len(tool)
    assert sample.loss_mask == [1] * n0 + [0] * len(tool) + [1] * n1
    assert sample.logprobs == [-0.25] * n0 + [0.0] * len(tool) + [-0.25] * n1
    assert sample.token_versions == [2] * len(sample.token_ids)
    roles = [m["role"] for m in sample.agent["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    chat.check(sample.agent["messages"], sample.prompt_ids + sample.token_ids, TOOLS)  # the template's own render
    # the rollout's sampling, the episode's seed stream, whatever the agent asked for
    assert [(s.temperature, s.seed) for _, s in r.engine.calls] == [(0.8, _mix(5, 0)), (0.8, _mix(5, 1))]
    assert all(s.stop_token_ids == tuple(chat.end_of_turn_ids()) for _, s in r.engine.calls)


def test_a_non_linear_agent_trains_its_last_linked_calls_and_says_so(runner):
    from mrl.agent.runner import episode_metrics

    r = runner("forgetful_agent")
    (sample,) = r.generate([prompt(1, 2)], SAMPLING)[0]
    assert sample.agent["nonlinear"] and sample.agent["turns"] == 1 and "error" not in sample.agent
    assert sample.prompt_ids == r.engine.calls[1][0] and sample.loss_mask == [1] * len(sample.token_ids)
    assert "2 plus 3" in tokenizer().decode(sample.prompt_ids) and '"a": 2, "b": 3' in sample.text
    assert episode_metrics([sample])["agent/nonlinear"] == 1.0


def test_crashing_silent_and_slow_agents_fail_their_episodes_only(runner, tmp_path, monkeypatch):
    (crashed,) = runner("crashing_agent").generate([prompt(1, 2)], SAMPLING)[0]
    assert crashed.token_ids == [] and crashed.agent["error"] == "RuntimeError: the agent fell over"
    (silent,) = runner("silent_agent").generate([prompt(1, 2)], SAMPLING)[0]
    assert "made no call in episode 0" in silent.agent["error"]
    late_call = tmp_path / "late_call"
    monkeypatch.setenv("LATE_CALL", str(late_call))
    slow = runner("slow_agent", episode_timeout_s=0.2)
    (late,) = slow.generate([prompt(1, 2)], SAMPLING)[0]
    assert late.agent["error"].startswith("TimeoutError: the episode ran past agent.episode_timeout_s=0.2 s")
    deadline = time.monotonic() + WAIT_S
    while not late_call.exists() and time.monotonic() < deadline:  # the agent's thread runs on
        time.sleep(0.05)
    assert "episode '0' is not open" in late_call.read_text()  # and its call is refused
    assert slow.engine.calls == [] and slow.loop.endpoint.log.episodes() == []


def test_a_call_past_the_limits_is_refused_and_the_episode_kept_as_truncated(runner):
    r = runner("tool_agent", max_turns=1)
    (sample,) = r.generate([prompt(3, 4)], SAMPLING)[0]
    assert "error" not in sample.agent and sample.agent["truncated"] and sample.agent["turns"] == 1
    assert len(r.engine.calls) == 1 and "<tool_call>" in sample.text
    room = len(sample.token_ids) + 2  # the first call fits the context budget; the tool result does not
    budget = runner("tool_agent", max_tokens=len(sample.prompt_ids) + room)
    (cut,) = budget.generate([prompt(3, 4)], SAMPLING)[0]
    assert "error" not in cut.agent and cut.agent["truncated"] and cut.token_ids == sample.token_ids
    assert [s.max_tokens for _, s in budget.engine.calls] == [room]


def test_concurrent_episodes_n_per_prompt_stay_apart(runner):
    r = runner("tool_agent", delay_s=0.05)
    groups = r.generate([prompt(i, 100) for i in range(3)], SamplingSettings(temperature=1.0, max_tokens=200, n=2,
                                                                            seed=9))
    assert [len(g) for g in groups] == [2, 2, 2]
    for i, group in enumerate(groups):
        assert all(s.text == f"the answer is {i + 100}." and not s.agent["nonlinear"] for s in group), group
    assert r.engine.peak > 1  # the episodes' calls reached the engine together
    # each sample's episode draws from its own seed stream (seed + i), as the built-in loops' turns do
    seeds = sorted(s.seed for _, s in r.engine.calls)
    assert seeds == sorted([_mix(9, k) for k in (0, 1)] * 3 + [_mix(10, k) for k in (0, 1)] * 3)


def test_the_openai_loop_and_its_agent_go_together():
    from mrl.config import ConfigError, load_config

    def errors(*overrides):
        try:
            load_config("configs/tiny_cpu_grpo.yaml", list(overrides), check_files=False)
        except ConfigError as err:
            return str(err)
        return ""

    assert errors("agent.loop=openai", "agent.openai_agent=examples/openai_agent.py:agent") == ""
    assert "agent.loop openai and agent.openai_agent go together" in errors("agent.loop=openai")
    assert "agent.openai_agent is set but agent.loop is none" in errors("agent.openai_agent=a.b:c")
    assert re.search(r"agent.episode_timeout_s 0(\.0)? must be > 0", errors(
        "agent.loop=openai", "agent.openai_agent=a.b:c", "agent.episode_timeout_s=0"))


def test_the_example_agent_runs(runner):
    r = runner(f"{Path(__file__).resolve().parents[2] / 'examples' / 'openai_agent.py'}:agent")
    (sample,) = r.generate([prompt(5, 6)], SAMPLING)[0]
    assert "error" not in sample.agent and sample.agent["turns"] == 2 and not sample.agent["nonlinear"]
    assert [m["role"] for m in sample.agent["messages"]] == ["user", "assistant", "user", "assistant"]


AGENT_PROGRAM = """
import json, sys, openai
sample = json.load(sys.stdin)  # OPENAI_BASE_URL is the episode's endpoint: the client finds it alone
openai.OpenAI(max_retries=0).chat.completions.create(model="any", messages=[{"role": "user", "content": sample["prompt"]}])
sys.stderr.write(f"asked {sample['prompt']!r}\\n")
sys.exit(int(sys.argv[1]))
"""


def test_an_agent_program_is_an_episode_and_its_failure_fails_only_that_episode(runner, tmp_path):
    program = tmp_path / "agent.py"
    program.write_text(AGENT_PROGRAM)
    (sample,) = runner(f"command: python {program} 0").generate([prompt(12, 30)], SAMPLING)[0]
    assert "error" not in sample.agent, sample.agent
    assert sample.agent["turns"] == 1 and '"name": "add"' in sample.text  # the scripted engine's tool call
    (failed,) = runner(f"command: python {program} 3").generate([prompt(1, 2)], SAMPLING)[0]
    assert failed.token_ids == [] and failed.agent["error"].endswith("exited with 3: asked 'what is 1 plus 2?'")
