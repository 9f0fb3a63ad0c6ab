"""Tools an agent can call: declared by OpenAI function schema, called safely, loaded by name.

A Tool is a Python function (sync or async) with its schema, made from the function's signature
and docstring or given explicitly. A Toolbox parses a model turn's calls (tool_calls.py), checks
them against the schemas and calls them with a timeout: nothing a tool does raises out of
`Toolbox.call`; a failure is a ToolResult with `error` set, and `content` is what the model sees
("Error: ..." for a failure; a response past max_response_chars is cut and ends with a line
"[truncated: the first N of M characters are shown]"). Built-ins: "calculator" (calculator.py)
and "python" (python_tool.py). User tools: load_tool("package.module:function") or
load_tool("path/to/file.py:function").
"""

from __future__ import annotations

import asyncio
import collections.abc as abc
import functools
import inspect
import json
import re
import threading
import time
import types
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from mrl.agent.calculator import CalculatorError, calculate
from mrl.agent.tool_calls import ToolCall, check_arguments, parse_tool_calls

__all__ = ["Tool", "ToolCall", "ToolCounts", "ToolError", "ToolLoadError", "ToolResult", "Toolbox",
           "calculator", "function_schema", "load_tool", "parse_tool_calls"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns?|Yields?|Raises|Examples?|Notes?):\s*$")
_GOOGLE_ARG = re.compile(r"^\s+\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SPHINX_ARG = re.compile(r"^:param\s+(?:[^:]*\s)?(\w+):\s*(.*)$")
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object",
               list: "array", tuple: "array", set: "array", frozenset: "array", type(None): "null"}


class ToolError(Exception):
    """Raise in a tool to answer the model with this message as a failed call (no traceback)."""


class ToolLoadError(ValueError):
    """A tool spec that cannot be loaded; the message names the spec and the fix."""


@dataclass(frozen=True)
class ToolResult:
    """A tool's answer to one call. `content` is the text the model sees; `error` is set (and
    counted) when the call failed: unknown tool, bad arguments, a raise, a timeout."""

    call_id: str
    name: str
    content: str
    error: str | None = None
    seconds: float = 0.0
    truncated: bool = False

    def to_message(self) -> dict:
        """The answer as an OpenAI chat message (role "tool")."""
        return {"role": "tool", "tool_call_id": self.call_id, "name": self.name, "content": self.content}


