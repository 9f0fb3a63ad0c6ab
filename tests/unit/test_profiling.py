"""mrl.profiling: stage ranges (torch.profiler annotations, NVTX only with CUDA), one process's
trace file, the driver's per-step window, and profile.steps validation."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mrl.config import ConfigError, load_config
from mrl.metrics import timer
from mrl.profiling import TraceRecorder, is_profiled, profiled_step, stage, step_dir, trace_file

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu_grpo.yaml"


def _events(path: Path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def test_a_trace_holds_the_stage_ranges_and_the_ops_inside_them(tmp_path):
    recorder = TraceRecorder()
    recorder.start()
    with stage("update"):
        torch.randn(64, 64) @ torch.randn(64, 64)
    with timer("gen", {}):  # a trainer phase is a stage too
        pass
    path = recorder.stop(tmp_path / "deep" / trace_file("actor", 3))
    assert path.name == "actor_rank3.pt.trace.json"
    names = {event.get("name") for event in _events(path)}
    assert {"mrl/update", "mrl/gen", "aten::mm"} <= names, sorted(n for n in names if n)
    with pytest.raises(RuntimeError, match="no trace is being recorded"):
        recorder.stop(tmp_path / "again.json")
    recorder.start()
    with pytest.raises(RuntimeError, match="already being recorded"):
        recorder.start()
    recorder.stop(tmp_path / "second.pt.trace.json")


@pytest.mark.parametrize("cuda", [False, True])
def test_stages_push_nvtx_ranges_only_with_cuda(monkeypatch, cuda):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    with pytest.raises(ValueError):
        with stage("reward"):
            raise ValueError("the range closes anyway")
    assert calls == ([("push", "mrl/reward"), ("pop",)] if cuda else [])


def test_steps_and_file_names():
    assert [s for s in range(1, 6) if is_profiled([2, 3], s)] == [2, 3]
    assert not any(is_profiled(None, s) for s in range(1, 6))
    assert step_dir("runs/x", 7) == Path("runs/x/profile/step_0007")
    assert trace_file("driver") == "driver.pt.trace.json"


class FakeGroup:
    """A worker group's proxy: records the driver's calls."""

    def __init__(self):
        self.calls = []

    def start_profile(self):
        self.calls.append("start")

    def stop_profile(self, directory, role):
        self.calls.append(("stop", directory, role))


def _run(tmp_path, steps, critic=True):
    cluster = SimpleNamespace(actor=FakeGroup(), critic=FakeGroup() if critic else None)
    return SimpleNamespace(cfg=SimpleNamespace(profile=SimpleNamespace(steps=steps)), cluster=cluster, out=tmp_path)


def test_profiled_step_traces_the_driver_and_every_group_in_the_window_only(tmp_path):
    run = _run(tmp_path, [2, 2])
    with profiled_step(run, 1):
        pass
    assert run.cluster.actor.calls == [] and not (tmp_path / "profile").exists()
    with profiled_step(run, 2):
        torch.ones(3).sum()
    folder = str(tmp_path / "profile" / "step_0002")
    assert run.cluster.actor.calls == ["start", ("stop", folder, "actor")]
    assert run.cluster.critic.calls == ["start", ("stop", folder, "critic")]
    assert _events(tmp_path / "profile" / "step_0002" / "driver.pt.trace.json")


def test_a_failed_step_keeps_its_error_and_does_not_ask_the_ranks(tmp_path):
    run = _run(tmp_path, [1, 1], critic=False)
    with pytest.raises(RuntimeError, match="rank 1 died"):
        with profiled_step(run, 1):
            raise RuntimeError("rank 1 died")
    assert run.cluster.actor.calls == ["start"]
    assert (tmp_path / "profile" / "step_0001" / "driver.pt.trace.json").exists()


def test_profile_steps_from_the_command_line():
    assert load_config(TINY, ["profile.steps=[2,3]"]).profile.steps == [2, 3]
    assert load_config(TINY, ["profile.steps=null"]).profile.steps is None
    assert load_config(TINY).profile.steps is None  # off by default


@pytest.mark.parametrize("steps, message", [
    ("[3,2]", "profile.steps [3, 2] starts after it ends: write [first, last] with first <= last."),
    ("[0,2]", "profile.steps [0, 2] lies outside RL steps 1..100 (trainer.total_steps): choose steps in that range."),
    ("[99,101]", "profile.steps [99, 101] lies outside RL steps 1..100 (trainer.total_steps): choose steps in that range."),
    ("[2]", "profile.steps must be [first, last], two RL steps, got [2]: e.g. profile.steps=[2,3]."),
    ("[1,2,3]", "profile.steps must be [first, last], two RL steps, got [1, 2, 3]: e.g. profile.steps=[2,3]."),
])
def test_bad_profile_steps(steps, message):
    assert load_config(TINY).trainer.total_steps == 100
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [f"profile.steps={steps}"])
    assert info.value.errors == [message]
