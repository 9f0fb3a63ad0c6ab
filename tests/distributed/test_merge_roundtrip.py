"""HF → mrl checkpoint (torch_dist, every layout) → mrl-merge → HF, bitwise; and each bad input.

All conversions run in ONE 4-process gloo world (architectures and layouts in turn, Megatron's
groups rebuilt for each), so the module pays process start-up once. Merges run in this process:
the merge CLI needs no process group.
"""

from __future__ import annotations

import contextlib
import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoints_tools import merge as merge_mod
from mrl.cli.merge import main as merge_main
from checkpoints_tools.convert import checkpoint_manifest, copy_hf_metadata
from mrl import checkpoint_dir as cd
from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local

WORLD = 4
DENSE = {"TP2": ParallelLayout(tp=2), "PP2": ParallelLayout(pp=2), "TP2xPP2": ParallelLayout(tp=2, pp=2)}
MOE = DENSE | {"EP2": ParallelLayout(ep=2), "EP2xTP2": ParallelLayout(ep=2, tp=2)}
CASES = {
    "llama": DENSE | {"PP2xVPP2": ParallelLayout(pp=2, vpp=2)},
    "qwen2": DENSE,
    "qwen3": DENSE,
    "qwen3_moe": MOE,
    "deepseek_v3": MOE,
}


