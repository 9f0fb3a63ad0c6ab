"""The checkpoint directory contract: atomic saves, latest pointer, resolve, manifest checks, pruning."""

import json

import pytest

from mrl import checkpoint_dir as cd


def save(root, step, payload=b"abc"):
    with cd.atomic_dir(root / cd.iter_name(step), manifest={"step": step, "arch": "llama"}) as tmp:
        (tmp / "__0_0.distcp").write_bytes(payload)
        (tmp / "hf").mkdir()
        (tmp / "hf" / "config.json").write_text("{}")
    cd.write_latest(root, cd.iter_name(step))
    return root / cd.iter_name(step)


def test_atomic_save_writes_manifest_with_sizes_and_latest(tmp_path):
    it = save(tmp_path, 10, b"12345")
    manifest = cd.read_manifest(it)
    assert manifest["format"] == "mrl-checkpoint" and manifest["version"] == 1 and manifest["step"] == 10
    assert manifest["files"] == {"__0_0.distcp": 5, "hf/config.json": 2}
    assert (tmp_path / "latest").read_text().strip() == "iter_0000010"
    assert cd.resolve(tmp_path) == it and cd.resolve(it) == it
    assert not list(tmp_path.glob(".tmp-*"))


def test_failed_save_leaves_nothing(tmp_path):
    save(tmp_path, 1)
    with pytest.raises(KeyboardInterrupt):
        with cd.atomic_dir(tmp_path / cd.iter_name(2), manifest={"step": 2}) as tmp:
            (tmp / "__0_0.distcp").write_bytes(b"partial")
            raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "latest"]
    assert cd.resolve(tmp_path).name == "iter_0000001"


def test_existing_target_refused(tmp_path):
    save(tmp_path, 1)
    with pytest.raises(FileExistsError):
        with cd.atomic_dir(tmp_path / cd.iter_name(1)):
            pass


def test_resolve_rejects_non_checkpoints(tmp_path):
    with pytest.raises(cd.CheckpointDirError, match="is not an mrl checkpoint directory: it does not exist"):
        cd.resolve(tmp_path / "nope")
    with pytest.raises(cd.CheckpointDirError, match="neither mrl_manifest.json nor a latest pointer"):
        cd.resolve(tmp_path)
    (tmp_path / "latest").write_text("iter_0000005\n")
    with pytest.raises(cd.CheckpointDirError, match="points at 'iter_0000005'"):
        cd.resolve(tmp_path)


def test_manifest_detects_missing_and_truncated_files(tmp_path):
    it = save(tmp_path, 3, b"0123456789")
    (it / "__0_0.distcp").write_bytes(b"01234")
    with pytest.raises(cd.CheckpointDirError, match=r"__0_0.distcp is truncated or damaged: 5 bytes, manifest says 10"):
        cd.read_manifest(it)
    (it / "__0_0.distcp").unlink()
    with pytest.raises(cd.CheckpointDirError, match=r"__0_0.distcp is missing"):
        cd.read_manifest(it)
    assert cd.read_manifest(it, check_files=False)["step"] == 3


def test_manifest_format_and_version_checked(tmp_path):
    it = save(tmp_path, 1)
    manifest = json.loads((it / cd.MANIFEST).read_text())
    (it / cd.MANIFEST).write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(cd.CheckpointDirError, match="format version 99"):
        cd.read_manifest(it)
    (it / cd.MANIFEST).write_text(json.dumps({**manifest, "format": "other"}))
    with pytest.raises(cd.CheckpointDirError, match="not an mrl checkpoint manifest"):
        cd.read_manifest(it)
    (it / cd.MANIFEST).write_text("{")
    with pytest.raises(cd.CheckpointDirError, match="not valid JSON"):
        cd.read_manifest(it)


def test_prune_keeps_newest_and_latest(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step)
    (tmp_path / "iter_0000009").mkdir()  # no manifest: not a complete iteration, not listed
    removed = cd.prune(tmp_path, keep=2)
    assert [p.name for p in removed] == ["iter_0000001", "iter_0000002"]
    assert [p.name for _, p in cd.list_iterations(tmp_path)] == ["iter_0000003", "iter_0000004"]
    cd.write_latest(tmp_path, "iter_0000003")
    save(tmp_path, 5)
    cd.write_latest(tmp_path, "iter_0000003")  # e.g. a resumed run that points back
    cd.prune(tmp_path, keep=1)
    assert [p.name for _, p in cd.list_iterations(tmp_path)] == ["iter_0000003", "iter_0000005"]


def test_remove_stale_tmp(tmp_path):
    save(tmp_path, 1)
    (tmp_path / ".tmp-iter_0000002-999").mkdir()
    (tmp_path / ".tmp-iter_0000002-999" / "x").write_bytes(b"1")
    (tmp_path / ".tmp-latest-999").write_text("x")
    assert len(cd.remove_stale_tmp(tmp_path)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "latest"]


def test_write_latest_refuses_incomplete_iteration(tmp_path):
    (tmp_path / "iter_0000001").mkdir()
    with pytest.raises(cd.CheckpointDirError, match="has no mrl_manifest.json"):
        cd.write_latest(tmp_path, "iter_0000001")


def test_vpp_chunks_nest_apart_and_unnest_in_order():
    from mrl.megatron.checkpoint import nest_chunks, unnest_chunks

    one, two = {"decoder.layers.0.w": 1}, {"decoder.layers.0.w": 2}  # local keys repeat across chunks
    assert nest_chunks([one]) is one and unnest_chunks(one, 1) == [one]
    assert nest_chunks([one, two]) == {"chunk0": one, "chunk1": two}
    assert unnest_chunks(nest_chunks([one, two]), 2) == [one, two]
