"""`mrl train` / `mrl sft` refuse a bad configuration before anything starts: exit 2, every problem named."""

from pathlib import Path

import pytest

from mrl.cli.train import sft, train

RECIPE = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu_grpo.yaml")


@pytest.mark.parametrize("command", [train, sft])
def test_bad_config_exits_2_with_every_problem_named(command, capsys, tmp_path):
    code = command([RECIPE, "algo.kl_coeff=0.1", "parallel.tp=3", f"trainer.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2
    assert "kl_coeff" in err and "kl_coef" in err  # the unknown key and its close match
    assert "tp" in err.lower()  # a layout that cannot hold the model
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_missing_data_file_is_named(capsys):
    code = train([RECIPE, "data.synthetic=false", "data.path=/nonexistent/prompts.jsonl"])
    assert code == 2 and "/nonexistent/prompts.jsonl" in capsys.readouterr().err


def test_an_earlier_sft_checkpoint_is_not_overwritten(tmp_path):
    from mrl import checkpoint_dir as cd
    from mrl.config import ConfigError, load_config
    from mrl.run import refuse_to_overwrite

    earlier = tmp_path / "ckpt" / "sft" / "iter_0000250"
    earlier.mkdir(parents=True)
    cd.write_manifest(earlier, step=250)
    cfg = load_config(RECIPE, [f"checkpoint.dir={tmp_path / 'ckpt'}"])
    with pytest.raises(ConfigError, match=r"already holds an SFT checkpoint: start RL from it \(checkpoint.resume="):
        refuse_to_overwrite(cfg)  # before the SFT runs, not when it saves
    refuse_to_overwrite(load_config(RECIPE, [f"checkpoint.dir={tmp_path / 'ckpt'}", "trainer.sft_steps=0"]))


def test_the_recorded_sft_start_survives_moving_the_checkpoint_tree(tmp_path):
    from mrl import checkpoint_dir as cd
    from mrl.run import located_rl_start, portable_rl_start

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    for root, step in ((run / "sft", 250), (run, 10), (elsewhere, 7)):
        with cd.atomic_dir(root / cd.iter_name(step), manifest={"step": step}):
            pass
        cd.write_latest(root, cd.iter_name(step))

    recorded = portable_rl_start(str(run / "sft"), str(run))
    assert recorded == "sft/iter_0000250"  # the iteration, not the root whose `latest` could move
    moved = tmp_path / "moved"
    run.rename(moved)
    assert located_rl_start(recorded, str(moved)) == str(moved / "sft" / "iter_0000250")
    assert located_rl_start(recorded, str(moved / "iter_0000010")) == str(moved / "sft" / "iter_0000250")
    outside = portable_rl_start(str(elsewhere), str(moved))
    assert outside == str((elsewhere / "iter_0000007").resolve())
    assert located_rl_start(outside, str(moved)) == outside and located_rl_start(None, str(moved)) is None


def test_a_failed_rank_is_one_line_and_exit_1_with_the_traceback_in_a_file(capsys, tmp_path):
    from mrl.cli.train import _run
    from mrl.launch.worker_group import WorkerGroupError

    def job(cfg):
        try:
            raise ValueError("the remote traceback")
        except ValueError as cause:
            raise WorkerGroupError("rank 1 (pid 7 on node-a) died during update, 3.0 s in") from cause

    code = _run("mrl train", [RECIPE, f"trainer.output_dir={tmp_path}"], job)
    err = capsys.readouterr().err
    assert code == 1
    assert err == (f"mrl train: rank 1 (pid 7 on node-a) died during update, 3.0 s in "
                   f"(traceback: {tmp_path / 'error.log'})\n")
    assert "ValueError: the remote traceback" in (tmp_path / "error.log").read_text()


def test_a_dead_engine_is_one_line_and_exit_1(capsys, tmp_path):
    from mrl.cli.train import _run
    from mrl.launch.fleet import EngineError

    def job(cfg):
        raise EngineError("generate: rollout engine 0 of 1 (node 10.0.0.2) died (its process exited: …)")

    code = _run("mrl train", [RECIPE, f"trainer.output_dir={tmp_path}"], job)
    assert code == 1
    assert capsys.readouterr().err == ("mrl train: generate: rollout engine 0 of 1 (node 10.0.0.2) died (its process "
                                       f"exited: …) (traceback: {tmp_path / 'error.log'})\n")


def test_a_stop_at_once_is_one_line_naming_what_was_saved_and_where_it_stopped_in_a_file(capsys, tmp_path):
    from mrl.cli.train import _run

    def job(cfg):
        raise KeyboardInterrupt("SIGTERM: stopped at once")

    code = _run("mrl train", [RECIPE, f"trainer.output_dir={tmp_path}"], job)
    err = capsys.readouterr().err
    assert code == 128 + 15
    assert err.startswith("mrl train: stopped at once by SIGTERM after 0 s, without saving: nothing was saved; its "
                          "actors and engines were stopped") and err.count("\n") == 1, err
    assert "KeyboardInterrupt" in (tmp_path / "error.log").read_text()


def test_a_stop_at_a_step_boundary_names_the_checkpoint_and_the_command_that_resumes(capsys, tmp_path):
    from mrl.cli.train import _run

    def job(cfg):
        return {"stopped": {"signal": "SIGTERM", "step": 3, "checkpoint": f"{cfg.checkpoint.dir}/iter_0000003"}}

    code = _run("mrl train", [RECIPE, f"trainer.output_dir={tmp_path}"], job)
    assert code == 128 + 15
    assert capsys.readouterr().err == (f"mrl train: stopped by SIGTERM after RL step 3, saved in {tmp_path}/checkpoints/"
                                       f"iter_0000003; resume with: mrl train {RECIPE} trainer.output_dir={tmp_path}\n")


def test_a_legacy_megatron_lm_start_is_refused_before_workers_start(tmp_path, tiny_model_dir, capsys):
    from mrl import megatron_lm_dir as mlm

    legacy = tmp_path / "mlm" / "iter_0000100" / "mp_rank_00"
    legacy.mkdir(parents=True)
    (legacy / mlm.RANK_FILE).write_bytes(b"x")  # its contents are not read: the format alone is refused
    (tmp_path / "mlm" / mlm.TRACKER).write_text("100")
    code = train([RECIPE, f"checkpoint.resume={tmp_path / 'mlm'}", f"model.path={tiny_model_dir('deepseek_v3')}",
                  "model.tiny=null", f"checkpoint.dir={tmp_path / 'ckpt'}", f"trainer.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "is a legacy (torch format) Megatron-LM checkpoint, which only mrl-merge reads: merge it" in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "ckpt").exists()


def test_a_megatron_lm_start_is_recorded_as_its_iteration(tmp_path):
    from mrl import megatron_lm_dir as mlm
    from mrl.run import located_rl_start, portable_rl_start

    iteration = tmp_path / "mlm" / "iter_0000100"
    iteration.mkdir(parents=True)
    for name in ("common.pt", ".metadata"):
        (iteration / name).write_bytes(b"x")
    (iteration / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (tmp_path / "mlm" / mlm.TRACKER).write_text("100")
    recorded = portable_rl_start(str(tmp_path / "mlm"), str(tmp_path / "ckpt"))
    assert recorded == str(iteration.resolve())  # outside the run's checkpoints: absolute, the tracker followed
    assert located_rl_start(recorded, str(tmp_path / "ckpt" / "iter_0000010")) == recorded


def test_headline_gives_greedy_and_sampled_accuracy():
    from mrl.cli.train import headline

    line = headline({"accuracy_before": 0.25, "accuracy_after": 0.3, "accuracy_sampled_before": 0.2,
                     "accuracy_sampled_after": 0.26, "seconds": 12.0})
    assert "before RL 0.250 → after RL 0.300 (+5.0 points)" in line
    assert "sampled 0.200 → 0.260 (+6.0 points)" in line
    assert "sampled" not in headline({"accuracy_before": 0.25, "accuracy_after": 0.3, "seconds": 1.0})
