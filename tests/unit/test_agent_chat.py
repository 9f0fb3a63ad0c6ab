"""ChatRenderer (mrl/agent/chat.py): trajectories built token-in/token-out, as an agent loop builds them,
equal the full chat template render for every family. Templates: the tiny zoo's ChatML and the fixtures
under tests/fixtures/chat_templates; tokenizers: the zoo's BPE with each family's special tokens."""

import asyncio
import functools
import json
import threading
from pathlib import Path

import pytest

from mrl.agent.chat import FAMILIES, ChatRenderer, detect_family

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
DEEPSEEK_TOOL_TOKENS = [f"<｜{name}｜>" for name in (
    "tool▁calls▁begin", "tool▁calls▁end", "tool▁call▁begin", "tool▁call▁end", "tool▁sep",
    "tool▁outputs▁begin", "tool▁outputs▁end", "tool▁output▁begin", "tool▁output▁end")]
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
# Per template: its family, the special tokens its tokenizer carries (beyond the zoo's), tokens added
# as plain text pieces, and the bos token the template writes.
SPECS = {
    "chatml": dict(family="chatml", special=[], added=[], bos="<s>"),
    "qwen2_5": dict(family="qwen", special=["<|endoftext|>"], added=QWEN_ADDED, bos="<s>"),
    "qwen3": dict(family="qwen", special=["<|endoftext|>"], added=QWEN_ADDED, bos="<s>"),
    "llama3": dict(family="llama3", special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                             "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"],
                   added=[], bos="<|begin_of_text|>"),
    "deepseek_v3": dict(family="deepseek_v3", special=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                                                       "<｜Assistant｜>", *DEEPSEEK_TOOL_TOKENS],
                        added=["<think>", "</think>"], bos="<｜begin▁of▁sentence｜>"),
}
NAMES = list(SPECS)
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
ARGUMENTS = {"expression": "12*34"}
CALL = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": ARGUMENTS}}
RESULT = {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "408"}
PREAMBLE = "I will use the calculator."  # text the model writes before its call (not in Llama 3's format)


def turn(name: str, text: str) -> str:
    """A turn's text as the model writes it: Qwen3 (thinking mode) always opens with a <think> block."""
    return text if name != "qwen3" or "<think>" in text else f"<think>\n\n</think>\n\n{text}"


