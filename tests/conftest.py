"""Shared fixtures: tiny HF models of every supported architecture, written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(arch) → Path of a tiny random HF model directory (cached per session)."""
    from mrl.models.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("tiny-zoo")
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = write_tiny_model(arch, root / arch)
        return cache[arch]

    return get
