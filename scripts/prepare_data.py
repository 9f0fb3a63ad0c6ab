"""Turn a prompt dataset into mrl's input, with an optional held-out split (docs/guide.md).

    python scripts/prepare_data.py IN OUT [--heldout FILE --heldout-size N] [--seed S]

IN and OUT are .jsonl or .parquet (by suffix). IN is one of:
  GSM8K's files     {"question": "...", "answer": "... #### 72"}
  verl's parquet    {"data_source", "prompt": [{"role", "content"}, ...], "reward_model": {"ground_truth"},
                     "extra_info", ...}: one user message, optionally after a system message
OUT holds one record a prompt: {"data_source", "question", "answer", "extra_info", ...}: `question` is
the text data.template renders, `answer` the ground truth (data.answer_key), and verl's `data_source` and
`extra_info` are kept for a reward in verl's signature. A system message, which must be the same in
every record, is printed as the data.system_prompt to set. Needs only json (and pyarrow for parquet).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

GSM8K_ANSWER = re.compile(r"#### *(-?[0-9.,]+)")  # verl's gsm8k preprocessing reads the same
GSM8K_SOURCE = "openai/gsm8k"  # the data_source verl's GSM8K files carry


class PrepareError(ValueError):
    """A record that cannot be converted: the message names it and the fix."""


def read(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix != ".jsonl":
        raise PrepareError(f"{path}: use a .jsonl or .parquet file")
    records = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            try:
                records += [json.loads(line)] if line.strip() else []
            except json.JSONDecodeError as exc:
                raise PrepareError(f"line {number} is not JSON ({exc.msg})") from None
    return records


def write(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    else:
        raise PrepareError(f"{path}: use a .jsonl or .parquet file")


def convert(record: dict, index: int) -> tuple[dict, str | None]:
    """One input record as mrl's, and its system message (None without one)."""
    if not isinstance(record, dict):
        raise PrepareError(f"record {index} is a {type(record).__name__}, not an object")
    if isinstance(record.get("prompt"), (list, tuple)):  # verl's chat-format prompt
        messages = list(record["prompt"])
        system = messages.pop(0)["content"] if messages and messages[0].get("role") == "system" else None
        if len(messages) != 1 or messages[0].get("role") != "user":
            raise PrepareError(f"record {index}: its prompt has roles {[m.get('role') for m in record['prompt']]}; "
                               "mrl renders one user turn (after an optional system message)")
        truth = (record.get("reward_model") or {}).get("ground_truth")
        if truth is None:
            raise PrepareError(f"record {index} has no reward_model.ground_truth: add the answer there")
        rest = {k: v for k, v in record.items() if k not in ("prompt", "reward_model")}
        return {"data_source": None, **rest, "question": messages[0]["content"],
                "answer": truth if isinstance(truth, str) else json.dumps(truth),
                "extra_info": record.get("extra_info") or {"index": index}}, system
    if "question" in record and isinstance(record.get("answer"), str):  # GSM8K's own files
        found = GSM8K_ANSWER.search(record["answer"])
        if found is None:
            raise PrepareError(f"record {index}: its answer has no '#### <number>' line (GSM8K's final answer)")
        return {"data_source": GSM8K_SOURCE, "question": record["question"],
                "answer": found.group(1).replace(",", "").rstrip("."),
                "extra_info": {"index": index, "solution": record["answer"]}}, None
    raise PrepareError(f"record {index} (fields {sorted(record)}) is neither verl's (a 'prompt' list of messages) "
                       "nor GSM8K's ('question' and 'answer')")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--heldout", type=Path, help="write --heldout-size records drawn at random here")
    parser.add_argument("--heldout-size", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="the held-out draw's seed")
    args = parser.parse_args(argv)
    try:
        if not args.input.is_file():
            raise PrepareError("no such file")
        converted = [convert(record, i) for i, record in enumerate(read(args.input))]
        if (args.heldout is None) != (args.heldout_size == 0) or not 0 <= args.heldout_size < len(converted):
            raise PrepareError(f"--heldout FILE and --heldout-size N (0 < N < {len(converted)}, the records) go "
                               "together")
        systems = {system for _, system in converted}
        if len(systems) > 1:
            raise PrepareError(f"the records have {len(systems)} different system messages; mrl takes one "
                               "(data.system_prompt)")
    except PrepareError as exc:
        print(f"prepare_data.py: {args.input}: {exc}.", file=sys.stderr)
        return 2
    records = [record for record, _ in converted]
    held = set(random.Random(args.seed).sample(range(len(records)), args.heldout_size))
    write(args.output, [r for i, r in enumerate(records) if i not in held])
    print(f"wrote {len(records) - len(held)} records to {args.output}")
    if args.heldout:
        write(args.heldout, [r for i, r in enumerate(records) if i in held])
        print(f"wrote {len(held)} records to {args.heldout}")
    if systems != {None}:
        print(f"set data.chat_template: true and data.system_prompt: {json.dumps(systems.pop())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
