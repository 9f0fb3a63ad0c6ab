"""Run configuration: typed sections, YAML recipes with `base:` inheritance, dotted overrides,
and validation that reports every problem before any worker starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from mrl.config.derived import fill_run_paths
from mrl.config.loading import ConfigError, apply_overrides, build, read_recipe, yaml_key
from mrl.config.schema import RunConfig
from mrl.config.validation import validate

SAVED_NAME = "config.yaml"  # the resolved config in a run's output directory, beside metrics.jsonl


def load_config(path: str | Path, overrides: Sequence[str] = (), check_files: bool = True) -> RunConfig:
    """Read a recipe, apply "section.key=value" overrides, build and validate the RunConfig.

    Raises ConfigError listing every problem found (unknown keys, bad values, layout, resources,
    missing files) at once.
    """
    errors: list[str] = []
    tree = apply_overrides(read_recipe(path), list(overrides), errors)
    cfg = build(RunConfig, tree, errors)
    fill_run_paths(cfg)
    errors += validate(cfg, check_files=check_files)
    if errors:
        raise ConfigError(errors, str(path))
    return cfg


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested dict of a config (for logs and the checkpointed copy of the run's config), with
    the YAML's keys (`async`, not the field's `async_`)."""
    return {yaml_key(name): value for name, value in dataclasses.asdict(cfg).items()}


def save_config(cfg: RunConfig) -> Path:
    """Write the resolved config to OUTPUT_DIR/config.yaml: what `mrl report` shows, and a recipe
    that runs it again. A resumed run rewrites it with the settings it runs with."""
    import yaml

    path = Path(cfg.trainer.output_dir) / SAVED_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return path


__all__ = ["ConfigError", "RunConfig", "SAVED_NAME", "config_to_dict", "load_config", "save_config", "validate"]