def _convert_all(rank: int, world: int, jobs: list[tuple[str, ParallelLayout, str]]) -> int:
    from checkpoints_tools.convert import save_model_checkpoint

    return sum(save_model_checkpoint(hf, layout, torch.float32, out) for hf, layout, out in jobs)


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(arch, layout name) → checkpoint root, every one written in the one shared world."""
    base = tmp_path_factory.mktemp("ckpts")
    roots, jobs = {}, []
    with contextlib.ExitStack() as stack:
        tmps = []
        for arch, layouts in CASES.items():
            hf = tiny_model_dir(arch)
            for name, layout in layouts.items():
                root = base / f"{arch}-{name}"
                target = root / cd.iter_name(0)
                tmp = stack.enter_context(cd.atomic_dir(target, manifest=checkpoint_manifest(arch, layout, torch.float32)))
                jobs.append((str(hf), layout, str(tmp)))
                tmps.append((tmp, hf))
                roots[arch, name] = root
        run_local(_convert_all, WORLD, jobs, timeout_s=600)
        for tmp, hf in tmps:
            copy_hf_metadata(hf, tmp / "hf")
    for root in roots.values():
        cd.write_latest(root, cd.iter_name(0))
    return roots


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("arch,layout", [(a, n) for a, ls in CASES.items() for n in ls])
def test_roundtrip_bitwise_fp32(arch, layout, checkpoints, tiny_model_dir, tmp_path):
    out = tmp_path / "hf"
    summary = merge_mod.merge(checkpoints[arch, layout], out, progress=False)  # the checkpoint's own dtype: fp32
    original, merged = _tensors(tiny_model_dir(arch)), _tensors(out)
    assert sorted(merged) == sorted(original)
    for name, tensor in original.items():
        assert merged[name].dtype == torch.float32
        assert torch.equal(merged[name], tensor), name
    assert summary["tensors"] == len(original) and summary["dtype"] == "fp32"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors.index.json"):
        assert (out / name).is_file(), name


def test_dtype_bf16_narrows_and_keeps_expert_bias_fp32(checkpoints, tiny_model_dir, tmp_path):
    out = tmp_path / "hf"
    merge_mod.merge(checkpoints["deepseek_v3", "EP2xTP2"], out, dtype="bf16", progress=False)
    original, merged = _tensors(tiny_model_dir("deepseek_v3")), _tensors(out)
    biases = [n for n in original if n.endswith("e_score_correction_bias")]
    assert biases
    for name, tensor in original.items():
        want = tensor.float() if name in biases else tensor.to(torch.bfloat16)
        assert merged[name].dtype == want.dtype and torch.equal(merged[name], want), name


def test_multi_shard_index_and_workers(checkpoints, tiny_model_dir, tmp_path):
    out = tmp_path / "hf"
    summary = merge_mod.merge(checkpoints["qwen3_moe", "EP2xTP2"], out, dtype="fp32", max_shard_size="200KB",
                              workers=3, progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == summary["shards"] > 3
    assert files == sorted(p.name for p in out.glob("*.safetensors"))
    for file in files:
        names = set(load_file(out / file))
        assert names == {n for n, f in index["weight_map"].items() if f == file}
        assert (out / file).stat().st_size <= 200_000 + 64 * 1024  # header slack; one tensor < limit
    original = _tensors(tiny_model_dir("qwen3_moe"))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    merged = _tensors(out)
    assert all(torch.equal(merged[n], t) for n, t in original.items())


def test_verify_cli(checkpoints, tmp_path, capsys):
    rc = merge_main([str(checkpoints["qwen3_moe", "TP2xPP2"]), "--out", str(tmp_path / "hf"), "--verify",
                         "--no-progress"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["verify"]["ok"], summary
    assert summary["verify"]["max_abs_diff"] <= 1e-4


# ------------------------------------------------------------------------------------- bad input
def _copy(root: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(root, dst)
    return dst


def _fails(capsys, argv: list[str], match: str) -> None:
    rc = merge_main(argv + ["--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and match in err, err


def test_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "junk").mkdir()
    _fails(capsys, [str(tmp_path / "junk"), "--out", str(tmp_path / "o")],
           "is not a checkpoint directory: it has neither mrl's")
    assert not (tmp_path / "o").exists()


def test_flipped_missing_and_truncated_distcp(checkpoints, tmp_path, capsys):
    root = _copy(checkpoints["qwen3", "TP2"], tmp_path)
    distcp = sorted((root / "iter_0000000").glob("*.distcp"))[0]
    data = distcp.read_bytes()
    flipped = bytearray(data)
    flipped[-400:] = bytes(b ^ 0x5A for b in flipped[-400:])  # a few hundred bytes, the size unchanged
    distcp.write_bytes(bytes(flipped))
    _fails(capsys, [str(root), "--out", str(tmp_path / "o")], f"{distcp.name} is damaged: its xxh3_64 checksum is")
    distcp.write_bytes(data[: len(data) // 2])
    _fails(capsys, [str(root), "--out", str(tmp_path / "o")], f"{distcp.name} is truncated or damaged")
    distcp.unlink()
    _fails(capsys, [str(root), "--out", str(tmp_path / "o")], f"{distcp.name} is missing")
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob("o*"))


def test_other_architecture_config(checkpoints, tiny_model_dir, tmp_path, capsys):
    for flag in ("--hf-config", "--config"):  # --config: the flag's earlier name, still accepted
        _fails(capsys, [str(checkpoints["qwen3", "TP2"]), "--out", str(tmp_path / "o"),
                        flag, str(tiny_model_dir("llama") / "config.json")],
               "is a qwen3 checkpoint but the config")
    assert not (tmp_path / "o").exists()


def test_existing_output_needs_force(checkpoints, tmp_path, capsys):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep").write_text("x")
    _fails(capsys, [str(checkpoints["qwen3", "TP2"]), "--out", str(tmp_path / "o")], "pass --force")
    assert (tmp_path / "o" / "keep").read_text() == "x"
    assert merge_main([str(checkpoints["qwen3", "TP2"]), "--out", str(tmp_path / "o"), "--force",
                           "--no-progress"]) == 0
    assert not (tmp_path / "o" / "keep").exists() and (tmp_path / "o" / "config.json").is_file()


def test_disk_full_leaves_nothing(checkpoints, tmp_path, capsys, monkeypatch):
    calls = []

    def full_disk(tensors, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        merge_mod.save_file(tensors, str(path))

    monkeypatch.setattr(merge_mod, "write_shard", full_disk)
    _fails(capsys, [str(checkpoints["llama", "TP2"]), "--out", str(tmp_path / "o"), "--max-shard-size", "100KB"],
           "No space left on device")
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_metadata_is_never_unpickled_blindly(checkpoints, tmp_path, capsys):
    import os
    import pickle

    root = _copy(checkpoints["qwen3", "TP2"], tmp_path)
    iteration = root / "iter_0000000"
    manifest = json.loads((iteration / cd.MANIFEST).read_text())
    (iteration / ".metadata").write_bytes(pickle.dumps(os.getcwd))  # any callable a pickle may smuggle
    cd.write_manifest(iteration, **{k: v for k, v in manifest.items() if k not in ("format", "version", "files")})
    _fails(capsys, [str(root), "--out", str(tmp_path / "o")], "refers to posix.getcwd")
    assert not (tmp_path / "o").exists()