@dataclass(frozen=True)
class Tool:
    """A function the model may call with keyword arguments matching `parameters` (a JSON schema of
    type object). `timeout_s` overrides the Toolbox's per-call timeout for this tool."""

    name: str
    description: str
    parameters: dict
    fn: Callable[..., Any] = field(repr=False)
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"tool name {self.name!r} is not allowed: use 1-64 letters, digits, '_' or '-'.")
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema with \"type\": \"object\", got "
                             f"{json.dumps(self.parameters)[:120]}.")
        import jsonschema  # a dependency of ray; imported here to keep `mrl --help` light

        try:
            jsonschema.validators.validator_for(self.parameters).check_schema(self.parameters)
        except jsonschema.exceptions.SchemaError as exc:
            raise ValueError(f"tool {self.name!r}: its parameters are not a valid JSON schema: "
                             f"{exc.message}.") from None

    @classmethod
    def from_function(cls, fn: Callable[..., Any], name: str | None = None, description: str | None = None,
                      parameters: dict | None = None, timeout_s: float | None = None) -> "Tool":
        """A tool calling `fn`; the schema comes from its signature and docstring unless given."""
        schema = function_schema(fn) if parameters is None or description is None else None
        return cls(name or getattr(fn, "__name__", type(fn).__name__),
                   description if description is not None else schema["description"],
                   parameters if parameters is not None else schema["parameters"], fn, timeout_s)

    @classmethod
    def from_schema(cls, schema: dict, fn: Callable[..., Any], timeout_s: float | None = None) -> "Tool":
        """A tool from an OpenAI function schema ({"type": "function", "function": {...}})."""
        spec = schema.get("function", schema)
        if "name" not in spec:
            raise ValueError("a tool schema needs a function name: {'type': 'function', 'function': "
                             "{'name': ..., 'description': ..., 'parameters': {...}}}.")
        return cls(spec["name"], spec.get("description", ""),
                   spec.get("parameters") or {"type": "object", "properties": {}}, fn, timeout_s)

    def schema(self) -> dict:
        """The OpenAI function schema the model is shown."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(getattr(self.fn, "__call__", None))

    def __call__(self, **arguments: Any) -> Any:
        return self.fn(**arguments)


def function_schema(fn: Callable[..., Any]) -> dict:
    """{"description", "parameters"} of a function: types from its annotations, the description
    and each argument's text from its docstring (Google "Args:" or Sphinx ":param x:" style)."""
    description, arg_docs = _docstring_parts(inspect.getdoc(fn) or "")
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation naming something undefined: leave that argument untyped
        hints = {}
    properties, required, extra = {}, [], False
    for param in inspect.signature(fn).parameters.values():
        if param.kind is param.VAR_KEYWORD:
            extra = True
            continue
        if param.kind is param.VAR_POSITIONAL or param.kind is param.POSITIONAL_ONLY:
            continue  # the model passes keyword arguments only
        prop = _type_schema(hints.get(param.name, inspect.Parameter.empty))
        if param.name in arg_docs:
            prop["description"] = arg_docs[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    parameters = {"type": "object", "properties": properties, "required": required}
    if not extra:
        parameters["additionalProperties"] = False
    return {"description": description, "parameters": parameters}


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    description: list[str] = []
    args: dict[str, str] = {}
    section, last = "description", None
    for line in doc.splitlines():
        sphinx = _SPHINX_ARG.match(line.strip())
        if sphinx:
            section, last = "sphinx", sphinx.group(1)
            args[last] = sphinx.group(2).strip()
        elif _SECTION.match(line.strip()) and not line.startswith(" "):
            section, last = line.strip().rstrip(":").lower(), None
        elif section in ("args", "arguments", "parameters") and _GOOGLE_ARG.match(line):
            last = _GOOGLE_ARG.match(line).group(1)
            args[last] = _GOOGLE_ARG.match(line).group(2).strip()
        elif last and line.startswith(" ") and line.strip():  # an argument's text continues
            args[last] = f"{args[last]} {line.strip()}".strip()
        elif section == "description":
            description.append(line)
    return " ".join(" ".join(description).split()), args


def _type_schema(hint: Any) -> dict:
    """A JSON schema for a Python annotation; {} (any value) for what JSON cannot say."""
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [_type_schema(a) for a in args]
        if all(set(o) == {"type"} for o in options):
            return {"type": [o["type"] for o in options]}
        return {"anyOf": options}
    if origin in (list, tuple, set, frozenset) or (origin and _is_sequence(origin)):
        items = [a for a in args if a is not Ellipsis]
        return {"type": "array", "items": _type_schema(items[0])} if len(set(items)) == 1 else {"type": "array"}
    if origin is dict or (origin and _is_mapping(origin)):
        return {"type": "object"}
    return {}


def _is_sequence(origin: Any) -> bool:
    return isinstance(origin, type) and issubclass(origin, abc.Sequence) and not issubclass(origin, str)


def _is_mapping(origin: Any) -> bool:
    return isinstance(origin, type) and issubclass(origin, abc.Mapping)


@dataclass
class ToolCounts:
    """Totals over a Toolbox's life, for metrics (agent/tool_calls, agent/tool_errors, agent/tool_s)."""

    calls: int = 0
    malformed: int = 0  # calls that parse_tool_calls refused (bad JSON, unknown tool, bad arguments)
    failed: int = 0  # calls to `call` that ended with an error (unknown tool, bad arguments, a raise, a timeout)
    timed_out: int = 0
    truncated: int = 0
    seconds: float = 0.0


class Toolbox:
    """The tools of an episode (or of many: it holds no per-episode state but the counts).

    Sync tools run in the Toolbox's own threads, never on the event loop; a sync tool that times out
    cannot be stopped and keeps its thread until it returns (use the python tool for code that may
    hang). Async tools are awaited and cancelled on timeout; one that blocks the loop cannot be.
    """

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]], max_response_chars: int = 4096,
                 timeout_s: float = 10.0, threads: int = 16) -> None:
        if max_response_chars < 1 or timeout_s <= 0 or threads < 1:
            raise ValueError(f"Toolbox needs max_response_chars >= 1, timeout_s > 0 and threads >= 1, got "
                             f"{max_response_chars}, {timeout_s} and {threads}.")
        self._tools: dict[str, Tool] = {}
        for item in tools:
            tool = item if isinstance(item, Tool) else Tool.from_function(item)
            if tool.name in self._tools:
                raise ValueError(f"two tools are named {tool.name!r}: give one another name.")
            self._tools[tool.name] = tool
        self.max_response_chars, self.timeout_s = max_response_chars, timeout_s
        self.counts = ToolCounts()
        self._threads, self._executor = threads, None
        self._lock = threading.Lock()
        self._busy_threads = 0

    def schemas(self) -> list[dict]:
        """The OpenAI function schemas of every tool, in the order given."""
        return [tool.schema() for tool in self._tools.values()]

    def names(self) -> list[str]:
        return list(self._tools)

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def parse(self, text: str, family: str = "qwen", id_prefix: str = "call_") -> tuple[list[ToolCall], list[str]]:
        """parse_tool_calls against these tools; the malformed calls are counted."""
        calls, errors = parse_tool_calls(text, family, self.schemas(), id_prefix)
        self.counts.malformed += len(errors)
        return calls, errors

    async def call_all(self, calls: Iterable[ToolCall]) -> list[ToolResult]:
        """Every call, concurrently; the results in the calls' order."""
        return list(await asyncio.gather(*(self.call(c) for c in calls)))

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one call. Never raises for anything the tool does: a failure is a result with
        `error` set (only the caller's own cancellation propagates)."""
        start = time.monotonic()
        self.counts.calls += 1
        tool = self._tools.get(call.name)
        if tool is None:
            error = f"unknown tool {call.name!r}; the tools are: {', '.join(self._tools) or 'none'}."
        else:
            error = check_arguments(tool.name, call.arguments, tool.parameters)
        content = None
        if error is None:
            content, error = await self._run(tool, call.arguments)
        seconds = time.monotonic() - start
        self.counts.seconds += seconds
        if error is not None:
            self.counts.failed += 1
            content = f"Error: {error}"
        text, truncated = self._truncate(content)
        return ToolResult(call.id, call.name, text, error, seconds, truncated)

    async def _run(self, tool: Tool, arguments: dict) -> tuple[str | None, str | None]:
        timeout = tool.timeout_s or self.timeout_s
        # The tool runs as its own task: a TimeoutError or CancelledError it raises is its failure,
        # while one raised by this wait is the deadline or the caller's cancellation.
        task = asyncio.ensure_future(self._invoke(tool, arguments))
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout)
        except BaseException:
            task.cancel()
            raise
        if not done:
            task.cancel()
            task.add_done_callback(_retrieve)  # what it raises while cancelled is not worth a warning
            self.counts.timed_out += 1
            note = "" if tool.is_async else f" (its thread runs on: {self._busy_threads} tool threads busy)"
            return None, f"tool {tool.name!r} timed out after {timeout:g} s{note}."
        try:
            return _as_text(task.result()), None
        except ToolError as exc:
            return None, str(exc)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # anything the user's code raises, its own cancellation included
            return None, f"tool {tool.name!r} raised {type(exc).__name__}: {exc}"

    async def _invoke(self, tool: Tool, arguments: dict) -> Any:
        try:
            if tool.is_async:
                value = await tool.fn(**arguments)
            else:
                loop = asyncio.get_running_loop()
                value = await loop.run_in_executor(self._pool(), functools.partial(self._in_thread, tool.fn, arguments))
            if inspect.isawaitable(value):  # a sync function that returned a coroutine
                value = await value
        except SystemExit as exc:  # a task re-raises SystemExit out of the event loop: stop it here
            raise ToolError(f"tool {tool.name!r} raised SystemExit: {exc}") from None
        return value

    def _in_thread(self, fn: Callable[..., Any], arguments: dict) -> Any:
        with self._lock:
            self._busy_threads += 1
        try:
            return fn(**arguments)
        finally:
            with self._lock:
                self._busy_threads -= 1

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix="mrl-tool")
        return self._executor

    def _truncate(self, content: str) -> tuple[str, bool]:
        if len(content) <= self.max_response_chars:
            return content, False
        self.counts.truncated += 1
        return (f"{content[:self.max_response_chars]}\n[truncated: the first {self.max_response_chars} of "
                f"{len(content)} characters are shown]"), True

    def close(self) -> None:
        """Stop the tool threads (a sync tool still running keeps its thread until it returns)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def __aenter__(self) -> "Toolbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: integers of any length up to 4000 digits and
    decimals, with + - * / // % ** and parentheses. Division that does not come out even is
    rounded to 50 digits after the integer part.

    Args:
        expression: the expression, e.g. "12345678901234567890 * 98765432109876543210".
    """
    try:
        return calculate(expression)
    except CalculatorError as exc:
        raise ToolError(f"calculator: {exc}") from None


def _python_tool() -> Tool:
    from mrl.agent.python_tool import python_tool

    return python_tool()


_BUILTINS: dict[str, Callable[[], Tool]] = {"calculator": lambda: Tool.from_function(calculator),
                                             "python": _python_tool}


def load_tool(spec: str) -> Tool:
    """A built-in tool by name ("calculator", "python"), or a user function (sync or async) or a
    Tool object named by "package.module:function" or "path/to/file.py:function". Imports the
    user's module here. A failure is a ToolLoadError of one line naming the fix."""
    if spec in _BUILTINS:
        return _BUILTINS[spec]()
    if ":" not in spec:
        raise ToolLoadError(f"tool {spec!r} is neither a built-in ({', '.join(_BUILTINS)}) nor an import path: "
                            "use 'package.module:function' or 'path/to/file.py:function'.")
    from mrl.rewards.base import RewardLoadError
    from mrl.rewards.sandbox import import_function

    try:
        fn = import_function(spec, kind="tool")
    except RewardLoadError as exc:
        raise ToolLoadError(str(exc)) from None
    if isinstance(fn, Tool):
        return fn
    try:
        return Tool.from_function(fn)
    except ValueError as exc:
        raise ToolLoadError(f"tool {spec!r}: {exc}") from None
