"""Training checkpoints (mrl.megatron.checkpoint): resume equality, resharding, pruning, crash safety.

Every world is 2 gloo processes. A run trains 4 steps on fixed batches and saves at step 2; a
fresh world loads that checkpoint and trains steps 3-4, whose losses must equal the uninterrupted
run's bitwise (same layout, CPU). Loading onto another layout must give the same model tensors
(bridge export) and the same optimizer state (Megatron's plain tensors of a re-save), and close
next-step losses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mrl import checkpoint_dir as cd
from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local

STEPS = 4
SAVE_AT = 2
TIMEOUT_S = 240


def _setup(hf_dir: str, layout: ParallelLayout):
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import initialize_layout
    from mrl.megatron.training import OptimConfig, make_trainable
    from mrl.models.registry import model_spec_from_hf

    coords = initialize_layout(layout)
    spec = model_spec_from_hf(hf_dir)
    built = build_model(spec, layout)
    load_hf_weights(built, coords, hf_dir)
    trainable = make_trainable(built, OptimConfig(lr=1e-3, warmup_steps=1, schedule="cosine", total_steps=10))
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, spec.vocab_size, (4, 17), generator=generator) for _ in range(STEPS)]
    return coords, trainable, batches


def _step(trainable, tokens) -> float | None:
    from mrl.megatron.training import lm_micro_batches, train_step

    result = train_step(trainable, lm_micro_batches(tokens, trainable.built.layout.tp))
    assert not result.skipped
    return result.loss


def _dense_uninterrupted(rank: int, world: int, hf_dir: str, layout: ParallelLayout, roots: dict) -> dict:
    from mrl.bridge.export import iter_hf_weights
    from mrl.megatron.checkpoint import save_checkpoint

    coords, trainable, batches = _setup(hf_dir, layout)
    losses, exported, pending = [], None, None
    for step, tokens in enumerate(batches, start=1):
        losses.append(_step(trainable, tokens))
        if pending is not None:
            pending.wait()  # the step above ran while the async write was in flight
            pending = None
        if step == SAVE_AT:
            kwargs = dict(step=step, data_state={"position": step}, config={"lr": 1e-3}, hf_dir=hf_dir)
            save_checkpoint(roots["sync"], trainable, **kwargs)
            pending = save_checkpoint(roots["async"], trainable, async_save=True, **kwargs)
            exported = dict(iter_hf_weights(trainable.built, coords))
    return {"losses": losses, "exported": exported if rank == 0 else None}


def _flatten(tree: dict | list, prefix: str = "") -> dict:
    flat = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in items:
        if isinstance(value, (dict, list, tuple)):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return type(a) is type(b) and a == b


def _resume(rank: int, world: int, hf_dir: str, layout: ParallelLayout, root: str, resave: str | None) -> dict:
    """Load `root`, optionally re-save it untouched to `resave`, then train the remaining steps."""
    from megatron.core import dist_checkpointing

    from mrl.bridge.export import iter_hf_weights
    from mrl.megatron.checkpoint import load_checkpoint, save_checkpoint

    coords, trainable, batches = _setup(hf_dir, layout)
    info = load_checkpoint(root, trainable)
    result = {"step": info["step"], "data": info["data"], "config": info["config"]}
    exported = dict(iter_hf_weights(trainable.built, coords))
    if resave is not None:
        save_checkpoint(resave, trainable, step=info["step"], data_state=info["data"], config=info["config"])
        source = _flatten(dist_checkpointing.load_plain_tensors(str(cd.resolve(root))))
        again = _flatten(dist_checkpointing.load_plain_tensors(str(cd.resolve(resave))))
        result["plain_keys"] = (sorted(source), sorted(again))
        # RNG streams are per rank: they are not carried to another layout.
        result["plain_mismatch"] = [k for k in source if not k.startswith("rng") and not _same(source[k], again.get(k))]
    result["losses"] = [_step(trainable, tokens) for tokens in batches[info["step"]:]]
    result["exported"] = exported if rank == 0 else None
    from mrl.megatron.parallel import destroy_layout

    destroy_layout()
    return result


def _last_stage(per_rank: list[dict]) -> dict:
    return next(r for r in per_rank if r["losses"] and r["losses"][0] is not None)


@pytest.fixture(scope="module")
def dense_run(tiny_model_dir, tmp_path_factory):
    """llama in TP2: 4 steps, sync and async saves of step 2 (the async one overlaps step 3)."""
    base = tmp_path_factory.mktemp("dense_ckpt")
    roots = {"sync": str(base / "sync"), "async": str(base / "async")}
    hf_dir = str(tiny_model_dir("llama"))
    per_rank = run_local(_dense_uninterrupted, 2, hf_dir, ParallelLayout(tp=2), roots, timeout_s=TIMEOUT_S)
    return {"hf_dir": hf_dir, "roots": roots, "base": base, "losses": per_rank[0]["losses"],
            "exported": per_rank[0]["exported"]}


def test_dense_resume_is_bitwise_equal(dense_run):
    per_rank = run_local(_resume, 2, dense_run["hf_dir"], ParallelLayout(tp=2), dense_run["roots"]["sync"], None,
                         timeout_s=TIMEOUT_S)
    result = per_rank[0]
    assert result["step"] == SAVE_AT and result["data"] == {"position": SAVE_AT} and result["config"] == {"lr": 1e-3}
    assert result["losses"] == dense_run["losses"][SAVE_AT:], (result["losses"], dense_run["losses"])
    assert all(torch.equal(t, dense_run["exported"][n]) for n, t in result["exported"].items())


def test_async_save_writes_the_same_checkpoint(dense_run):
    sync_dir = cd.resolve(dense_run["roots"]["sync"])
    async_dir = cd.resolve(dense_run["roots"]["async"])
    sync_manifest, async_manifest = cd.read_manifest(sync_dir), cd.read_manifest(async_dir)
    sync_files, async_files = sync_manifest.pop("files"), async_manifest.pop("files")
    sync_sums, async_sums = sync_manifest.pop("checksums")["files"], async_manifest.pop("checksums")["files"]
    assert sync_manifest == async_manifest and sorted(sync_files) == sorted(async_files) == sorted(sync_sums)
    for name in sync_files:
        if name not in (".metadata", cd.MANIFEST):  # .metadata records the directory's own path
            # Tensor data taken before step 3, although the async write ran during it; each rank's
            # checksums of its shards (taken in the write thread) are those of the sync save.
            assert (sync_dir / name).read_bytes() == (async_dir / name).read_bytes(), name
            assert sync_sums[name] == async_sums[name] == cd.file_checksum(async_dir / name), name


@pytest.mark.parametrize("layout", [ParallelLayout(pp=2), ParallelLayout()], ids=["PP2", "TP1xDP2"])
def test_resume_on_another_layout(dense_run, layout, tmp_path):
    resave = str(tmp_path / "resaved")
    per_rank = run_local(_resume, 2, dense_run["hf_dir"], layout, dense_run["roots"]["sync"], resave,
                         timeout_s=TIMEOUT_S)
    root = per_rank[0]
    mismatched = [n for n, t in root["exported"].items() if not torch.equal(t, dense_run["exported"][n])]
    assert sorted(root["exported"]) == sorted(dense_run["exported"]) and not mismatched, mismatched[:3]
    source_keys, resaved_keys = root["plain_keys"]
    assert source_keys == resaved_keys and any(k.startswith("optimizer.") for k in source_keys)
    assert root["plain_mismatch"] == [], root["plain_mismatch"][:3]  # model and optimizer state
    losses = _last_stage(per_rank)["losses"]
    expected = dense_run["losses"][SAVE_AT:]
    assert max(abs(a - b) for a, b in zip(losses, expected)) <= 1e-5, (losses, expected)


def _moe_run(rank: int, world: int, hf_dir: str, layout: ParallelLayout, root: str) -> dict:
    from mrl.megatron.checkpoint import SavePolicy

    _coords, trainable, batches = _setup(hf_dir, layout)
    policy = SavePolicy(root, interval=1, keep=3)
    losses = []
    for step, tokens in enumerate(batches, start=1):
        losses.append(_step(trainable, tokens))
        policy.maybe_save(trainable, step, data_state={"position": step})
    policy.finish()
    return {"losses": losses}


def _moe_resume(rank: int, world: int, hf_dir: str, layout: ParallelLayout, root: str, other_arch_root: str) -> dict:
    from mrl.megatron.checkpoint import CheckpointMismatchError, load_checkpoint

    _coords, trainable, batches = _setup(hf_dir, layout)
    try:
        load_checkpoint(other_arch_root, trainable)
        wrong_arch = None
    except CheckpointMismatchError as err:
        wrong_arch = str(err)
    info = load_checkpoint(Path(root) / cd.iter_name(SAVE_AT), trainable)
    return {"wrong_arch": wrong_arch, "step": info["step"],
            "losses": [_step(trainable, tokens) for tokens in batches[info["step"]:]]}


def test_moe_resume_pruning_and_wrong_arch(dense_run, tiny_model_dir, tmp_path):
    hf_dir, layout, root = str(tiny_model_dir("qwen3_moe")), ParallelLayout(ep=2), str(tmp_path / "moe")
    full = run_local(_moe_run, 2, hf_dir, layout, root, timeout_s=TIMEOUT_S)[0]["losses"]
    assert [step for step, _ in cd.list_iterations(root)] == [2, 3, 4]  # keep=3 pruned step 1
    assert cd.read_latest(root) == cd.iter_name(4)
    resumed = run_local(_moe_resume, 2, hf_dir, layout, root, dense_run["roots"]["sync"], timeout_s=TIMEOUT_S)[0]
    assert resumed["step"] == SAVE_AT
    assert resumed["losses"] == full[SAVE_AT:], (resumed["losses"], full)
    message = resumed["wrong_arch"]
    assert message is not None and "'llama'" in message and "'qwen3_moe'" in message, message


def _save_then_hang(rank: int, world: int, hf_dir: str, root: str) -> None:
    """Save step 1, start an async save of step 2, then never finish it (the test kills us)."""
    from mrl.megatron.checkpoint import save_checkpoint

    _coords, trainable, batches = _setup(hf_dir, ParallelLayout(tp=2))
    _step(trainable, batches[0])
    save_checkpoint(root, trainable, step=1)
    _step(trainable, batches[1])
    save_checkpoint(root, trainable, step=2, async_save=True)
    time.sleep(TIMEOUT_S)


def _resume_and_save_next(rank: int, world: int, hf_dir: str, root: str) -> int:
    from mrl.megatron.checkpoint import load_checkpoint, save_checkpoint

    _coords, trainable, batches = _setup(hf_dir, ParallelLayout(tp=2))
    step = load_checkpoint(root, trainable)["step"]
    _step(trainable, batches[step])
    save_checkpoint(root, trainable, step=step + 1)
    return step


def _killed_main(hf_dir: str, root: str) -> None:
    run_local(_save_then_hang, 2, hf_dir, root, timeout_s=TIMEOUT_S)


def test_kill_during_save_keeps_previous_checkpoint(tiny_model_dir, tmp_path):
    hf_dir, root = str(tiny_model_dir("llama")), tmp_path / "killed"
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"from test_checkpoint_resume import _killed_main; _killed_main({hf_dir!r}, {str(root)!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not list(root.glob(f"{cd.TMP_PREFIX}{cd.iter_name(2)}-*/*.distcp")):
            assert proc.poll() is None, f"the saving process exited early: {proc.stderr.read().decode()[-3000:]}"
            assert time.monotonic() < deadline, "the second save never started writing"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole world: launcher and both ranks
        proc.wait(timeout=30)
    assert cd.read_latest(root) == cd.iter_name(1)
    assert [step for step, _ in cd.list_iterations(root)] == [1]
    assert cd.read_manifest(cd.resolve(root))["step"] == 1  # every listed file present and whole
    # The previous checkpoint loads (fresh processes) and the next save clears the leftover.
    assert run_local(_resume_and_save_next, 2, hf_dir, str(root), timeout_s=TIMEOUT_S)[0] == 1
    assert not list(root.glob(f"{cd.TMP_PREFIX}*"))
    assert cd.read_latest(root) == cd.iter_name(2)
