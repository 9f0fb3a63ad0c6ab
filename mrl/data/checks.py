"""A prompt file read and checked record by record before a run starts (config validation calls it).

A run renders every record with data.template and reads data.answer_key for rewards that compare
with an answer; a record without such a field would stop the run, or score 0, mid-way. The check
names the first bad record by line (jsonl) or record number (parquet), its field and the fix, and
counts the bad records after it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from mrl.data.prompts import MISSING, DataError, field_value


class Need(NamedTuple):
    """Why a record needs a field, and how to fix a record without it."""

    why: str
    fix: str


class _Unreadable(Exception):
    """The file as a whole cannot be read: the message is the rest of the line."""


def records_problem(key: str, path: str | Path, needs: dict[str, Need], template: Any = None) -> str | None:
    """One line naming the first bad record of the prompt file at `path` (data.`key`), or None.
    `template` (a PromptTemplate): chat messages in a record it cannot render are a problem too."""
    path = Path(path)
    unit = "line" if path.suffix == ".jsonl" else "record"
    first, later, count = None, 0, 0
    try:
        for number, record, problem in _jsonl(path) if path.suffix == ".jsonl" else _parquet(path, needs):
            count += 1
            problem = problem or _record_problem(record, needs) or _messages_problem(record, template)
            if problem and first is None:
                first = f"data.{key} {path} {unit} {number} {problem}"
            elif problem:
                later += 1
    except _Unreadable as exc:
        return f"data.{key} {path} {exc}"
    if first is not None:
        return first + (f" ({later} later {unit}{'s have' if later > 1 else ' has'} problems too)." if later else ".")
    if count == 0:
        return (f"data.{key} {path} holds no records: write one JSON object a line (jsonl) or a row per prompt "
                f"(parquet), or point data.{key} at another file.")
    return None


def _record_problem(record: Any, needs: dict[str, Need]) -> str | None:
    if not isinstance(record, dict):
        return f"is a {type(record).__name__}, not a JSON object: write one object a line"
    for name, need in needs.items():
        value = field_value(record, name)
        if value is MISSING:
            fields = sorted(record)
            shown = ", ".join(fields[:12]) + (", …" if len(fields) > 12 else "")
            return f"has no field {name!r} ({need.why}; its fields: {shown or 'none'}): {need.fix}"
        if value is None:
            return f"has {name!r}: null ({need.why}): {need.fix}"
    return None


def _messages_problem(record: dict, template: Any) -> str | None:
    if template is None:
        return None
    try:
        template.messages_of(record)
    except DataError as exc:
        return str(exc).rstrip(".")
    return None


def _jsonl(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, record, problem) for each non-blank line."""
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    yield number, json.loads(line), None
                except json.JSONDecodeError as exc:
                    yield number, None, f"is not valid JSON ({exc.msg}, column {exc.colno}): fix or remove that line"
    except UnicodeDecodeError as exc:
        raise _Unreadable(f"is not UTF-8 text (byte {exc.start}): write the file as UTF-8 JSON lines.") from None


def _parquet(path: Path, needs: dict[str, Need]) -> Iterator[tuple[int, Any, str | None]]:
    """(record number, row, None) for each row, with only the columns the needs read."""
    import pyarrow.parquet as pq  # config validation has checked that pyarrow is installed

    try:
        table = pq.ParquetFile(path)
        columns = table.schema_arrow.names
        wanted = {name if name in columns else name.split(".")[0] for name in needs}
        rows = table.read(columns=[c for c in columns if c in wanted]).to_pylist()
    except Exception as exc:  # pyarrow's errors have no common base; any of them means "cannot read"
        raise _Unreadable(f"is not a readable parquet file ({' '.join(str(exc).split())}): check the file.") from None
    # a row lacking a column: the message lists the file's columns, not only those read
    lacking = any(name not in columns and name.split(".")[0] not in columns for name in needs)
    blank = dict.fromkeys(columns, "") if lacking else {}
    for number, row in enumerate(rows, 1):
        yield number, {**blank, **row} if blank else row, None
