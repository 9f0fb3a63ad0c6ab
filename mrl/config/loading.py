"""YAML recipes with `base:` inheritance, dotted CLI overrides, and typed construction.

A recipe names its base (`base: base.yaml`, relative to the recipe) and holds only what differs;
mappings merge deeply, anything else (lists included) replaces. Overrides are `section.key=value`
strings whose values are parsed according to the field's declared type. Every problem found is
collected, so one run of the loader reports all of them.
"""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

_TRUE, _FALSE, _NULL = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}, {"null", "none", "~"}


class ConfigError(ValueError):
    """Every problem found in a configuration, one line each, naming the key and the fix."""

    def __init__(self, errors: list[str], source: str | None = None) -> None:
        self.errors = list(errors)
        where = f" in {source}" if source else ""
        if len(self.errors) == 1:  # one problem: one line
            super().__init__(f"config error{where}: {self.errors[0]}")
        else:
            super().__init__(f"{len(self.errors)} config errors{where}:\n" + "\n".join(f"  - {e}" for e in self.errors))


def read_recipe(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The recipe at `path` merged onto its chain of bases, as a plain nested dict."""
    path = Path(path).resolve()
    if path in _chain:
        raise ConfigError([f"`base:` chain loops back to {path}: remove the cycle."])
    if not path.is_file():
        raise ConfigError([f"config file {path} not found" + (f" (base of {_chain[-1]})" if _chain else "") + "."])
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path} is not valid YAML: {exc}"]) from None
    if not isinstance(tree, dict):
        raise ConfigError([f"{path} must hold a mapping of sections, not a {type(tree).__name__}."])
    base = tree.pop("base", None)
    if base is None:
        return tree
    return deep_merge(read_recipe(path.parent / base, _chain + (path,)), tree)


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """A new dict: `override` on top of `base`, merging nested mappings key by key."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


class RawOverride(str):
    """A value from the command line: parsed by the field's type, not by YAML rules."""


def apply_overrides(tree: dict[str, Any], overrides: list[str], errors: list[str]) -> dict[str, Any]:
    """A copy of `tree` with each "dotted.key=value" set (malformed ones are added to errors)."""
    tree = deep_merge(tree, {})
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            errors.append(f"override {override!r} must look like section.key=value (e.g. algo.kl_coef=0.01).")
            continue
        *sections, leaf = key.strip().split(".")
        node = tree
        for section in sections:
            child = node.get(section)
            if not isinstance(child, dict):
                child = node[section] = {}
            node = child
        node[leaf] = RawOverride(value.strip())
    return tree


def yaml_key(field_name: str) -> str:
    """A field's key in YAML: a field named after a Python keyword carries a trailing underscore
    (`async_`), its YAML key does not (`async`)."""
    stripped = field_name[:-1] if field_name.endswith("_") else field_name
    return stripped if keyword.iskeyword(stripped) else field_name


def build(cls: type, tree: Any, errors: list[str], prefix: str = "") -> Any:
    """An instance of dataclass `cls` from `tree`, coercing values to the field types."""
    if not isinstance(tree, dict):
        errors.append(f"{prefix.rstrip('.') or 'the config'} must be a mapping of keys, got {_shown(tree)}.")
        return cls()
    hints = typing.get_type_hints(cls)
    field_of = {yaml_key(f.name): f.name for f in dataclasses.fields(cls)}
    names = list(field_of)
    values: dict[str, Any] = {}
    for yaml_name, value in tree.items():
        dotted = f"{prefix}{yaml_name}"
        key = field_of.get(yaml_name, yaml_name)
        if yaml_name not in field_of:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f" - did you mean '{prefix}{close[0]}'?" if close else f" Valid keys here: {', '.join(names)}."
            errors.append(f"unknown key '{dotted}'{hint}")
            continue
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            values[key] = build(kind, value, errors, f"{dotted}.")
            continue
        try:
            values[key] = coerce(value, kind)
        except (TypeError, ValueError) as exc:
            errors.append(f"{dotted}: {exc}")
    return cls(**values)


def coerce(value: Any, kind: Any) -> Any:
    """`value` as type `kind` (int, float, bool, str, Literal, list[...], X | None)."""
    raw = isinstance(value, RawOverride)
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (Union, types.UnionType):
        if value is None or (raw and value.lower() in _NULL):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return coerce(value, inner[0])
    if value is None:
        raise TypeError(f"must be a {_type_name(kind)}, got null")
    if origin is Literal:
        if value not in args:
            raise ValueError(f"must be one of {', '.join(map(repr, args))}, got {_shown(value)}")
        return str(value)
    if origin is list:
        if raw:
            value = yaml.safe_load(value) if value.strip() else []
            if not isinstance(value, list):
                value = [value]
        if not isinstance(value, list):
            raise TypeError(f"must be a list of {_type_name(args[0])}, got {_shown(value)}")
        return [coerce(item, args[0]) for item in value]
    if kind is bool:
        if isinstance(value, bool):
            return value
        if raw and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise TypeError(f"must be true or false, got {_shown(value)}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise TypeError(f"must be an integer, got {_shown(value)}")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads 1e-6 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise TypeError(f"must be a number, got {_shown(value)}")
    if kind is str:
        if isinstance(value, str):
            return str(value)
        raise TypeError(f"must be a string, got {_shown(value)} (quote it in YAML)")
    raise TypeError(f"has unsupported type {kind}")


def _shown(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})" if not isinstance(value, RawOverride) else repr(str(value))


def _type_name(kind: Any) -> str:
    return getattr(kind, "__name__", str(kind))
