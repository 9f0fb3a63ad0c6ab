"""Megatron-LM's checkpoint directories recognised (mrl/megatron_lm_dir.py, checkpoint_dir.locate),
and what each missing piece is called; its pickles read without running anything they name.
The files here are empty stand-ins: only names and layout matter to these functions."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from mrl import checkpoint_dir as cd
from mrl import megatron_lm_dir as mlm


def _torch_dist(directory: Path, *, common: bool = True, metadata: bool = True) -> Path:
    directory.mkdir(parents=True)
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                         "common_backend": "torch", "common_backend_version": 1}))
    for name, wanted in (("common.pt", common), (".metadata", metadata), ("__0_0.distcp", True)):
        if wanted:
            (directory / name).write_bytes(b"x")
    return directory


def _legacy(directory: Path, ranks: list[str]) -> Path:
    for rank in ranks:
        (directory / rank).mkdir(parents=True)
        (directory / rank / mlm.RANK_FILE).write_bytes(b"x")
    return directory


def test_root_follows_the_tracker(tmp_path):
    _torch_dist(tmp_path / "iter_0000100")
    _torch_dist(tmp_path / "iter_0000050")
    (tmp_path / mlm.TRACKER).write_text("100")  # Megatron-LM writes no newline
    found = cd.locate(tmp_path)
    assert found.directory == tmp_path / "iter_0000100" and found.kind == "Megatron-LM"
    assert found.megatron_lm == mlm.MegatronLMCheckpoint(tmp_path / "iter_0000100", 100, "torch_dist")
    assert cd.locate(tmp_path / "iter_0000050").megatron_lm.iteration == 50  # an iteration directory itself


def test_release_and_legacy(tmp_path):
    _legacy(tmp_path / "release", ["mp_rank_00_000", "mp_rank_00_001"])
    (tmp_path / mlm.TRACKER).write_text("release")
    found = mlm.resolve(tmp_path)
    assert (found.directory.name, found.iteration, found.format) == ("release", None, "torch")
    # The same names mean PP ranks with PP on and EP off, EP ranks the other way round.
    assert sorted(mlm.rank_dirs(found.directory, pipeline=True, expert=False)) == [(0, 0, 0), (0, 1, 0)]
    assert sorted(mlm.rank_dirs(found.directory, pipeline=False, expert=True)) == [(0, 0, 0), (0, 0, 1)]
    with pytest.raises(mlm.MegatronLMDirError, match="does not fit the checkpoint's args"):
        mlm.rank_dirs(found.directory, pipeline=True, expert=True)


def test_an_mrl_checkpoint_is_still_mrl(tmp_path):
    iteration = _torch_dist(tmp_path / cd.iter_name(3))  # torch_dist files too, but a manifest
    cd.write_manifest(iteration, step=3)
    cd.write_latest(tmp_path, iteration.name)
    assert cd.locate(tmp_path) == cd.Located(iteration) and cd.locate(tmp_path).kind == "mrl"


def _tracker_names_a_lost_iteration(d: Path) -> None:
    (d / mlm.TRACKER).write_text("200")
    _torch_dist(d / "iter_0000100")


def _tracker_is_junk(d: Path) -> None:
    (d / mlm.TRACKER).write_text("banana")


def _legacy_rank_file_lost(d: Path) -> None:
    _legacy(d / "iter_0000001", ["mp_rank_00", "mp_rank_01"])
    os.remove(d / "iter_0000001" / "mp_rank_01" / mlm.RANK_FILE)


def _torch_dcp(d: Path) -> None:
    (d / "iter_0000001").mkdir()
    (d / "iter_0000001" / ".metadata").write_bytes(b"x")


def _zarr(d: Path) -> None:
    (d / "iter_0000001").mkdir()
    (d / "iter_0000001" / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))


@pytest.mark.parametrize("build,match", [
    (_tracker_names_a_lost_iteration,
     "latest_checkpointed_iteration.txt names iter_0000200, but .* does not exist; it holds iter_0000100"),
    (_tracker_is_junk, "not an iteration number or 'release'"),
    (lambda d: _torch_dist(d / "iter_0000001", common=False), "lacks common.pt: the save did not finish"),
    (lambda d: _torch_dist(d / "iter_0000001", metadata=False), "lacks .metadata"),
    (_legacy_rank_file_lost, "lacks mp_rank_01/model_optim_rng.pt"),
    (_torch_dcp, "torch_dcp or fsdp_dtensor checkpoint .* --ckpt-format torch_dist"),
    (_zarr, "'zarr' backend"),
])
def test_what_is_missing_is_named(tmp_path, build, match):
    build(tmp_path)
    target = tmp_path if (tmp_path / mlm.TRACKER).exists() else tmp_path / "iter_0000001"
    with pytest.raises(cd.CheckpointDirError, match=match) as err:
        cd.locate(target)
    assert len(str(err.value).splitlines()) == 1


def test_neither_layout(tmp_path):
    (tmp_path / "iter_0000007").mkdir()
    with pytest.raises(cd.CheckpointDirError, match="neither mrl's mrl_manifest.json or latest pointer nor "
                                                    "Megatron-LM's latest_checkpointed_iteration.txt.*holds iter_0000007"):
        cd.locate(tmp_path)


class _Evil:
    """What a hostile pickle smuggles: a call made while unpickling."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_pickles_are_read_without_running_what_they_name(tmp_path):
    from checkpoints_tools.megatron_lm import Opaque, load_pickled

    target = tmp_path / "pwned"
    path = tmp_path / "common.pt"
    args = argparse.Namespace(hidden_size=64, params_dtype=torch.bfloat16, hook=_Evil(str(target)))
    torch.save({"args": args, "weights": torch.arange(6.0).view(2, 3)}, path)
    loaded = load_pickled(path)
    assert not target.exists()  # os.mkdir was never called
    assert isinstance(loaded["args"].hook, Opaque) and loaded["args"].hook.qualname == "posix.mkdir"
    assert loaded["args"].hidden_size == 64 and loaded["args"].params_dtype is torch.bfloat16
    assert torch.equal(loaded["weights"], torch.arange(6.0).view(2, 3))