def emitted_call(name: str, arguments: tuple[dict, ...] = (ARGUMENTS,), preamble: str = PREAMBLE) -> str:
    """What a model of this template's family generates to call the calculator with each of `arguments`."""
    if name == "llama3":
        return f'{{"name": "calculator", "parameters": {json.dumps(arguments[0])}}}'
    if name == "deepseek_v3":
        calls = "\n".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n{json.dumps(args)}\n```"
                          "<｜tool▁call▁end｜>" for args in arguments)
        return f"{preamble}<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>"
    calls = "\n".join(f'<tool_call>\n{{"name": "calculator", "arguments": {json.dumps(args)}}}\n</tool_call>'
                      for args in arguments)
    return f"{preamble}\n{calls}" if preamble else calls


def call_message(name: str) -> dict:
    """The model's tool-calling turn as an agent loop records it (the zoo's ChatML knows no tool_calls)."""
    if name == "chatml":
        return {"role": "assistant", "content": emitted_call(name)}
    return {"role": "assistant", "content": "" if name == "llama3" else turn(name, PREAMBLE), "tool_calls": [CALL]}


@functools.cache
def _zoo_tokenizer():
    from mrl.models.tiny import build_tokenizer

    return build_tokenizer()


@functools.cache
def tokenizer(name: str):
    """The zoo's BPE carrying this family's special tokens, with the template; built once per session."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    from mrl.models.tiny import _CHAT_TEMPLATE

    spec = SPECS[name]
    backend = Tokenizer.from_str(_zoo_tokenizer().to_str())
    backend.add_special_tokens(spec["special"])
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in spec["added"]])
    template = _CHAT_TEMPLATE if name == "chatml" else (TEMPLATES / f"{name}.jinja").read_text()
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, bos_token=spec["bos"],
                                   eos_token=FAMILIES[spec["family"]])


def renderer(name: str, **kwargs) -> ChatRenderer:
    return ChatRenderer(tokenizer(name), **kwargs)


def generate(chat: ChatRenderer, text: str, truncated: bool = False) -> list[int]:
    """Stand-in for the engine: a turn's tokens as the model emits them, ending with its stop token."""
    ids = chat.tokenizer.encode(text, add_special_tokens=False)
    return ids if truncated else ids + chat.end_of_turn_ids()


@pytest.mark.parametrize("name", NAMES)
def test_template_family_is_detected(name):
    assert detect_family(tokenizer(name).chat_template) == SPECS[name]["family"]
    assert renderer(name).family == SPECS[name]["family"]


@pytest.mark.parametrize("name", NAMES)
def test_tool_episode_equals_template_render(name):
    chat = renderer(name)
    messages = [{"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": "What is 12*34?"}]
    trajectory = chat.prompt_ids(messages, TOOLS)
    trajectory += generate(chat, turn(name, emitted_call(name)))
    messages.append(call_message(name))
    trajectory += chat.append_ids([RESULT], TOOLS)
    messages.append(RESULT)
    trajectory += generate(chat, turn(name, "12*34 = 408."))
    messages.append({"role": "assistant", "content": turn(name, "12*34 = 408.")})
    chat.check(messages, trajectory, TOOLS)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_two_tool_results_in_one_append(name):
    """Templates group consecutive tool results (one user turn, one outputs block): append them together."""
    chat = renderer(name)
    calls = turn(name, emitted_call(name, (ARGUMENTS, {"expression": "1+1"}), preamble=""))
    results = [RESULT, {**RESULT, "tool_call_id": "call_1", "content": "2"}]
    messages = [{"role": "user", "content": "What are 12*34 and 1+1?"}, {"role": "assistant", "content": calls},
                *results, {"role": "assistant", "content": turn(name, "408 and 2.")}]
    trajectory = chat.prompt_ids(messages[:1], TOOLS) + generate(chat, calls)
    trajectory += chat.append_ids(results, TOOLS) + generate(chat, turn(name, "408 and 2."))
    chat.check(messages, trajectory, TOOLS)


def reasoning_episode(chat: ChatRenderer, name: str) -> tuple[list[dict], list[int]]:
    """Two user queries, every assistant turn reasoning first; turns kept as raw generated text."""
    turns = [f"<think>\nI need a tool.\n</think>\n\n{emitted_call(name)}",
             "<think>\nThe tool said 408.\n</think>\n\n12*34 = 408.",
             "<think>\n408 + 1 = 409.\n</think>\n\n409."]
    messages = [{"role": "user", "content": "What is 12*34?"}]
    trajectory = chat.prompt_ids(messages, TOOLS)
    for text, appended in zip(turns, ([RESULT], [{"role": "user", "content": "And plus one?"}], [])):
        trajectory += generate(chat, text)
        messages.append({"role": "assistant", "content": text})
        if appended:
            trajectory += chat.append_ids(appended, TOOLS)
            messages += appended
    return messages, trajectory


@pytest.mark.parametrize("name", NAMES)
def test_reasoning_episode_equals_template_render(name):
    chat = renderer(name)
    messages, trajectory = reasoning_episode(chat, name)
    chat.check(messages, trajectory, TOOLS)
    assert chat.tokenizer.decode(trajectory).count("<think>") == 3  # every turn's reasoning stays trained on


def test_qwen3_drops_earlier_reasoning_but_check_keeps_it():
    """Qwen3's template drops <think> before the last user query; the trajectory keeps it (the model saw
    it in every later prompt), so `check` renders earlier turns as generated and passes."""
    chat = renderer("qwen3")
    messages, trajectory = reasoning_episode(chat, "qwen3")
    plain = chat.tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert "I need a tool." not in plain and "The tool said 408." not in plain and "408 + 1 = 409." in plain
    chat.check(messages, trajectory, TOOLS)


@pytest.mark.parametrize("name", NAMES)
def test_truncated_turns_are_closed(name):
    chat = renderer(name)
    first, last = turn(name, "one two three"), turn(name, "four five")
    messages = [{"role": "user", "content": "Count to ten."}, {"role": "assistant", "content": first},
                {"role": "user", "content": "Go on."}, {"role": "assistant", "content": last}]
    prompt = chat.prompt_ids(messages[:1])
    first = generate(chat, first, truncated=True)  # hit max tokens: no end-of-turn token
    closed = chat.append_ids(messages[2:3], truncated=True)
    assert closed[:1] == chat.end_of_turn_ids()
    last = generate(chat, last, truncated=True)  # the episode ends truncated too
    chat.check(messages, prompt + first + closed + last)
    with pytest.raises(ValueError, match="differ at character"):  # the same without the closing token
        chat.check(messages, prompt + first + closed[1:] + last)


@pytest.mark.parametrize(("name", "boundary"), [
    ("chatml", "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"),
    ("qwen3", "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    ("llama3", "<|start_header_id|>ipython<|end_header_id|>\n\n408<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("deepseek_v3", "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>408<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"),
])
def test_append_text_starts_after_the_end_of_turn_token(name, boundary):
    """The separator a template writes after an assistant's end token (ChatML "\\n") is in the delta."""
    chat = renderer(name)
    assert chat.append_text([RESULT], TOOLS) == boundary
    assert chat.tokenizer.decode(chat.append_ids([RESULT], TOOLS)) == boundary


def test_generated_tokens_are_not_retokenised():
    chat = renderer("chatml")
    vocab = chat.tokenizer.get_vocab()
    generated = [vocab[c] for c in "the"] + chat.end_of_turn_ids()  # sampled one letter at a time
    assert chat.tokenizer.encode("the", add_special_tokens=False) != generated[:3]  # a re-tokeniser merges them
    messages = [{"role": "user", "content": "Say the."}]
    prompt = chat.prompt_ids(messages)
    trajectory = prompt + generated + chat.append_ids([RESULT])
    chat.check([*messages, {"role": "assistant", "content": "the"}, RESULT], trajectory)
    assert trajectory[len(prompt):len(prompt) + len(generated)] == generated
    assert chat.tokenizer.encode(chat.tokenizer.decode(trajectory), add_special_tokens=False) != trajectory


def test_check_names_the_first_difference():
    chat = renderer("qwen3")
    messages = [{"role": "user", "content": "What is 12*34?"}]
    prompt = chat.prompt_ids(messages)
    answer = "<think>\nEasy.\n</think>\n\n408"
    trajectory = prompt + generate(chat, answer)
    chat.check([*messages, {"role": "assistant", "content": answer}], trajectory)
    wrong = generate(chat, answer.replace("408", "409"))
    text = chat.tokenizer.decode(prompt + wrong)
    at = text.index("409") + 2
    token = len(prompt) + len(chat.tokenizer.encode(answer[:answer.index("408") + 2], add_special_tokens=False))
    with pytest.raises(ValueError, match=rf"differ at character {at}, token {token} \(id \d+ '9'\)"):
        chat.check([*messages, {"role": "assistant", "content": answer}], prompt + wrong)


def test_template_that_moves_system_messages_is_refused():
    with pytest.raises(ValueError, match=r"deepseek_v3 chat template is not prefix-stable for appended system"):
        renderer("deepseek_v3").append_ids([{"role": "system", "content": "Be brief."}])


def test_qwen3_without_thinking_is_refused():
    """enable_thinking=False puts an empty <think> block in each generation prompt that the template
    leaves out of earlier turns: the render of the history changes, so no delta is exact."""
    with pytest.raises(ValueError, match=r"qwen chat template is not prefix-stable for appended tool"):
        renderer("qwen3", template_kwargs={"enable_thinking": False}).append_ids([RESULT])


def test_bad_input_is_named():
    chat = renderer("qwen3")
    with pytest.raises(ValueError, match="the model's own turn is its generated token ids"):
        chat.append_ids([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ValueError, match="at least one message"):
        chat.append_ids([])
    with pytest.raises(ValueError, match="unknown chat family 'mistral'"):
        renderer("qwen3", family="mistral")
    with pytest.raises(ValueError, match="no single token '<｜end▁of▁sentence｜>'"):
        renderer("qwen3", family="deepseek_v3")
    with pytest.raises(ValueError, match="cannot tell this chat template's family"):
        detect_family("{{ messages[0].content }}")


def test_async_variants_tokenise_off_the_event_loop():
    chat = renderer("llama3")
    threads = []
    original = chat.append_text

    def recording(*args, **kwargs):
        threads.append(threading.get_ident())
        return original(*args, **kwargs)

    chat.append_text = recording

    async def episode():
        prompt = await chat.prompt_ids_async([{"role": "user", "content": "Hi"}], TOOLS)
        return prompt, await chat.append_ids_async([RESULT], TOOLS, truncated=True)

    prompt, appended = asyncio.run(episode())
    assert prompt == chat.prompt_ids([{"role": "user", "content": "Hi"}], TOOLS)
    assert appended == chat.end_of_turn_ids() + chat.append_ids([RESULT], TOOLS)
    assert threads[0] != threading.get_ident()
