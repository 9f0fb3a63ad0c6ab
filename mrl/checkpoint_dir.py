"""The mrl checkpoint directory contract (docs/checkpoint-format.md), in pure Python.

Shared by the trainer's save/resume, `mrl convert` and `mrl-merge`: atomic iteration directories
(temp dir → fsync → manifest last → rename), the `latest` pointer, resolving a path a user gave
(`locate` also recognises Megatron-LM's own layout, mrl/megatron_lm_dir.py), validating a manifest
against the files on disk (sizes, and xxh3-64 checksums: verify_checksums), pruning old iterations,
the copy of an HF model's non-weight files that a checkpoint keeps under hf/, and a root's owner
(run.json: which run writes there, mrl/run_identity.py).
No torch and no megatron here, so the merge CLI can check a directory before importing either.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import xxhash

from mrl import megatron_lm_dir as mlm
from mrl.atomic import open_modes

FORMAT = "mrl-checkpoint"
VERSION = 1
MANIFEST = "mrl_manifest.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
CHECKSUM = "xxh3_64"  # non-cryptographic: it finds damage (bit flips, torn writes), not tampering
_READ_CHUNK = 16 << 20
_ITER = re.compile(r"^iter_(\d{7,})$")
# Weight files and their indexes: everything else of an HF directory (config, generation config,
# tokenizer) is what a checkpoint needs to be written back as a loadable HF model.
HF_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".index.json")


class CheckpointDirError(ValueError):
    """A path that is not a usable mrl checkpoint directory; the message names the problem and fix."""


def iter_name(step: int) -> str:
    """The iteration directory name for `step`: iter_0000010."""
    return f"iter_{step:07d}"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory below root (directories after their entries)."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def list_files(directory: Path) -> dict[str, int]:
    """Every file below `directory` (relative posix path → size), the manifest excluded."""
    sizes = {}
    for path in sorted(Path(directory).rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            sizes[path.relative_to(directory).as_posix()] = path.stat().st_size
    return sizes


def file_checksum(path: str | os.PathLike) -> str:
    """The file's xxh3-64 digest (hex), read in 16 MiB chunks."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path, checksums: dict[str, str] | None = None, **fields: Any) -> dict:
    """Write mrl_manifest.json listing every file in `directory` with its size and checksum; return
    it. `checksums` (relative path → digest) are those already computed by the processes that wrote
    the files; the others are computed here."""
    files, known = list_files(directory), checksums or {}
    sums = {name: known.get(name) or file_checksum(Path(directory) / name) for name in files}
    manifest = {"format": FORMAT, "version": VERSION, **fields, "files": files,
                "checksums": {"algorithm": CHECKSUM, "files": sums}}
    tmp = Path(directory) / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(directory) / MANIFEST)
    return manifest


