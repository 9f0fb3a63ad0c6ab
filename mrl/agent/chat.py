"""A model's chat template as token deltas: token-in/token-out for multi-turn episodes.

An episode's tokens are the first prompt (`prompt_ids`), then per turn the model's generated ids exactly
as the engine returned them, then `append_ids(new messages)`: the tool results, user or environment
turns and the next generation prompt, rendered with the model's own template and tokenised alone. The
model's tokens are never re-tokenised (a re-tokenised turn can split differently from what the engine
sampled), and a turn's cost does not grow with the history.
The delta is cut from a short stand-in conversation rendered with and without the new messages; a
template that re-renders earlier turns when the conversation grows is refused, naming where it did.
`check` compares a finished conversation's full template render with the decoded trajectory. Reasoning
that a template drops from earlier turns (Qwen3: <think> before the last user query) stays in the
trajectory, since it is what the model saw and generated; `check` therefore renders every assistant turn
but the last as generated (see `check`).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

# The text that closes an assistant turn in each family: the token the engine should stop on.
FAMILIES: dict[str, str] = {
    "qwen": "<|im_end|>",  # ChatML with Hermes <tool_call> JSON (Qwen2.5, Qwen3)
    "chatml": "<|im_end|>",  # plain ChatML (the tiny zoo's template)
    "deepseek_v3": "<｜end▁of▁sentence｜>",
    "llama3": "<|eot_id|>",
}
APPENDABLE_ROLES = ("tool", "user", "system", "ipython")
# The stand-in conversation: a user turn, then an assistant turn whose text is this placeholder.
_CONTEXT = [{"role": "user", "content": "Hi."}]
_PLACEHOLDER = "MRL-PLACEHOLDER-TURN"
# Reasoning tags swapped for private-use text while `check` renders earlier assistant turns, so a
# template that drops <think> blocks sees none and renders those turns as the model generated them.
_HIDDEN_TAGS = {"<think>": "\ue000think\ue001", "</think>": "\ue000/think\ue001"}
# Fast tokenizers raise "Already borrowed" when one Rust tokenizer is used from two threads at once,
# and the *_async methods run in threads: every encode and decode here takes this lock.
TOKENIZER_LOCK = threading.Lock()


def detect_family(template: str) -> str:
    """The family of a chat template, from the special tokens it writes."""
    if "<｜end▁of▁sentence｜>" in template or "<｜Assistant｜>" in template:
        return "deepseek_v3"
    if "<|start_header_id|>" in template and "<|eot_id|>" in template:
        return "llama3"
    if "<|im_start|>" in template:
        return "qwen" if "<tool_call>" in template else "chatml"
    raise ValueError(f"cannot tell this chat template's family from its tokens (known: {', '.join(FAMILIES)}); "
                     "pass ChatRenderer(tokenizer, family=...) for a template that writes one of their formats")


class ChatRenderer:
    """A model's chat template as token deltas: tokens the model generated are never re-tokenised.

    `template_kwargs` go to every render (e.g. {"enable_thinking": True} for Qwen3)."""

    def __init__(self, tokenizer: Any, family: str | None = None, template_kwargs: dict | None = None):
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise ValueError("the tokenizer has no chat_template (a string); load a tokenizer whose "
                             "tokenizer_config.json has one, or set tokenizer.chat_template")
        self.family = family or detect_family(template)
        if self.family not in FAMILIES:
            raise ValueError(f"unknown chat family {self.family!r}; use one of {', '.join(FAMILIES)}")
        self.tokenizer, self.template_kwargs = tokenizer, dict(template_kwargs or {})
        self.end_of_turn = FAMILIES[self.family]
        self._end_ids = self._encode(self.end_of_turn)
        if len(self._end_ids) != 1:
            raise ValueError(f"the tokenizer has no single token {self.end_of_turn!r}, which ends a {self.family} "
                             f"assistant turn (it encodes to {self._end_ids}); is family={self.family!r} right?")
        self._turn_tail = self._after_turn(self._render([*_CONTEXT, _placeholder_turn()], None, False), "")

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The first prompt: messages rendered with the generation prompt, tokenised."""
        return self._encode(self._render(messages, tools, True))

    def append_ids(self, messages: list[dict], tools: list[dict] | None = None, *,
                   truncated: bool = False) -> list[int]:
        """Tokens to append after the model's last turn to add `messages` (role tool / user / system)
        and the next generation prompt, boundary tokens included (ChatML's "\\n" after <|im_end|>).

        The model's turn must end with `end_of_turn_ids()` as generated; `truncated=True` (it stopped
        without one: max tokens, a stop string) puts that token first so the text matches the template."""
        ids = self._encode(self.append_text(messages, tools))
        return self.end_of_turn_ids() + ids if truncated else ids

    async def prompt_ids_async(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """`prompt_ids` in a worker thread, so an episode's tokenising never blocks the event loop."""
        return await asyncio.to_thread(self.prompt_ids, messages, tools)

    async def append_ids_async(self, messages: list[dict], tools: list[dict] | None = None, *,
                               truncated: bool = False) -> list[int]:
        """`append_ids` in a worker thread, so an episode's tokenising never blocks the event loop."""
        return await asyncio.to_thread(self.append_ids, messages, tools, truncated=truncated)

    def end_of_turn_ids(self) -> list[int]:
        """The token that closes an assistant turn (the engine's stop token for this template)."""
        return list(self._end_ids)

    def append_text(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The text `append_ids` tokenises: what the template writes after an assistant turn's
        end-of-turn token to add `messages` and the next generation prompt."""
        _check_appendable(messages)
        opening = self._render(_CONTEXT, tools, True)
        full = self._render([*_CONTEXT, _placeholder_turn(), *messages], tools, True)
        start = full.find(_PLACEHOLDER)
        if start < 0 or full[:start] != opening:
            at = _first_difference(opening, full)
            roles = ", ".join(str(m.get("role")) for m in messages)
            raise ValueError(
                f"the {self.family} chat template is not prefix-stable for appended {roles} message(s): the "
                f"conversation before the model's turn renders differently once they follow it (character {at}: "
                f"{opening[at:at + 40]!r} became {full[at:at + 40]!r}), so their tokens cannot be appended "
                "token-in/token-out; append other roles (e.g. user instead of a mid-episode system message)")
        return self._after_turn(full, f" for appended {', '.join(str(m.get('role')) for m in messages)}")

    def check(self, messages: list[dict], token_ids: list[int], tools: list[dict] | None = None) -> None:
        """Raise ValueError naming the first differing character/token when the full template render
        of `messages` differs from the decoded `token_ids`.

        What is compared: the template's render of the whole conversation, with every assistant turn
        but the last one rendered as the model generated it: its <think> tags are hidden from the
        template, so a template that drops earlier reasoning (Qwen3) does not, since token-in/token-out
        kept it in every later prompt. The last turn renders as the template renders it. A conversation
        ending with an assistant turn may end where the model stopped: after its end-of-turn token
        (the template's boundary after it is not required) or before it (truncated).
        Give assistant turns the text the model generated as content, tool calls left in it: structured
        `tool_calls` are re-rendered by the template (Qwen's writes "\\n" before a call whenever text,
        a hidden reasoning block included, precedes it, which a reasoning-then-call turn did not have)."""
        if not messages:
            raise ValueError("check needs the conversation's messages; got none")
        ends_with_model = messages[-1].get("role") == "assistant"
        expected = self._render(_hide_reasoning(messages), tools, not ends_with_model)
        for tag, hidden in _HIDDEN_TAGS.items():
            expected = expected.replace(hidden, tag)
        actual = self._decode(token_ids)
        if actual == expected:
            return
        if ends_with_model and any(expected == actual + tail for tail in
                                   (self._turn_tail, self.end_of_turn + self._turn_tail)):
            return
        at = _first_difference(expected, actual)
        token = self._token_at(token_ids, at)
        where = (f"token {token} (id {token_ids[token]} {self._decode(token_ids[token:token + 1])!r})"
                 if token < len(token_ids) else f"the end of its {len(token_ids)} tokens")
        raise ValueError(
            f"the {self.family} chat template's render and the trajectory differ at character {at}, {where}: "
            f"the template writes {expected[max(0, at - 20):at + 40]!r}, the trajectory "
            f"{actual[max(0, at - 20):at + 40]!r}")

    def _render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                                  tokenize=False, **self.template_kwargs)

    def _after_turn(self, rendered: str, context: str) -> str:
        """What `rendered` has after the placeholder turn's end-of-turn token."""
        start = rendered.find(_PLACEHOLDER)
        end = rendered.find(self.end_of_turn, start + len(_PLACEHOLDER)) if start >= 0 else -1
        if end < 0:
            raise ValueError(f"the {self.family} chat template wrote no {self.end_of_turn!r} after an assistant "
                             f"turn{context}; is family={self.family!r} right for this template?")
        return rendered[end + len(self.end_of_turn):]

    def _encode(self, text: str) -> list[int]:
        # No special tokens added: the template writes its own (Llama's <|begin_of_text|>).
        with TOKENIZER_LOCK:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def turn_text(self, token_ids: list[int]) -> str:
        """A generated turn's text as the engine writes it (vLLM skips special tokens)."""
        with TOKENIZER_LOCK:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def whole_turn(self, before: list[int], token_ids: list[int], stop: tuple[str, ...],
                   stop_terminated: bool) -> Any:
        """A turn cut by a weight push and gone on, as vLLM would have made it uncut: its text and
        the stop string (`stop`: the sampling's) that ends it, even one spanning the cut, with the
        tokens kept (mrl.rollout.detokenize.SampleText). `before`: the context before the turn."""
        from mrl.rollout.detokenize import Detokenizer, SampleText

        if not stop:  # (no stop string to find: the fast tokenizer's plain decode)
            return SampleText(self.turn_text(token_ids), len(token_ids), None)
        with TOKENIZER_LOCK:
            return Detokenizer(self.tokenizer, stop)(before, token_ids, stop_terminated)

    def continuation_stop(self, context: list[int], stop: tuple[str, ...]) -> tuple[str, ...]:
        """The stop strings to give the engine for a cut turn going on from `context` (none when the
        cut split a character: Detokenizer.continuation_stop)."""
        from mrl.rollout.detokenize import Detokenizer

        with TOKENIZER_LOCK:
            return Detokenizer(self.tokenizer, stop).continuation_stop(context) if stop else ()

    def _decode(self, token_ids: list[int]) -> str:
        with TOKENIZER_LOCK:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)

    def _token_at(self, token_ids: list[int], char: int) -> int:
        """The index of the token whose text covers character `char` of the decoded ids (bisection)."""
        low, high = 0, len(token_ids)
        while low < high:
            middle = (low + high) // 2
            if len(self._decode(token_ids[:middle + 1])) > char:
                high = middle
            else:
                low = middle + 1
        return low


def _placeholder_turn() -> dict:
    return {"role": "assistant", "content": _PLACEHOLDER}


def _check_appendable(messages: list[dict]) -> None:
    if not messages:
        raise ValueError("append_ids needs at least one message (a tool result, user or system turn)")
    for message in messages:
        if message.get("role") not in APPENDABLE_ROLES:
            raise ValueError(f"append_ids takes roles {', '.join(APPENDABLE_ROLES)}, got {message.get('role')!r}: "
                             "the model's own turn is its generated token ids, appended as they are")


def _hide_reasoning(messages: list[dict]) -> list[dict]:
    """`messages` with the reasoning tags of every assistant turn but the last message swapped out."""
    hidden = []
    for index, message in enumerate(messages):
        content = message.get("content")
        if message.get("role") == "assistant" and isinstance(content, str) and index < len(messages) - 1:
            for tag, stand_in in _HIDDEN_TAGS.items():
                content = content.replace(tag, stand_in)
            message = {**message, "content": content}
        hidden.append(message)
    return hidden


def _first_difference(a: str, b: str) -> int:
    """The first index where a and b differ (the shorter one's length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
