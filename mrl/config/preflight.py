"""The checks that read what a run will use, before anything starts (validate, with check_files).

Every record of the prompt files (mrl/data/checks.py), the custom reward's code (imported in a
spawned process and its signature checked: mrl's or verl's, docs/rewards.md), and the output
directories (a file is created and removed where the run will write). Each problem is one line
naming the key, the file and the fix, as the rest of validation.py; what the cheaper checks there
already name (a missing file, an unknown reward) is left to them.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

from mrl.config.schema import RunConfig


def preflight(cfg: RunConfig) -> list[str]:
    return _check_records(cfg) + _check_reward_code(cfg) + _check_writable(cfg)


def _check_records(cfg: RunConfig) -> list[str]:
    from mrl.data import DataError, PromptTemplate
    from mrl.data.checks import Need, records_problem
    from mrl.rewards import NEEDS_ANSWER

    data = cfg.data
    if data.synthetic:
        return []
    try:
        fields = PromptTemplate(data.template).fields()
    except DataError as exc:
        return [f"data.template: {exc}"]
    needs = {name: Need("data.template uses it", "add it to every record, or change data.template") for name in fields}
    answer_why = (f"reward {cfg.reward.name} compares responses with it" if cfg.reward.name in NEEDS_ANSWER
                  else "trainer.sft_steps trains on it" if cfg.trainer.sft_steps > 0 else None)
    errors = []
    for key in ("path", "heldout_path"):
        path = getattr(data, key)
        if not _readable(path):  # validation's _check_files names it
            continue
        file_needs = dict(needs)
        if answer_why and (key == "path" or cfg.reward.name in NEEDS_ANSWER):
            file_needs.setdefault(data.answer_key, Need(f"data.answer_key: {answer_why}", "add it to every record, or "
                                                        "set data.answer_key to the field that holds the answer"))
        if data.sft_key and key == "path" and cfg.trainer.sft_steps > 0:
            file_needs.setdefault(data.sft_key, Need("data.sft_key: trainer.sft_steps trains on it", "add it to every "
                                                     "record, or set data.sft_key to null to train on the answer"))
        problem = records_problem(key, path, file_needs, PromptTemplate(data.template, data.chat_template))
        if problem:
            errors.append(problem)
    return errors


def _readable(path: str | None) -> bool:
    if path is None or not Path(path).is_file() or Path(path).suffix not in (".jsonl", ".parquet"):
        return False
    return Path(path).suffix == ".jsonl" or importlib.util.find_spec("pyarrow") is not None


def _check_reward_code(cfg: RunConfig) -> list[str]:
    """A custom reward (module:function, file.py:function) is imported as its workers will import it."""
    from mrl.rewards import REWARD_FUNCTIONS
    from mrl.rewards.sandbox import RewardLoadError, load_problem, parse_spec

    name = cfg.reward.name
    if name in REWARD_FUNCTIONS or ":" not in name:
        return []
    try:
        target, _ = parse_spec(name)
    except RewardLoadError:  # validation's _check_reward names it
        return []
    if not target.endswith(".py") and importlib.util.find_spec(target.split(".")[0]) is None:
        return []
    problem = load_problem(name)
    return [f"reward.name: {problem}"] if problem else []


def _check_writable(cfg: RunConfig) -> list[str]:
    """trainer.output_dir and checkpoint.dir: each, or the nearest directory above it that exists
    (where the run's mkdir will write), takes a new file."""
    errors, failed = [], set()
    for key, path in (("trainer.output_dir", cfg.trainer.output_dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        where, problem = _write_problem(Path(path))
        if problem and where not in failed:  # one line for one read-only directory
            failed.add(where)
            errors.append(f"{key} {path} {problem}")
    return errors


def _write_problem(path: Path) -> tuple[Path, str | None]:
    where = path
    while not where.exists() and where.parent != where:
        where = where.parent
    if not where.is_dir():
        return where, ("is a file, not a directory: choose another path." if where == path else
                       f"cannot be created: {where} is a file, not a directory: choose another path.")
    try:
        handle, probe = tempfile.mkstemp(dir=where, prefix=".mrl-write-check-")
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        return where, (f"is not writable: creating a file in {where} failed ({exc.strerror}): choose a directory "
                       "you can write, or fix its permissions.")
    return where, None