@contextmanager
def atomic_dir(target: str | os.PathLike, manifest: dict[str, Any] | None = None) -> Iterator[Path]:
    """Yield a temporary directory beside `target`; on success it becomes `target` atomically.

    On a clean exit every file is fsynced, the manifest (if `manifest` is given: its fields plus the
    file list; the caller may add fields to the dict inside the block) is written last, and the
    directory is renamed into place. On any exception, KeyboardInterrupt included, the temporary
    directory is removed and `target` is left as it was. `target` must not exist.
    """
    target = Path(target)
    if target.exists():
        raise FileExistsError(f"{target} already exists")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f"{TMP_PREFIX}{target.name}-{os.getpid()}"
    if tmp.exists():  # a previous attempt by a process that had our pid
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        open_modes(tmp)  # mkdir honours the umask; safetensors' files are 0600 whatever it says
        _fsync_tree(tmp)
        if manifest is not None:
            write_manifest(tmp, **manifest)
        os.rename(tmp, target)
        _fsync_path(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_latest(root: str | os.PathLike, name: str) -> None:
    """Point ROOT/latest at iteration directory `name` (temp file + rename: never half-written)."""
    root = Path(root)
    if not (root / name / MANIFEST).is_file():
        raise CheckpointDirError(f"cannot point {root / LATEST} at {name}: {root / name} has no {MANIFEST}")
    tmp = root / f"{TMP_PREFIX}{LATEST}-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_path(root)


def read_latest(root: str | os.PathLike) -> str | None:
    """The iteration name ROOT/latest points at, or None without a pointer."""
    path = Path(root) / LATEST
    return path.read_text().strip() if path.is_file() else None


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint root (follows `latest`) or an iteration directory → the iteration directory."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointDirError(f"{path} is not an mrl checkpoint directory: it does not exist or is not a directory")
    if (path / MANIFEST).is_file():
        return path
    latest = read_latest(path)
    if latest is not None:
        target = path / latest
        if not (target / MANIFEST).is_file():
            raise CheckpointDirError(
                f"{path} is not an mrl checkpoint directory: {path / LATEST} points at {latest!r}, which has no "
                f"{MANIFEST}; pass a complete iteration directory instead"
            )
        return target
    iterations = list_iterations(path)
    hint = f"; it holds {iterations[-1][1].name}, pass that" if iterations else ""
    raise CheckpointDirError(
        f"{path} is not an mrl checkpoint directory: it has neither {MANIFEST} nor a {LATEST} pointer{hint}"
    )


@dataclass(frozen=True)
class Located:
    """A checkpoint a user named: an mrl iteration directory, or a Megatron-LM checkpoint."""

    directory: Path  # the iteration directory
    megatron_lm: mlm.MegatronLMCheckpoint | None = None  # None: an mrl checkpoint

    @property
    def kind(self) -> str:
        return "mrl" if self.megatron_lm is None else "Megatron-LM"


def locate(path: str | os.PathLike) -> Located:
    """A checkpoint root or iteration directory of mrl's layout or Megatron-LM's → the iteration
    directory; a path that is neither gets one error naming what each layout would have."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointDirError(f"{path} is not a checkpoint directory: it does not exist or is not a directory")
    if (path / MANIFEST).is_file() or (path / LATEST).is_file():
        return Located(resolve(path))
    if mlm.looks_like(path):
        try:
            return Located((found := mlm.resolve(path)).directory, found)
        except mlm.MegatronLMDirError as err:
            raise CheckpointDirError(str(err)) from None
    iterations = [p for _, p in list_iterations(path)] or [p for p in sorted(path.iterdir()) if _ITER.match(p.name)]
    hint = f"; it holds {iterations[-1].name}, pass that" if iterations else ""
    raise CheckpointDirError(
        f"{path} is not a checkpoint directory: it has neither mrl's {MANIFEST} or {LATEST} pointer nor Megatron-LM's "
        f"{mlm.TRACKER}, metadata.json or mp_rank_* directories{hint}"
    )


def read_manifest(iteration_dir: str | os.PathLike, check_files: bool = True) -> dict:
    """Load and validate mrl_manifest.json; with check_files, every listed file must exist whole."""
    directory = Path(iteration_dir)
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointDirError(f"{directory} is not an mrl checkpoint directory: {MANIFEST} is missing") from None
    except json.JSONDecodeError as err:
        raise CheckpointDirError(f"{path} is not valid JSON ({err}): the checkpoint is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointDirError(f"{path} is not an mrl checkpoint manifest (format is not {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise CheckpointDirError(
            f"{path} has format version {manifest.get('version')!r}; this mrl reads version {VERSION}: "
            "use the mrl release that wrote it"
        )
    if not isinstance(manifest.get("files"), dict):
        raise CheckpointDirError(f"{path} lists no files: the checkpoint is damaged")
    if check_files:
        check_files_present(directory, manifest["files"])
    return manifest


def check_files_present(directory: Path, files: dict[str, int]) -> None:
    """Every listed file exists with its recorded size; the first that does not is named."""
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointDirError(f"checkpoint file {path} is missing: the checkpoint is incomplete; restore it")
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointDirError(
                f"checkpoint file {path} is truncated or damaged: {actual} bytes, manifest says {size}; restore it"
            )


def verify_checksums(directory: str | os.PathLike, manifest: dict) -> str | None:
    """Check every file against the manifest's checksum; the first that differs is named. Returns a
    one-line note for a checkpoint written before mrl recorded checksums (sizes checked only)."""
    directory = Path(directory)
    recorded = manifest.get("checksums")
    if recorded is None:
        return (f"note: {directory} records no checksums (written by an older mrl): its files were checked by "
                "size only")
    if recorded.get("algorithm") != CHECKSUM:
        raise CheckpointDirError(f"{directory / MANIFEST} records {recorded.get('algorithm')!r} checksums; this mrl "
                                 f"checks {CHECKSUM}: use the mrl release that wrote it")
    for name, expected in recorded["files"].items():
        actual = file_checksum(directory / name)
        if actual != expected:
            raise CheckpointDirError(
                f"checkpoint file {directory / name} is damaged: its {CHECKSUM} checksum is {actual}, the manifest "
                f"says {expected}; restore it from a copy, or resume from an earlier iteration")
    return None


def list_iterations(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete iteration directories under root (those with a manifest), oldest first."""
    found = []
    for child in Path(root).iterdir() if Path(root).is_dir() else ():
        m = _ITER.match(child.name)
        if m and child.is_dir() and (child / MANIFEST).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def prune(root: str | os.PathLike, keep: int) -> list[Path]:
    """Remove all but the newest `keep` iterations (never the one `latest` names); return removed."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    latest = read_latest(root)
    removed = []
    for _step, path in list_iterations(root)[:-keep]:
        if path.name != latest:
            shutil.rmtree(path)
            removed.append(path)
    return removed


def remove_stale_tmp(root: str | os.PathLike) -> list[Path]:
    """Remove `.tmp-*` leftovers of interrupted saves under root (call before a new save)."""
    removed = []
    for child in Path(root).glob(f"{TMP_PREFIX}*") if Path(root).is_dir() else ():
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
        removed.append(child)
    return removed


def copy_hf_metadata(hf_dir: str | os.PathLike, out: str | os.PathLike) -> list[str]:
    """Copy an HF directory's non-weight files into out; return their names.

    config.json loses `quantization_config`: weights that travel with this copy are never the FP8
    originals (mrl holds and writes them dequantised), and a loader reading that key would take
    them for FP8.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(Path(hf_dir).iterdir()):
        if not path.is_file() or path.name.endswith(HF_WEIGHT_SUFFIXES):
            continue
        if path.name == "config.json":
            config = json.loads(path.read_text())
            config.pop("quantization_config", None)
            (out / path.name).write_text(json.dumps(config, indent=2) + "\n")
        else:
            shutil.copy2(path, out / path.name)
        copied.append(path.name)
    return copied
