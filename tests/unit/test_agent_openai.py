"""The OpenAI-compatible endpoint (mrl/agent/openai_server.py) driven by the real `openai` client
against uvicorn on 127.0.0.1, in front of a fake generate handle: token-in/token-out prompts, what
is recorded and assembled, refusals, concurrency, timeouts. No Ray, no vLLM."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from pathlib import Path

import openai
import pytest

from mrl.agent.call_log import CallRecord, assemble
from mrl.agent.openai_format import template_messages
from mrl.agent.openai_server import LocalServer, OpenAIEndpoint
from mrl.rollout.engine import Generation, SamplingSettings

# The chat tests' Qwen2.5-format template (ChatML, Hermes <tool_call>, <tool_response> in a user turn).
QWEN_TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "qwen2_5.jinja"
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
WAIT_S = 20  # every client call and every asyncio wait in these tests


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    from mrl.models.tiny import build_tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), eos_token="<|im_end|>", pad_token="<pad>")
    tok.chat_template = QWEN_TEMPLATE.read_text()
    return tok


@pytest.fixture(scope="module")
def renderer(tokenizer):
    from mrl.agent.chat import ChatRenderer

    return ChatRenderer(tokenizer)


class FakeEngine:
    """A generate handle whose answers follow the prompt's last turn: a question "what is A plus B?"
    gets a call of the add tool, a tool response gets "the answer is R."; one token per character
    (which tokenising the text again would merge), then <|im_end|>, cut at max_tokens; log-probs
    -0.01 * (i + 1); weight version 3. `peak`: the most calls it ran at once."""

    def __init__(self, tokenizer, delay_s: float = 0.0):
        self.tokenizer, self.delay_s, self.seen = tokenizer, delay_s, []
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.running = self.peak = 0

    def reply(self, prompt: str) -> str:
        last = prompt.rsplit("<|im_start|>", 2)[-2]
        if answer := re.search(r"<tool_response>\n(.*?)\n</tool_response>", last):
            return f"the answer is {answer.group(1)}."
        a, b = re.search(r"what is (\d+) plus (\d+)\?", last).groups()
        return '<tool_call>\n{"name": "add", "arguments": {"a": %s, "b": %s}}\n</tool_call>' % (a, b)

    async def __call__(self, prompt_ids: list[int], sampling: SamplingSettings) -> Generation:
        self.seen.append((list(prompt_ids), sampling))
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(self.delay_s)
        self.running -= 1
        reply = self.reply(self.tokenizer.decode(prompt_ids))
        ids = [i for char in reply for i in self.tokenizer.encode(char, add_special_tokens=False)]
        ids, finish = (ids + [self.end], "stop") if len(ids) < sampling.max_tokens else (
            ids[:sampling.max_tokens], "length")
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Generation(list(prompt_ids), ids, text, [-0.01 * (i + 1) for i in range(len(ids))], finish, 3,
                          [3] * len(ids))


@pytest.fixture
def serve(tokenizer, renderer):
    """serve(**endpoint options) -> (endpoint, engine, server), stopped after the test."""
    servers = []

    def start(delay_s: float = 0.0, **options):
        engine = FakeEngine(tokenizer, delay_s)
        options.setdefault("defaults", SamplingSettings(max_tokens=200))  # a tool call is ~60 tiny-BPE tokens
        endpoint = OpenAIEndpoint(engine, tokenizer, renderer=renderer, **options)
        servers.append(LocalServer(endpoint.app, timeout_s=WAIT_S).start())
        return endpoint, engine, servers[-1]

    yield start
    for server in servers:
        server.stop()


def client(server: LocalServer, episode: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url(episode), api_key="unused", max_retries=0, timeout=WAIT_S)


def question(a: int, b: int) -> list[dict]:
    return [{"role": "system", "content": "use the tools."}, {"role": "user", "content": f"what is {a} plus {b}?"}]


def run_tool_episode(api: openai.OpenAI, messages: list[dict], **sampling) -> list:
    """What an OpenAI agent does: ask, run the tool it is asked for, answer with the result."""
    first = api.chat.completions.create(model="any", messages=messages, tools=TOOLS, **sampling)
    reply = first.choices[0].message
    call = reply.tool_calls[0]
    args = json.loads(call.function.arguments)
    messages += [reply.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
    second = api.chat.completions.create(model="any", messages=messages, tools=TOOLS, **sampling)
    messages.append(second.choices[0].message.model_dump(exclude_none=True))
    return [first, second]


def test_models_lists_the_policy_over_connections_without_nagle(serve):
    _, _, server = serve(model_name="policy-x")
    assert [m.id for m in client(server, "e0").models.list().data] == ["policy-x"]
    # accepted connections get TCP_NODELAY from asyncio only from a listener of proto IPPROTO_TCP
    # (socket.create_server's is 0: every reply on a kept-alive connection then waited ~44 ms)
    assert server._socket.proto == socket.IPPROTO_TCP


def test_tool_episode_is_token_in_token_out_and_linear(serve, renderer):
    endpoint, engine, server = serve()
    messages = question(12, 30)
    first, second = run_tool_episode(client(server, "ep/1"), messages, temperature=0.7, top_p=0.9,
                                     max_completion_tokens=150, stop=["STOP"], seed=11, logprobs=True)
    assert first.choices[0].finish_reason == "tool_calls"
    assert first.choices[0].message.tool_calls[0].function.name == "add"
    assert second.choices[0].message.content == "the answer is 42."
    assert second.choices[0].finish_reason == "stop"
    calls = endpoint.log.calls("ep/1")
    tool_result = messages[3:4]
    assert calls[0].prompt_ids == renderer.prompt_ids(messages[:2], TOOLS)
    delta = renderer.append_ids(tool_result, TOOLS)
    assert calls[1].prompt_ids == calls[0].prompt_ids + calls[0].completion_ids + delta  # never re-tokenised
    assert calls[1].appended == len(delta)
    sampling = engine.seen[1][1]
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens, sampling.stop, sampling.seed) == (
        0.7, 0.9, 150, ("STOP",), 11)
    assert sampling.stop_token_ids == tuple(renderer.end_of_turn_ids())
    got = [t.logprob for t in second.choices[0].logprobs.content]
    assert got == pytest.approx(calls[1].logprobs) and second.usage.prompt_tokens == len(calls[1].prompt_ids)
    (trajectory,) = endpoint.assemble("ep/1")
    assert trajectory.linear and trajectory.calls == [0, 1]
    n0, n1 = len(calls[0].completion_ids), len(calls[1].completion_ids)
    assert trajectory.loss_mask == [1] * n0 + [0] * len(delta) + [1] * n1
    assert trajectory.logprobs == calls[0].logprobs + [0.0] * len(delta) + calls[1].logprobs
    assert trajectory.token_versions == [3] * (n0 + len(delta) + n1)
    renderer.check(template_messages(messages), trajectory.prompt_ids + trajectory.token_ids, TOOLS)  # the template's own text


def test_edited_history_is_rendered_afresh_and_not_linear(serve, renderer):
    endpoint, _, server = serve()
    chat = client(server, "edit").chat
    messages = question(1, 2)
    chat.completions.create(model="any", messages=messages, tools=TOOLS)
    edited = question(1, 2) + [{"role": "assistant", "content": "let me think."},
                               {"role": "user", "content": "what is 4 plus 5?"}]
    chat.completions.create(model="any", messages=edited, tools=TOOLS)
    calls = endpoint.log.calls("edit")
    assert calls[1].appended is None and "differs from call 0's reply" in calls[1].note
    assert calls[1].prompt_ids == renderer.prompt_ids(edited, TOOLS)
    first, second = endpoint.assemble("edit", pop=True)
    assert not first.linear and not second.linear and second.calls == [1] and "differs" in second.note
    assert first.loss_mask == [1] * len(first.token_ids)
    assert endpoint.log.episodes() == []


def test_tool_choice_none_leaves_the_calls_in_the_text(serve):
    _, _, server = serve()
    reply = client(server, "none").chat.completions.create(model="any", messages=question(2, 5), tools=TOOLS,
                                                           tool_choice="none").choices[0]
    assert reply.finish_reason == "stop" and not reply.message.tool_calls
    assert reply.message.content.startswith("<tool_call>")


def test_truncated_turn_is_closed_before_the_next_message(serve, renderer):
    endpoint, _, server = serve()
    chat = client(server, "cut").chat
    messages = question(7, 8)
    cut = chat.completions.create(model="any", messages=messages, tools=TOOLS, max_tokens=5)
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    messages += [{"role": "assistant", "content": cut.choices[0].message.content},
                 {"role": "user", "content": "what is 7 plus 8?"}]
    chat.completions.create(model="any", messages=messages, tools=TOOLS)
    calls = endpoint.log.calls("cut")
    close = renderer.end_of_turn_ids()
    assert calls[1].prompt_ids == (calls[0].prompt_ids + calls[0].completion_ids + close
                                   + renderer.append_ids(messages[3:], TOOLS))
    (trajectory,) = endpoint.assemble("cut")
    assert trajectory.loss_mask[5:5 + len(close)] == [0] * len(close)  # the closing token is not the policy's


def test_completions_continue_the_previous_text(serve, tokenizer):
    endpoint, _, server = serve()
    api = client(server, "text")
    prompt = "<|im_start|>user\nwhat is 2 plus 2?<|im_end|>\n<|im_start|>assistant\n"
    first = api.completions.create(model="any", prompt=prompt, logprobs=0, max_tokens=40)
    assert first.choices[0].logprobs.token_logprobs == pytest.approx(endpoint.log.calls("text")[0].logprobs)
    follow = prompt + first.choices[0].text + "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
    api.completions.create(model="any", prompt=follow + "<|im_start|>assistant\n")
    calls = endpoint.log.calls("text")
    head = calls[0].prompt_ids + calls[0].completion_ids
    assert calls[1].prompt_ids[:len(head)] == head and endpoint.assemble("text")[0].linear
    assert calls[1].prompt_ids[len(head):] == tokenizer.encode(
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


REFUSED = [
    (dict(stream=True), "stream=true"),
    (dict(n=2), "n=2: this endpoint samples one choice per call"),
    (dict(tool_choice="required"), "tool_choice='required'"),
    (dict(logprobs=True, top_logprobs=1), "top_logprobs=1"),
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(messages=[]), "messages must be a non-empty list"),
]


def test_unsupported_requests_are_refused_by_name(serve):
    endpoint, engine, server = serve()
    for request, message in REFUSED:
        with pytest.raises(openai.BadRequestError, match=re.escape(message)):
            client(server, "bad").chat.completions.create(**{"model": "any", "messages": question(1, 1), **request})
    assert engine.seen == [] and endpoint.log.episodes() == []


def test_a_slow_engine_fails_the_call_with_who_waited(serve):
    _, _, server = serve(delay_s=2.0, generate_timeout_s=0.2)
    with pytest.raises(openai.InternalServerError, match="waited 0 s for the generate handle on call 0"):
        client(server, "slow").chat.completions.create(model="any", messages=question(1, 1))


def test_default_seed_gives_each_call_its_own(serve):
    runs = []
    for _ in range(2):
        _, engine, server = serve(defaults=SamplingSettings(seed=5, max_tokens=200))
        for episode in ("a", "b", "a"):
            client(server, episode).chat.completions.create(model="any", messages=question(1, 1))
        runs.append([sampling.seed for _, sampling in engine.seen])
    assert runs[0] == runs[1] and len(set(runs[0])) == 3 and None not in runs[0]  # from (seed, episode, call)


def test_concurrent_episodes_stay_apart(serve, renderer):
    endpoint, engine, server = serve(delay_s=0.02)

    async def episode(i: int) -> list[dict]:
        chat = openai.AsyncOpenAI(base_url=server.base_url(f"c{i}"), api_key="unused", max_retries=0, timeout=WAIT_S)
        messages = question(i, 100)
        reply = (await chat.chat.completions.create(model="any", messages=messages, tools=TOOLS)).choices[0].message
        # The reply object itself goes back, as many agents send it.
        messages += [reply, {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": str(i + 100)}]
        answer = await chat.chat.completions.create(model="any", messages=messages, tools=TOOLS)
        await chat.close()
        messages.append(answer.choices[0].message)
        return [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]

    async def all_episodes() -> list[list[dict]]:
        return await asyncio.wait_for(asyncio.gather(*(episode(i) for i in range(8))), WAIT_S)

    conversations = asyncio.run(all_episodes())
    assert engine.peak > 1  # the episodes' calls overlapped
    for i, messages in enumerate(conversations):
        assert messages[-1]["content"] == f"the answer is {i + 100}."
        (trajectory,) = endpoint.assemble(f"c{i}")
        assert trajectory.linear and trajectory.calls == [0, 1]
        renderer.check(template_messages(messages), trajectory.prompt_ids + trajectory.token_ids, TOOLS)


def _call(prompt: list[int], completion: list[int], version: int) -> CallRecord:
    return CallRecord("chat", prompt, completion, [-0.5] * len(completion), [version] * len(completion), "stop",
                      "", 0.0, None)


def test_assemble_cuts_an_episode_into_runs():
    calls = [_call([1, 2], [3], 0), _call([1, 2, 3, 9], [4, 5], 1), _call([7], [8], 2), _call([7, 8], [6], 2)]
    first, second = assemble(calls)
    assert (first.calls, second.calls) == ([0, 1], [2, 3]) and not first.linear
    assert first.token_ids == [3, 9, 4, 5] and first.loss_mask == [1, 0, 1, 1]
    assert first.logprobs == [-0.5, 0.0, -0.5, -0.5] and first.token_versions == [0, 0, 1, 1]
    assert "call 2's prompt does not extend call 1's" in second.note
    (only,) = assemble(calls[:2])
    assert only.linear
