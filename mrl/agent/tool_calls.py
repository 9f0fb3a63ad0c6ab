"""The tool calls in a model's turn, per chat-template family, and their checks against the schemas.

A malformed call (bad JSON, no name, an unknown tool, arguments that do not match the tool's
schema) never raises: it becomes one error message for the model, and the caller counts them.
Formats: "qwen" (also "hermes", "chatml"): <tool_call>{"name", "arguments"}</tool_call>, several per
turn; "deepseek_v3": <｜tool▁call▁begin｜>function<｜tool▁sep｜>name ```json {...}```<｜tool▁call▁end｜>
(the V3.1 form name<｜tool▁sep｜>{...} too); "llama3": the turn is one or more JSON objects
{"name", "parameters"} separated by ";" (after an optional <|python_tag|>); Llama's built-in
python-call syntax (brave_search.call(...)) is not parsed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

FAMILIES = ("qwen", "hermes", "chatml", "deepseek_v3", "llama3")

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_DSV3_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
_DSV3_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)(<｜tool▁call▁end｜>|$)", re.DOTALL)
_JSON_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
_LLAMA_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name, its arguments (a JSON object) and an id that the
    tool's answer refers to (OpenAI's tool_call_id)."""

    name: str
    arguments: dict = field(default_factory=dict)
    id: str = "call_0"

    def to_openai(self) -> dict:
        """The call as an OpenAI assistant message's tool_calls entry (arguments as a JSON string)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


def parse_tool_calls(text: str, family: str = "qwen", schemas: Iterable[dict] | None = None,
                     id_prefix: str = "call_") -> tuple[list[ToolCall], list[str]]:
    """The calls in a model turn's text, and one error message per malformed call (for the model).

    With `schemas` (OpenAI function schemas) each call's name and arguments are checked too. Ids are
    `id_prefix` + the call's index in the turn: pass a per-turn prefix to keep an episode's ids unique.
    """
    if family in ("qwen", "hermes", "chatml"):
        raw = _hermes_calls(text)
    elif family == "deepseek_v3":
        raw = _deepseek_v3_calls(text)
    elif family == "llama3":
        raw = _llama3_calls(text)
    else:
        raise ValueError(f"unknown tool-call format {family!r}: use one of {', '.join(FAMILIES)}.")
    by_name = {s["function"]["name"]: s for s in schemas} if schemas is not None else None
    calls, errors = [], []
    for index, item in enumerate(raw):
        if isinstance(item, str):
            errors.append(f"tool call {index + 1}: {item}")
            continue
        call = ToolCall(item[0], item[1], f"{id_prefix}{index}")
        problem = check_call(call, by_name) if by_name is not None else None
        if problem:
            errors.append(f"tool call {index + 1}: {problem}")
        else:
            calls.append(call)
    return calls, errors


def check_call(call: ToolCall, schemas: dict[str, dict]) -> str | None:
    """Why `call` cannot be made with these tools (name -> OpenAI function schema), or None."""
    schema = schemas.get(call.name)
    if schema is None:
        return f"unknown tool {call.name!r}; the tools are: {', '.join(sorted(schemas)) or 'none'}."
    return check_arguments(call.name, call.arguments, schema["function"].get("parameters") or {})


def check_arguments(name: str, arguments: dict, parameters: dict) -> str | None:
    """Why `arguments` do not match the JSON schema `parameters` of tool `name`, or None."""
    import jsonschema  # a dependency of ray; imported here to keep `mrl --help` light

    try:
        validator = jsonschema.validators.validator_for(parameters)(parameters)
        error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    except Exception as exc:  # a broken schema from a caller: still a message, never a raise
        return f"tool {name!r} has a parameters schema that cannot be checked ({type(exc).__name__}: {exc})."
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    at = f" (at {where})" if where else ""
    return f"the arguments of {name!r} do not match its parameters{at}: {error.message}."


def _object(payload: str, keys: tuple[str, ...]) -> tuple[str, dict] | str:
    """(name, arguments) from a JSON call object, or why not."""
    try:
        value = json.loads(payload)
    except json.JSONDecodeError as exc:
        return f"not valid JSON ({exc.msg} at character {exc.pos}): {_clip(payload)}"
    return _name_and_arguments(value, keys)


def _name_and_arguments(value: Any, keys: tuple[str, ...]) -> tuple[str, dict] | str:
    if not isinstance(value, dict):
        return f"expected a JSON object with \"name\" and \"{keys[0]}\", got {type(value).__name__}."
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return f"the call has no \"name\" string: {_clip(json.dumps(value, ensure_ascii=False))}"
    key = next((k for k in keys if k in value), None)
    return _named(name, value[key] if key else {})


def _named(name: str, arguments: Any) -> tuple[str, dict] | str:
    # Some models write the arguments as a JSON string (OpenAI's wire form); accept that too.
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return f"the arguments of {name!r} are not valid JSON ({exc.msg} at character {exc.pos}): " \
                   f"{_clip(arguments)}"
    if not isinstance(arguments, dict):
        return f"the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}."
    return name, arguments


def _hermes_calls(text: str) -> list[tuple[str, dict] | str]:
    calls: list[tuple[str, dict] | str] = []
    for match in _HERMES.finditer(text):
        if match.group(2):
            calls.append(_object(match.group(1).strip(), ("arguments", "parameters")))
        else:
            calls.append("<tool_call> is not closed by </tool_call> (was the turn cut off?).")
    return calls


def _deepseek_v3_calls(text: str) -> list[tuple[str, dict] | str]:
    if _DSV3_CALLS_BEGIN not in text:
        return []
    calls: list[tuple[str, dict] | str] = []
    for head, body, end in _DSV3_CALL.findall(text.split(_DSV3_CALLS_BEGIN, 1)[1]):
        head, body = head.strip(), body.strip()
        if not end:
            calls.append("<｜tool▁call▁begin｜> is not closed by <｜tool▁call▁end｜> (was the turn cut off?).")
            continue
        if head == "function":  # V3: function<sep>name\n```json\n{...}\n```
            name, _, body = body.partition("\n")
            name, body = name.strip(), body.strip()
        else:  # V3.1: name<sep>{...}
            name = head
        fenced = _JSON_FENCE.match(body)
        calls.append(_named(name, fenced.group(1) if fenced else body) if name
                     else "the call has no function name before its arguments.")
    return calls


def _llama3_calls(text: str) -> list[tuple[str, dict] | str]:
    body = text.strip()
    if body.startswith(_LLAMA_PYTHON_TAG):
        body = body[len(_LLAMA_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return []  # a plain answer: Llama 3 calls are the whole turn
    decoder = json.JSONDecoder()
    calls: list[tuple[str, dict] | str] = []
    pos = 0
    while pos < len(body):
        try:
            value, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as exc:
            calls.append(f"not valid JSON ({exc.msg} at character {exc.pos}): {_clip(body[pos:])}")
            break
        calls.append(_name_and_arguments(value, ("parameters", "arguments")))
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
    return calls


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "…"
