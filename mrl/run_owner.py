"""Which run a checkpoint root belongs to, so that no run resumes, prunes or writes another's.

A run writes ROOT/run.json (its name, its output directory, and the settings a resume must keep
for the data order to continue) before its workers start. A later run may use that root only if it
is the same run: the same output directory, or a root inside its own output directory (a run
directory moved or copied whole), with the same settings. Anything else stops before a process
starts, with the fix: starting from another run's checkpoint is `checkpoint.resume=PATH`, which
reads it and writes nothing there. A root of an older mrl (no run.json) is taken over with a note.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import xxhash

from mrl.atomic import atomic_write
from mrl.checkpoint_dir import list_iterations

RUN_FILE = "run.json"
# What the sampler's saved position means: with other data, batch size or seed a resume would not
# continue the run. Layout, learning rate, step count and the rest may change on a resume.
RESUME_SETTINGS = ("trainer.seed", "data.path", "data.synthetic", "data.arithmetic", "data.batch_size")


def identity(config: dict[str, Any]) -> dict[str, Any]:
    """The run a config describes (config_to_dict's form): name, absolute output dir, settings."""
    settings = {key: _get(config, key) for key in RESUME_SETTINGS}
    digest = xxhash.xxh3_64(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    return {"name": config["trainer"]["name"], "output_dir": str(Path(config["trainer"]["output_dir"]).resolve()),
            "settings": settings, "settings_hash": digest}


def _get(config: dict[str, Any], dotted: str) -> Any:
    section, key = dotted.split(".")
    return config[section][key]


def read_owner(root: str | Path) -> dict[str, Any] | None:
    path = Path(root) / RUN_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def holds_checkpoints(root: str | Path) -> bool:
    root = Path(root)
    return any(list_iterations(r) for r in (root, root / "sft", root / "critic"))


def ownership_problem(root: str | Path, ours: dict[str, Any]) -> str | None:
    """Why this run may not use `root` (one line with the fix), or None. Prints a note for a root
    of an older mrl."""
    root = Path(root)
    if not holds_checkpoints(root):
        return None
    owner = read_owner(root)
    if owner is None:
        print(f"note: {root} records no owning run (written by an older mrl): this run takes it over", flush=True)
        return None
    inside = root.resolve().is_relative_to(ours["output_dir"])
    if owner["output_dir"] != ours["output_dir"] and not inside:
        return (f"checkpoint.dir {root} holds the checkpoints of run {owner['name']!r} (output dir "
                f"{owner['output_dir']}), not of this run {ours['name']!r} ({ours['output_dir']}): a run resumes, "
                "prunes and writes only its own; to start from that run on purpose, leave checkpoint.dir unset "
                f"and set checkpoint.resume={root}")
    changed = [f"{key}={owner['settings'].get(key)!r} (now {value!r})" for key, value in ours["settings"].items()
               if owner["settings"].get(key) != value]
    if changed:
        return (f"checkpoint.dir {root} holds this run's checkpoints, trained with {', '.join(changed)}: resuming "
                "with other data settings would not continue it; put them back, or start a new run (another "
                f"trainer.output_dir) with checkpoint.resume={root}")
    return None


def claim(root: str | Path, ours: dict[str, Any]) -> None:
    """Record this run as the root's owner (atomically; before any worker writes there)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write(root / RUN_FILE, lambda f: f.write((json.dumps(ours, indent=1) + "\n").encode()))
