"""The OpenAI wire format for openai_server.py: what it refuses, when a chat call continues the
previous one, messages as chat templates expect them, and the response objects."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from typing import Any


class BadRequest(ValueError):
    """A request the endpoint refuses: answered with HTTP 400 and this message."""


class EpisodeNotOpen(LookupError):
    """A call of an episode that is not open: answered with HTTP 404 and this message."""


@dataclass(frozen=True)
class ChatContext:
    """What a chat call was sent and answered, to tell whether the next call continues it."""

    messages: list[dict]
    tools: list[dict] | None
    reply: dict


def refuse_unsupported(body: dict, chat: bool) -> None:
    """Refuse, naming the field and the fix, what mrl's engine settings cannot honour."""
    if body.get("stream"):
        raise BadRequest("stream=true: this endpoint answers with whole responses only; leave stream out")
    for key in ("n", "best_of"):
        if body.get(key) not in (None, 1):
            raise BadRequest(f"{key}={body[key]}: this endpoint samples one choice per call; make "
                             f"{body[key]} calls instead (each is recorded)")
    for key in ("presence_penalty", "frequency_penalty", "logit_bias", "echo", "suffix"):
        if body.get(key) not in (None, 0, 0.0, {}, False, ""):
            raise BadRequest(f"{key}: not supported by mrl's sampling settings; leave it out")
    format_ = body.get("response_format")
    if isinstance(format_, dict) and format_.get("type") not in (None, "text"):
        raise BadRequest(f"response_format {format_.get('type')!r}: no constrained decoding here; leave it out")
    top = body.get("top_logprobs") if chat else body.get("logprobs")
    if isinstance(top, (int, float)) and not isinstance(top, bool) and top > 0:
        raise BadRequest(f"{'top_logprobs' if chat else 'logprobs'}={top}: the engine returns only the sampled "
                         "token's log-probability; ask for it with " + ("logprobs=true" if chat else "logprobs=0"))
    if chat and body.get("tool_choice") not in (None, "auto", "none"):
        raise BadRequest(f"tool_choice={body['tool_choice']!r}: only 'auto' and 'none' are supported "
                         "(no constrained decoding)")


def text_of(content: Any) -> str:
    """A message's content as text: None, a string, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p.get("text", "") for p in content)
    raise BadRequest(f"message content {str(content)[:80]!r}: only text (a string or text parts) is supported")


def _arguments(arguments: Any) -> Any:
    """Tool-call arguments as the dict a chat template renders (OpenAI sends a JSON string)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _key(message: Any) -> tuple:
    """What makes two messages the same turn: role, text, tool calls (name + arguments, ids aside)."""
    if not isinstance(message, dict):
        raise BadRequest(f"message {str(message)[:80]!r} is not an object with a role and a content")
    calls = tuple((c.get("function", {}).get("name"), json.dumps(_arguments(c.get("function", {}).get("arguments")),
                                                                 sort_keys=True))
                  for c in message.get("tool_calls") or ())
    return message.get("role"), text_of(message.get("content")), calls, message.get("tool_call_id")


def appended_messages(last: Any, messages: list[dict], tools: list[dict] | None,
                      index: int) -> tuple[list[dict] | None, str]:
    """The messages this call appends to the previous call's messages + reply, or None and why not."""
    context = last.context
    if not isinstance(context, ChatContext):
        return None, f"call {index - 1} was a completions call, call {index} a chat call"
    if json.dumps(tools, sort_keys=True) != json.dumps(context.tools, sort_keys=True):
        return None, f"call {index}'s tools differ from call {index - 1}'s"
    head = context.messages + [context.reply]
    if len(messages) <= len(head):
        return None, (f"call {index} sends {len(messages)} messages: not call {index - 1}'s "
                      f"{len(context.messages)} and its reply followed by new ones")
    for i, (sent, before) in enumerate(zip(messages, head)):
        if _key(sent) != _key(before):
            what = f"call {index - 1}'s reply" if i == len(context.messages) else f"message {i} of call {index - 1}"
            return None, f"call {index}'s message {i} differs from {what}"
    new = messages[len(head):]
    if any(m.get("role") == "assistant" for m in new):
        return None, f"call {index} appends an assistant message the model did not generate"
    return new, ""


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: text content, tool-call arguments as dicts."""
    out = []
    for message in messages:
        message = {**message, "content": text_of(message.get("content"))}
        if message.get("tool_calls"):
            message["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"].get(
                "arguments"))}} for c in message["tool_calls"]]
        out.append(message)
    return out


# Where a family's tool calls start in a turn: the text before is the reply's content (as vLLM's
# tool parsers return it). Llama 3's calls are the whole turn.
_CALLS_START = {"qwen": "<tool_call>", "hermes": "<tool_call>", "chatml": "<tool_call>",
                "deepseek_v3": "<｜tool▁calls▁begin｜>"}


def assistant_reply(text: str, calls: list, family: str) -> dict:
    """The assistant message for a turn's text and its parsed tool calls (mrl.agent.tool_calls)."""
    if not calls:
        return {"role": "assistant", "content": text}
    start = _CALLS_START.get(family)
    content = text.split(start, 1)[0].rstrip() if start else ""
    return {"role": "assistant", "content": content or None, "tool_calls": [c.to_openai() for c in calls]}


def _finish(record: Any, tool_calls: bool) -> str:
    if record.finish_reason == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def _usage(record: Any) -> dict:
    prompt, completion = len(record.prompt_ids), len(record.completion_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_response(endpoint: Any, episode_id: str, index: int, record: Any, reply: dict, logprobs: bool) -> dict:
    choice: dict[str, Any] = {"index": 0, "message": reply, "logprobs": None,
                              "finish_reason": _finish(record, bool(reply.get("tool_calls")))}
    if logprobs:
        tokens = endpoint.decode_each(record.completion_ids)
        choice["logprobs"] = {"content": [
            {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
            for tok, lp in zip(tokens, record.logprobs)]}
    return {"id": f"chatcmpl-{episode_id}-{index}", "object": "chat.completion", "created": int(time.time()),
            "model": endpoint.model_name, "choices": [choice], "usage": _usage(record)}


def completion_response(endpoint: Any, episode_id: str, index: int, record: Any, logprobs: bool) -> dict:
    choice: dict[str, Any] = {"index": 0, "text": record.text, "logprobs": None,
                              "finish_reason": _finish(record, False)}
    if logprobs:
        tokens = endpoint.decode_each(record.completion_ids)
        offsets = [0, *itertools.accumulate(len(t) for t in tokens)][:-1]  # from the completion's start
        choice["logprobs"] = {"tokens": tokens, "token_logprobs": list(record.logprobs), "top_logprobs": None,
                              "text_offset": offsets}
    return {"id": f"cmpl-{episode_id}-{index}", "object": "text_completion", "created": int(time.time()),
            "model": endpoint.model_name, "choices": [choice], "usage": _usage(record)}
