"""Prompt records from jsonl or parquet, rendered with a prompt template.

A record is a dict (one jsonl line or one parquet row). The template is a format string with
{field} placeholders ("Q: {question}\nA:"); with chat=True the formatted text becomes the user turn
of the tokenizer's chat template, with the assistant turn opened for generation. A template of one
field holding a list of chat messages (verl's `prompt` column) renders those messages as they are.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PARQUET_NEEDS = "reading parquet needs pyarrow, which is not installed: pip install pyarrow (or convert the file to .jsonl)."
MISSING = object()  # field_value's answer for a field the record lacks


class DataError(ValueError):
    """Bad data or template; the message names the file/record/field and the fix."""


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """All records of a .jsonl or .parquet file, as dicts."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} not found: set data.path to an existing .jsonl or .parquet file.")
    if path.suffix == ".jsonl":
        records = _read_jsonl(path)
    elif path.suffix == ".parquet":
        records = _read_parquet(path)
    else:
        raise DataError(f"data file {path} has suffix {path.suffix!r}: use .jsonl or .parquet.")
    if not records:
        raise DataError(f"data file {path} holds no records.")
    return records


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path} line {number} is not valid JSON ({exc.msg}): fix or remove that line.") from None
            if not isinstance(record, dict):
                raise DataError(f"{path} line {number} is a {type(record).__name__}, not a JSON object.")
            records.append(record)
    return records


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: {PARQUET_NEEDS}") from None
    return pq.read_table(path).to_pylist()


@dataclass(frozen=True)
class PromptTemplate:
    """How a record becomes prompt text: `template` with {field} placeholders, optionally wrapped
    in the tokenizer's chat template (chat=True), with an optional system message."""

    template: str = "{prompt}"
    chat: bool = False
    system: str | None = None

    def fields(self) -> list[str]:
        """The record fields the template uses."""
        try:
            return [name for _, name, _, _ in string.Formatter().parse(self.template) if name is not None]
        except ValueError as exc:
            raise DataError(f"prompt template {self.template!r} is not a valid format string: {exc}.") from None

    def render(self, record: dict[str, Any], tokenizer: Any = None) -> str:
        """The prompt text for one record (a tokenizer is needed only when chat=True)."""
        missing = [name for name in self.fields() if name not in record]
        if missing:
            raise DataError(
                f"prompt template needs field(s) {missing} that the record lacks (it has {sorted(record)}): "
                "fix data.template or the data."
            )
        conversation = self.messages_of(record)
        if conversation is None:
            text = self.template.format(**record)
            if not self.chat:
                return text
            conversation = [{"role": "user", "content": text}]
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise DataError("data.chat_template=true needs a tokenizer with a chat template; the model's has none.")
        has_system = any(m.get("role") == "system" for m in conversation)
        messages = ([{"role": "system", "content": self.system}] if self.system and not has_system else []) + conversation
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def messages_of(self, record: dict[str, Any]) -> list[dict] | None:
        """The record's chat messages when the template is one field holding them (verl's datasets:
        "prompt": [{"role": "user", "content": ...}]), else None."""
        fields = self.fields()
        if len(fields) != 1 or self.template != "{" + fields[0] + "}":
            return None
        value = record[fields[0]]
        if not (isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m
                                                           for m in value)):
            return None
        if not self.chat:
            raise DataError(f"field {fields[0]!r} holds chat messages (verl's format): set data.chat_template: true "
                            "to render them with the model's chat template.")
        return [{"role": m["role"], "content": m["content"]} for m in value]


def prompt_samples(
    records: list[dict[str, Any]], template: PromptTemplate, answer_key: str = "answer", tokenizer: Any = None,
    sft_key: str | None = None,
) -> list[dict[str, Any]]:
    """Records → {"prompt", "ground_truth", "metadata"} samples (metadata: the whole record), with
    "demonstrations" (what SFT trains on, when not the ground truth: `sft_key`'s text or conversation, or each
    of its list)."""
    samples = []
    for index, record in enumerate(records):
        try:
            prompt = template.render(record, tokenizer)
        except DataError as exc:
            raise DataError(f"record {index}: {exc}") from None
        truth = field_value(record, answer_key)
        truth = None if truth is MISSING else truth
        samples.append({"prompt": prompt, "ground_truth": None if truth is None else str(truth), "metadata": record})
        shown = MISSING if sft_key is None else field_value(record, sft_key)
        if shown is not MISSING and shown is not None:
            samples[-1]["demonstrations"] = demonstrations(shown)
    return samples


def demonstrations(shown: Any) -> list:
    """An sft_key field's demonstrations: texts, or conversations (lists of chat messages, which SFT
    trains on as an agent's episode: mrl.agent.demonstrations); one of either, or a list of them."""
    if is_conversation(shown):
        return [shown]
    return [s if is_conversation(s) else str(s) for s in (shown if isinstance(shown, list) else [shown])]


def is_conversation(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def field_value(record: dict[str, Any], key: str) -> Any:
    """record[key], or MISSING; a dotted key that is not a field reads nested mappings
    ("reward_model.ground_truth": where verl's parquet files keep the answer)."""
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value
