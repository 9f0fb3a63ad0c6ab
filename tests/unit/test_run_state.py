"""Nothing lost, nothing mixed up (no workers): a run's files under its output dir, one owner per
checkpoint root, the model named is the model trained, checksums, and SIGTERM's stop request."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mrl import checkpoint_dir as cd
from mrl.config import ConfigError, config_to_dict, load_config
from mrl.run_owner import claim, identity

DEMO = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu_grpo.yaml"


def fake_run(out: Path, step: int = 40) -> Path:
    """The checkpoints of a finished demo run in `out`, as mrl lays them out (no weights in them)."""
    cfg = load_config(DEMO, [f"trainer.output_dir={out}"], check_files=False)
    root = Path(cfg.checkpoint.dir)
    claim(root, identity(config_to_dict(cfg)))
    with cd.atomic_dir(root / cd.iter_name(step), manifest={"step": step}) as tmp:
        (tmp / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    cd.write_latest(root, cd.iter_name(step))
    return root


def snapshot(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_run_keeps_its_checkpoints_and_its_tiny_model_under_its_output_dir(tmp_path):
    cfg = load_config(DEMO, [f"trainer.output_dir={tmp_path / 'a'}"], check_files=False)
    assert (cfg.checkpoint.dir, cfg.model.path) == (str(tmp_path / "a" / "checkpoints"), str(tmp_path / "a" / "model"))


def test_a_second_experiment_from_the_demo_leaves_the_first_runs_checkpoints_untouched(tmp_path):
    first = fake_run(tmp_path / "first")
    before = snapshot(first)
    second = load_config(DEMO, [f"trainer.output_dir={tmp_path / 'second'}"], check_files=False)
    assert second.checkpoint.dir == str(tmp_path / "second" / "checkpoints")  # not the first run's
    # Pointed at the first run's checkpoints on purpose, the second run stops before a process starts.
    result = subprocess.run([str(Path(sys.executable).with_name("mrl")), "train", str(DEMO),
                             f"trainer.output_dir={tmp_path / 'second'}", f"checkpoint.dir={first}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds the checkpoints of run 'tiny-cpu-grpo'" in lines[0], lines
    assert f"checkpoint.resume={first}" in lines[0] and str(tmp_path / "second") in lines[0]
    assert snapshot(first) == before
    assert not (tmp_path / "second").exists()


def test_a_run_moved_whole_resumes_but_not_with_other_data(tmp_path):
    from mrl.run import check_owner

    def check(*overrides):
        cfg = load_config(DEMO, [f"trainer.output_dir={tmp_path / 'new'}", *overrides], check_files=False)
        check_owner(cfg, identity(config_to_dict(cfg)))

    fake_run(tmp_path / "old")
    (tmp_path / "old").rename(tmp_path / "new")
    check()
    with pytest.raises(ConfigError, match=r"trained with data.batch_size=8 \(now 4\)"):
        check("data.batch_size=4")


def test_starting_from_another_checkpoint_over_this_runs_own_is_refused(tmp_path):
    from mrl.run import refuse_to_overwrite

    own, other = fake_run(tmp_path / "run"), fake_run(tmp_path / "other")
    cfg = load_config(DEMO, [f"trainer.output_dir={tmp_path / 'run'}", f"checkpoint.resume={other}"], check_files=False)
    with pytest.raises(ConfigError, match=r"already holds this run's checkpoints.*checkpoint.resume=auto"):
        refuse_to_overwrite(cfg)
    refuse_to_overwrite(load_config(DEMO, [f"trainer.output_dir={tmp_path / 'run'}", f"checkpoint.resume={own}"],
                                    check_files=False))


@pytest.mark.parametrize("overrides, message", [
    (["model.path={tmp}/typo"], "model.path {tmp}/typo is outside the run's output dir"),  # tiny inherited
    (["model.tiny=null", "model.path={tmp}/typo"], "model.path {tmp}/typo does not exist"),
    (["model.path={tmp}/run/qwen"], "model.path {tmp}/run/qwen holds a 'qwen3' model, not the tiny 'deepseek_v3'"),
])
def test_the_model_named_is_the_model_trained(tmp_path, overrides, message):
    (tmp_path / "run" / "qwen").mkdir(parents=True)
    (tmp_path / "run" / "qwen" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, [f"trainer.output_dir={tmp_path / 'run'}", *(o.format(tmp=tmp_path) for o in overrides)])
    assert len(str(err.value).splitlines()) == 1 and message.format(tmp=tmp_path) in str(err.value)
    assert not (tmp_path / "typo").exists()


def test_a_flipped_bit_of_the_same_size_is_refused_by_merge_and_resume_naming_the_file(tmp_path):
    from checkpoints_tools.errors import CheckpointError
    from checkpoints_tools.merge import open_checkpoint
    from mrl.run import check_resume_files

    root = fake_run(tmp_path / "run")
    shard = root / "iter_0000040" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[1000:1300] = bytes(b ^ 0xFF for b in data[1000:1300])
    shard.write_bytes(bytes(data))
    cd.read_manifest(shard.parent)  # the size is unchanged: the manifest's sizes see nothing
    with pytest.raises(CheckpointError, match=f"checkpoint file {shard} is damaged: its xxh3_64 checksum"):
        open_checkpoint(root)
    with pytest.raises(ConfigError, match=f"checkpoint file {shard} is damaged"):
        check_resume_files(load_config(DEMO, [f"trainer.output_dir={tmp_path / 'run'}"], check_files=False))


def test_a_checkpoint_without_checksums_still_loads_with_a_note(tmp_path):
    it = fake_run(tmp_path / "run") / "iter_0000040"
    manifest = json.loads((it / cd.MANIFEST).read_text())
    del manifest["checksums"]
    (it / cd.MANIFEST).write_text(json.dumps(manifest))
    assert "records no checksums" in cd.verify_checksums(it, cd.read_manifest(it))


def test_sigterm_stops_at_the_step_boundary_and_a_second_stops_at_once():
    from mrl.stopping import StopRequest

    before = signal.getsignal(signal.SIGTERM)  # Ray's, when an earlier test started Ray in this process
    stop = StopRequest()
    stop.install()
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):  # set-up: nothing to save yet
            os.kill(os.getpid(), signal.SIGTERM)
        stop.signum, stop.boundary = None, True
        os.kill(os.getpid(), signal.SIGTERM)  # in the loop: recorded, the step goes on
        assert stop.name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_resume_command_continues_this_runs_own_checkpoints():
    import argparse

    from mrl.cli.train import resume_args

    args = argparse.Namespace(config="r.yaml", overrides=["checkpoint.resume=/other", "algo.kl_coef=0.1"])
    cfg = load_config(DEMO, ["checkpoint.resume=never"], check_files=False)
    assert resume_args(args, cfg) == ["r.yaml", "algo.kl_coef=0.1", "checkpoint.resume=auto"]


def test_mrl_sft_stops_at_once_on_sigterm_and_closes_its_workers(monkeypatch):
    from types import SimpleNamespace

    import mrl.sft as sft

    closed, before = [], signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(sft, "open_run", lambda cfg, sft_only: SimpleNamespace(close=lambda: closed.append(True)))
    monkeypatch.setattr(sft, "run_sft", lambda run: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(KeyboardInterrupt, match="SIGTERM: stopped at once"):
        sft.sft_only(load_config(DEMO, check_files=False))
    assert closed == [True] and signal.getsignal(signal.SIGTERM) is before
