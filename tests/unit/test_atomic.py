"""Files written atomically get the modes a plain open() or mkdir() would give under the umask."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from mrl.atomic import atomic_write, umask
from mrl.checkpoint_dir import atomic_dir


@pytest.fixture(params=[0o022, 0o027])
def mask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_umask_is_read_without_changing_it(mask):
    assert umask() == mask and umask() == mask


def test_an_atomic_write_has_the_mode_open_gives(tmp_path, mask):
    plain, atomic = tmp_path / "plain.txt", tmp_path / "report.html"
    plain.write_text("x")
    atomic_write(atomic, lambda f: f.write(b"<html></html>"))
    assert atomic.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777 == 0o666 & ~mask
    assert atomic.read_bytes() == b"<html></html>"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_an_atomic_directory_of_safetensors_is_readable_as_the_umask_says(tmp_path, mask):
    """safetensors writes its files 0600 whatever the umask: a merged model others could not read."""
    target = tmp_path / "hf"
    with atomic_dir(target) as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        (tmp / "sub").mkdir()
        (tmp / "sub" / "config.json").write_text("{}")
    assert target.stat().st_mode & 0o777 == (target / "sub").stat().st_mode & 0o777 == 0o777 & ~mask
    for name in ("model.safetensors", "sub/config.json"):
        assert (target / name).stat().st_mode & 0o777 == 0o666 & ~mask, name
