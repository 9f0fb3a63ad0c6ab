"""Tools for agents: call parsing per family, schemas, the Toolbox's limits, loading, the calculator
and the sandboxed Python tool."""

from __future__ import annotations

import asyncio
import socket
import textwrap
import time
from typing import Literal, Optional

import pytest

from mrl.agent.calculator import MAX_DIGITS, CalculatorError, calculate
from mrl.agent.python_tool import PythonLimits, PythonSandbox, python_tool
from mrl.agent.tools import (Tool, ToolCall, Toolbox, ToolError, ToolLoadError, function_schema, load_tool,
                             parse_tool_calls)


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first
            addend.
        b (int): the second.
    """
    return a + b


ADD_SCHEMAS = [Tool.from_function(add).schema()]


# ---------------------------------------------------------------- parsing


def test_qwen_calls_are_parsed_in_order_with_ids():
    text = ('Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 5}"}\n</tool_call>')
    calls, errors = parse_tool_calls(text, "qwen", ADD_SCHEMAS, id_prefix="call_3_")
    assert errors == []
    assert calls == [ToolCall("add", {"a": 1, "b": 2}, "call_3_0"), ToolCall("add", {"a": 5}, "call_3_1")]
    assert calls[0].to_openai() == {"id": "call_3_0", "type": "function",
                                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    assert parse_tool_calls("no calls here") == ([], [])


@pytest.mark.parametrize("body, expected", [
    ('{"name": "add", "arguments": {"a": 1,}}', "not valid JSON"),
    ('{"arguments": {"a": 1}}', 'no "name" string'),
    ('["add"]', "expected a JSON object"),
    ('{"name": "add", "arguments": [1, 2]}', "must be a JSON object"),
    ('{"name": "mul", "arguments": {"a": 1}}', "unknown tool 'mul'; the tools are: add"),
    ('{"name": "add", "arguments": {"b": 1}}', "'a' is a required property"),
    ('{"name": "add", "arguments": {"a": "one"}}', "(at a): 'one' is not of type 'integer'"),
    ('{"name": "add", "arguments": {"a": 1, "c": 2}}', "Additional properties are not allowed"),
])
def test_malformed_qwen_calls_become_messages_and_the_good_ones_still_run(body, expected):
    good = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    calls, errors = parse_tool_calls(f"<tool_call>{body}</tool_call>{good}", "qwen", ADD_SCHEMAS)
    assert [c.arguments for c in calls] == [{"a": 1}] and calls[0].id == "call_1"
    assert len(errors) == 1 and errors[0].startswith("tool call 1: ") and expected in errors[0], errors


def test_a_cut_off_qwen_call_is_an_error():
    calls, errors = parse_tool_calls('<tool_call>{"name": "add", "argu', "hermes")
    assert calls == [] and "not closed" in errors[0]


def test_deepseek_v3_and_v31_calls():
    v3 = ("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
          '{"a": 1, "b": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n'
          '{"a": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>')
    calls, errors = parse_tool_calls(v3, "deepseek_v3", ADD_SCHEMAS)
    assert errors == [] and [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2}), ("add", {"a": 3})]
    v31 = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 4}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    assert parse_tool_calls(v31, "deepseek_v3")[0] == [ToolCall("add", {"a": 4}, "call_0")]
    bad = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{"a": }\n```'
           '<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{"a"')
    calls, errors = parse_tool_calls(bad, "deepseek_v3")
    assert calls == [] and "not valid JSON" in errors[0] and "not closed" in errors[1]
    assert parse_tool_calls("<｜tool▁call▁begin｜>no calls block", "deepseek_v3") == ([], [])


def test_llama3_calls():
    one = '{"name": "add", "parameters": {"a": 1}}'
    assert parse_tool_calls(one, "llama3", ADD_SCHEMAS) == ([ToolCall("add", {"a": 1}, "call_0")], [])
    two = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", "arguments": {"a": 2}}'
    assert [c.arguments for c in parse_tool_calls(two, "llama3")[0]] == [{"a": 1}, {"a": 2}]
    assert parse_tool_calls("The answer is 3.", "llama3") == ([], [])
    calls, errors = parse_tool_calls('{"name": "add", "parameters": {"a": 1}} {"name": ', "llama3")
    assert len(calls) == 1 and "not valid JSON" in errors[0]


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="unknown tool-call format 'mistral'"):
        parse_tool_calls("", "mistral")


# ---------------------------------------------------------------- schemas


def test_function_schema_from_signature_and_google_docstring():
    def search(query: str, k: int = 5, mode: Literal["web", "news"] = "web", tags: list[str] | None = None,
               scale: Optional[float] = None, **extra) -> str:
        """Search the web.

        Returns results.

        Args:
            query: what to look for.
            k: how many results.
        Returns:
            text.
        """

    schema = function_schema(search)
    assert schema["description"] == "Search the web. Returns results."
    params = schema["parameters"]
    assert params["required"] == ["query"] and "additionalProperties" not in params  # **extra takes more
    assert params["properties"] == {
        "query": {"type": "string", "description": "what to look for."},
        "k": {"type": "integer", "description": "how many results."},
        "mode": {"enum": ["web", "news"]},
        "tags": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
        "scale": {"type": ["number", "null"]},
    }
    add_params = function_schema(add)["parameters"]
    assert add_params["additionalProperties"] is False
    assert add_params["properties"]["a"]["description"] == "the first addend."


def test_function_schema_sphinx_docstring():
    def f(x: bool):
        """Flip.

        :param x: the bit.
        """

    assert function_schema(f) == {"description": "Flip.", "parameters": {
        "type": "object", "properties": {"x": {"type": "boolean", "description": "the bit."}},
        "required": ["x"], "additionalProperties": False}}


def test_tool_checks_its_name_and_schema():
    with pytest.raises(ValueError, match="tool name 'a b' is not allowed"):
        Tool("a b", "", {"type": "object"}, add)
    with pytest.raises(ValueError, match="must be a JSON schema with \"type\": \"object\""):
        Tool("t", "", {"type": "string"}, add)
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        Tool("t", "", {"type": "object", "properties": {"a": {"type": "integr"}}}, add)
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}}}
    schema = {"type": "function", "function": {"name": "plus", "description": "adds", "parameters": parameters}}
    assert Tool.from_schema(schema, add).schema() == schema


# ---------------------------------------------------------------- Toolbox


def run(coro):
    return asyncio.run(coro)


def test_toolbox_calls_sync_tools_in_its_threads_and_async_tools_on_the_loop():
    import threading

    def where() -> str:
        return threading.current_thread().name

    async def double(x: int) -> dict:
        return {"x": 2 * x}

    async def main():
        async with Toolbox([add, where, Tool.from_function(double)]) as box:
            assert [s["function"]["name"] for s in box.schemas()] == ["add", "where", "double"]
            results = await box.call_all([ToolCall("add", {"a": 2, "b": 3}, "c0"), ToolCall("where", {}, "c1"),
                                          ToolCall("double", {"x": 4}, "c2")])
            return results, box.counts

    results, counts = run(main())
    assert [r.content for r in results] == ["5", results[1].content, '{"x": 8}']
    assert results[1].content.startswith("mrl-tool")  # not the event loop's thread
    assert all(r.error is None for r in results) and counts.calls == 3 and counts.failed == 0
    assert results[0].to_message() == {"role": "tool", "tool_call_id": "c0", "name": "add", "content": "5"}


def test_toolbox_turns_every_failure_into_an_error_result():
    def crash() -> str:
        raise ValueError("bad input")

    def leave() -> str:
        raise SystemExit(3)

    def refuse() -> str:
        raise ToolError("the database is read-only")

    async def own_timeout() -> str:
        raise TimeoutError("upstream was slow")

    async def main():
        box = Toolbox([add, crash, leave, refuse, own_timeout])
        results = await box.call_all([ToolCall(n, {}, n) for n in ("crash", "leave", "refuse", "own_timeout", "nope")]
                                     + [ToolCall("add", {"a": "x"}, "bad")])
        box.close()
        return results, box.counts

    results, counts = run(main())
    assert [r.content for r in results] == [
        "Error: tool 'crash' raised ValueError: bad input",
        "Error: tool 'leave' raised SystemExit: 3",
        "Error: the database is read-only",
        "Error: tool 'own_timeout' raised TimeoutError: upstream was slow",
        "Error: unknown tool 'nope'; the tools are: add, crash, leave, refuse, own_timeout.",
        "Error: the arguments of 'add' do not match its parameters (at a): 'x' is not of type 'integer'.",
    ]
    assert all(r.error and r.content == f"Error: {r.error}" for r in results)
    assert counts.failed == 6 and counts.timed_out == 0


def test_toolbox_timeouts_sync_and_async():
    def slow_sync() -> str:
        time.sleep(0.5)
        return "late"

    async def slow_async() -> str:
        await asyncio.sleep(5)
        return "late"

    async def main():
        box = Toolbox([slow_sync, Tool.from_function(slow_async, timeout_s=0.05)], timeout_s=0.1)
        start = time.monotonic()
        results = await box.call_all([ToolCall("slow_sync", {}, "a"), ToolCall("slow_async", {}, "b")])
        elapsed = time.monotonic() - start
        box.close()
        return results, elapsed, box.counts

    results, elapsed, counts = run(main())
    assert results[0].error.startswith("tool 'slow_sync' timed out after 0.1 s (its thread runs on")
    assert results[1].error == "tool 'slow_async' timed out after 0.05 s."
    assert elapsed < 0.45 and counts.timed_out == 2


def test_the_callers_cancellation_propagates():
    async def hang() -> str:
        await asyncio.sleep(10)
        return ""

    async def main():
        box = Toolbox([Tool.from_function(hang)])
        task = asyncio.ensure_future(box.call(ToolCall("hang", {}, "h")))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())


def test_long_responses_are_truncated_and_marked():
    def long() -> str:
        return "x" * 100

    async def main():
        box = Toolbox([long], max_response_chars=10)
        return await box.call(ToolCall("long", {}, "l")), box.counts

    result, counts = run(main())
    assert result.content == "x" * 10 + "\n[truncated: the first 10 of 100 characters are shown]"
    assert result.truncated and result.error is None and counts.truncated == 1


def test_toolbox_parse_counts_malformed_calls():
    box = Toolbox([add])
    calls, errors = box.parse('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{</tool_call>')
    assert len(calls) == 1 and len(errors) == 1 and box.counts.malformed == 1
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        Toolbox([add, add])


# ---------------------------------------------------------------- load_tool


def test_load_tool_builtins_files_and_errors(tmp_path):
    assert load_tool("calculator").schema()["function"]["name"] == "calculator"
    path = tmp_path / "my_tools.py"
    path.write_text(textwrap.dedent('''
        from mrl.agent.tools import Tool

        async def lookup(key: str) -> str:
            """Look a key up."""
            return key.upper()

        explicit = Tool("echo", "Echo.", {"type": "object", "properties": {"s": {"type": "string"}}}, lambda s: s)
    '''))
    tool = load_tool(f"{path}:lookup")
    assert tool.is_async and tool.schema()["function"]["description"] == "Look a key up."
    assert run(Toolbox([tool]).call(ToolCall("lookup", {"key": "k"}, "x"))).content == "K"
    assert load_tool(f"{path}:explicit").name == "echo"
    for spec, message in [("calculater", "is neither a built-in (calculator, python) nor an import path"),
                          (f"{path}:nope", "has no callable 'nope' (from tool"),
                          (f"{tmp_path}/missing.py:f", "tool file"),
                          ("no_such_module_xyz:f", "tool 'no_such_module_xyz:f': importing no_such_module_xyz failed")]:
        with pytest.raises(ToolLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_tool(spec)


# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize("expression, value", [
    ("123456789012345678901234567890 * 987654321098765432109876543210",
     str(123456789012345678901234567890 * 987654321098765432109876543210)),
    ("0.1 + 0.2", "0.3"), ("(1 + 2) * -3", "-9"), ("10 / 4", "2.5"), ("10**30 / 10**28", "100"),
    ("1 / 3", "0." + "3" * 51), ("-7 // 2", "-4"), ("-7.5 // 2", "-4"), ("-7.5 % 2", "0.5"), ("-7 % 2", "1"),
    ("2 ** -2", "0.25"), ("1.50 ** 3", "3.375"), ("2 ** 0.5", "1.4142135623730950488016887242096980785696718753769"),
    ("1e3 + 1", "1001"), ("2 ** 13000", str(2**13000)),
])
def test_calculator_is_exact(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("", "the expression is empty"), ("2 +", "is not an arithmetic expression"), ("x + 1", "the name 'x'"),
    ("__import__('os')", "a function call"), ("2 ^ 3", "use ** for powers"), ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"), ("0 ** -1", "0 to a negative power"), ("(-8) ** 0.5", "no real value"),
    ("2 ** 20000", "about 6022 digits; the limit is 4000"), ("9" * 5000, "has more than 4000 digits"),
    (f"10 ** {MAX_DIGITS}", "more than 4000 digits"), ("'a'", "'a' is not a number"), ("True + 1", "True is not"),
])
def test_calculator_refuses_with_a_reason(expression, message):
    with pytest.raises(CalculatorError, match=message.replace("(", r"\(").replace("*", r"\*")):
        calculate(expression)


def test_calculator_tool_errors_reach_the_model():
    result = run(Toolbox([load_tool("calculator")]).call(ToolCall("calculator", {"expression": "1/0"}, "c")))
    assert result.content == "Error: calculator: division by zero is undefined."


# ---------------------------------------------------------------- python tool


def sandbox_run(code: str, **limits) -> tuple:
    return sandbox_runs([(code, limits)])[0]


def sandbox_runs(programs: list[tuple[str, dict]]) -> list[tuple]:
    """Run programs concurrently (each with its own limits): (PythonRun, the text the model sees)."""
    sandboxes = [PythonSandbox(PythonLimits(**limits)) for _, limits in programs]

    async def main():
        return await asyncio.gather(*(s.run(code) for s, (code, _) in zip(sandboxes, programs)))

    return [(r, r.text(s.limits)) for r, s in zip(run(main()), sandboxes)]


def test_python_tool_output_errors_and_exit_codes():
    code = "import sys\nprint('out')\nprint('err', file=sys.stderr)\ndef f():\n    1/0\nf()"
    (result, text), (_, empty) = sandbox_runs([(code, {}), ("pass", {})])
    assert text.startswith("out\n[stderr]\nerr\nTraceback (most recent call last):\n  File ")
    assert "<string>" not in text and text.endswith("ZeroDivisionError: division by zero\n[exit code 1]")
    assert result.exit_code == 1 and not result.hit_limit
    assert empty == "(no output)"


def test_python_tool_limits_wall_time_output_and_memory():
    start = time.monotonic()
    background, wall, output, memory = sandbox_runs([
        ("import subprocess\nsubprocess.Popen(['sleep', '30'])\nprint('started')", {}),
        ("import time\nprint('a')\ntime.sleep(30)", {"wall_s": 0.5}),
        ("while True: print('x' * 99)", {"output_bytes": 1000}),
        ("x = bytearray(400 << 20)\nprint('allocated')", {"memory_mb": 256}),
    ])
    assert time.monotonic() - start < 5  # the background child was killed, not awaited for 30 s
    assert background[1] == "started" and not background[0].hit_limit
    assert wall[0].hit_limit and wall[1] == "a\n[stopped: the wall-time limit of 0.5 s was reached]"
    assert output[0].output_cut and not output[0].hit_limit and len(output[0].stdout) == 1000
    assert output[1].endswith("[stopped: the output passed 1000 bytes per stream and was cut there]")
    assert "MemoryError" in memory[1] and "allocated" not in memory[1]


def test_python_tool_has_no_network_and_no_parent_environment(monkeypatch):
    """Both ways of cutting the network: the namespace (where unshare works) and the socket block."""
    monkeypatch.setenv("MRL_TEST_SECRET", "s3cret")
    namespaced, blocked = PythonSandbox(), PythonSandbox()
    blocked._prefix = []  # as where unshare is refused
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        code = (f"import os, socket\nprint(os.environ.get('MRL_TEST_SECRET'))\n"
                f"socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)\nprint('connected')")

        async def main():
            return await asyncio.gather(namespaced.run(code), blocked.run(code))

        results = run(main())
    for result in results:
        assert result.stdout == "None\n" and result.exit_code == 1, result
    assert "PermissionError: network access is disabled in this sandbox" in results[1].stderr
    if namespaced.network_isolation.startswith("unshare"):
        assert "Network is unreachable" in results[0].stderr


@pytest.mark.matrix
def test_python_tool_cpu_limit():
    result, text = sandbox_run("while True: pass", cpu_s=1, wall_s=60)
    assert result.hit_limit and "CPU-time limit of 1 s" in text


def test_python_tool_through_a_toolbox():
    async def main():
        box = Toolbox([python_tool(PythonLimits(wall_s=0.5))])
        return await box.call_all([ToolCall("python", {"code": "print(6 * 7)"}, "a"),
                                   ToolCall("python", {"code": "import time; time.sleep(9)"}, "b")])

    ok, slow = run(main())
    assert ok.content == "42" and ok.error is None
    assert slow.error == "[stopped: the wall-time limit of 0.5 s was reached]"
    assert slow.content.startswith("Error: [stopped") and slow.to_message()["tool_call_id"] == "b"
    assert "no network" in load_tool("python").schema()["function"]["description"]
