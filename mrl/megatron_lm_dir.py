"""The checkpoint directories Megatron-LM's training loop writes, in pure Python (no torch).

Facts from Megatron-LM's megatron/training/checkpointing.py (core_v0.16.1 and main of 2026-08):
```
ROOT/latest_checkpointed_iteration.txt   the tracker: the newest iteration as text ("100"), or "release"
ROOT/iter_0000100/                       one checkpoint, `iter_{iteration:07d}` ("release/" for a release)
  torch_dist (the default --ckpt-format): metadata.json ({"sharded_backend": "torch_dist", ...}: what
    marks the format), common.pt (the non-sharded entries: args, iteration, checkpoint_version, ...),
    .metadata and __{rank}_{i}.distcp (the sharded tensors, torch DCP)
  torch (legacy --ckpt-format torch): mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt, one
    file per model-parallel rank; _{pp} only with PP > 1, _{ep} only with EP > 1
```
Nothing here reads a pickle: this module only finds directories and files (torch_dcp and fsdp_dtensor
ones are refused in `detect_format`), so a configuration can be checked before torch is imported.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
RANK_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_ITER = re.compile(r"^iter_(\d{7,})$")
_FIX_FORMAT = "re-save it with Megatron-LM's --ckpt-format torch_dist (or torch)"


class MegatronLMDirError(ValueError):
    """A Megatron-LM checkpoint that cannot be read; the message names what is missing and the fix."""


@dataclass(frozen=True)
class MegatronLMCheckpoint:
    """One iteration directory of a Megatron-LM checkpoint and its format."""

    directory: Path
    iteration: int | None  # None for a release checkpoint
    format: str  # "torch_dist" or "torch"


def looks_like(path: str | Path) -> bool:
    """Whether `path` is a Megatron-LM checkpoint root (a tracker file) or iteration directory."""
    path = Path(path)
    return (path / TRACKER).is_file() or (path / "metadata.json").is_file() or bool(_rank_dir_list(path)) \
        or _ITER.match(path.name) is not None and (path / ".metadata").is_file()


def resolve(path: str | Path) -> MegatronLMCheckpoint:
    """A checkpoint root (follows the tracker file) or an iteration directory → the checkpoint."""
    path = Path(path)
    if (path / TRACKER).is_file():
        name = _tracked_name(path)
        target = path / name
        if not target.is_dir():
            found = _iterations(path)
            hint = f"; it holds {found[-1].name}, pass that directory" if found else ""
            raise MegatronLMDirError(f"{path / TRACKER} names {name}, but {target} does not exist{hint}")
        return _checkpoint(target)
    return _checkpoint(path)


def _tracked_name(root: Path) -> str:
    text = (root / TRACKER).read_text().strip()
    if text == RELEASE:
        return RELEASE
    if not text.isdigit():
        raise MegatronLMDirError(f"{root / TRACKER} holds {text!r}, not an iteration number or 'release': the "
                                 "checkpoint is damaged; pass an iteration directory instead")
    return f"iter_{int(text):07d}"


def _iterations(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if _ITER.match(p.name) and p.is_dir())


def _checkpoint(directory: Path) -> MegatronLMCheckpoint:
    m = _ITER.match(directory.name)
    iteration = int(m.group(1)) if m else None
    return MegatronLMCheckpoint(directory, iteration, detect_format(directory))


def detect_format(directory: Path) -> str:
    """"torch_dist" or "torch" for a complete iteration directory; otherwise an error naming what is missing."""
    if (directory / "metadata.json").is_file():
        backend = json.loads((directory / "metadata.json").read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise MegatronLMDirError(f"{directory} was saved with the {backend!r} backend, which is not read: {_FIX_FORMAT}")
        missing = [name for name in ("common.pt", ".metadata") if not (directory / name).is_file()]
        if missing:
            raise MegatronLMDirError(f"torch_dist checkpoint {directory} lacks {' and '.join(missing)}: the save did not "
                                     "finish or files were lost; restore them or pass another iteration")
        return "torch_dist"
    ranks = _rank_dir_list(directory)
    if ranks:
        missing = [d.name for d in ranks if not (d / RANK_FILE).is_file()]
        if missing:
            raise MegatronLMDirError(f"legacy checkpoint {directory} lacks {missing[0]}/{RANK_FILE}"
                                     f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: restore it")
        return "torch"
    if (directory / ".metadata").is_file():
        raise MegatronLMDirError(f"{directory} is a torch_dcp or fsdp_dtensor checkpoint (.metadata without "
                                 f"metadata.json), which is not read: {_FIX_FORMAT}")
    raise MegatronLMDirError(f"{directory} holds no Megatron-LM checkpoint: it has no metadata.json (torch_dist) and "
                             f"no mp_rank_*/{RANK_FILE} (torch); pass the checkpoint root or an iter_* directory")


def _rank_dir_list(directory: Path) -> list[Path]:
    return sorted(c for c in Path(directory).iterdir() if _RANK_DIR.match(c.name) and c.is_dir()) \
        if Path(directory).is_dir() else []


def rank_dirs(directory: Path, pipeline: bool, expert: bool) -> dict[tuple[int, int, int], Path]:
    """Legacy format: (tp, pp, ep) rank → its mp_rank_* directory. The name alone is ambiguous
    (mp_rank_00_001 is PP rank 1 without EP, or EP rank 1 without PP): the checkpoint's args say
    whether PP (`pipeline`) and EP (`expert`) were on."""
    found = {}
    for child in _rank_dir_list(directory):
        numbers = [int(g) for g in _RANK_DIR.match(child.name).groups() if g is not None]
        if len(numbers) != 1 + pipeline + expert:
            raise MegatronLMDirError(
                f"{child} does not fit the checkpoint's args (pipeline parallel: {pipeline}, expert parallel: "
                f"{expert}): its files come from another run; remove it or pass the matching checkpoint")
        tp, pp, ep = numbers[0], numbers[1] if pipeline else 0, numbers[-1] if expert else 0
        found[tp, pp, ep] = child
    return found
