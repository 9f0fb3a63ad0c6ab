"""Profiling: torch.profiler traces of the RL steps `profile.steps` names, and named stage ranges.

- `stage(name)`: a range around one stage of a step (the trainer's timed phases, the workers'
  log-prob, update and sync methods). It is a torch.profiler user annotation ("mrl/<name>") in
  every trace, and on a CUDA machine also an NVTX range of the same name, which nsys shows.
- `TraceRecorder`: one torch.profiler session in one process (a Megatron rank or the driver),
  written as a Chrome trace (`*.pt.trace.json`: Perfetto, chrome://tracing, the TensorBoard plugin).
- `profiled_step(run, step)`: on the driver, traces the step on every Megatron rank and on the
  driver itself when profile.steps covers it, into OUTPUT_DIR/profile/step_NNNN/.

No Ray and no Megatron here: the driver reaches the ranks through its proxies (duck-typed, so this
module sits below mrl.run and mrl.workers imports it). torch is imported on use, so that mrl.metrics
(whose timed phases are stages) stays light to import. See docs/profiling.md.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

STAGE_PREFIX = "mrl/"
TRACE_SUFFIX = ".pt.trace.json"  # the TensorBoard plugin reads only files named so


@contextmanager
def stage(name: str) -> Iterator[None]:
    """A named range in torch.profiler traces and, with CUDA, in nsys (NVTX). Cheap when neither
    a profiler nor nsys is running, so it stays on."""
    import torch

    nvtx = torch.cuda.is_available()
    if nvtx:
        torch.cuda.nvtx.range_push(STAGE_PREFIX + name)
    try:
        with torch.profiler.record_function(STAGE_PREFIX + name):
            yield
    finally:
        if nvtx:
            torch.cuda.nvtx.range_pop()


class TraceRecorder:
    """A torch.profiler session of this process: CPU ops, plus CUDA kernels where CUDA is there."""

    def __init__(self) -> None:
        self._profiler: Any = None  # a torch.profiler.profile while recording

    @property
    def running(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        if self._profiler is not None:
            raise RuntimeError("a trace is already being recorded: stop it before starting another")
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.start()

    def stop(self, path: str | Path) -> Path:
        """Stop recording and write the Chrome trace to `path` (its folder is made)."""
        if self._profiler is None:
            raise RuntimeError("no trace is being recorded: start one first")
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(path))
        return path


def step_dir(output_dir: str | Path, step: int) -> Path:
    """Where RL step `step`'s traces go: one folder per step, a TensorBoard plugin 'run'."""
    return Path(output_dir) / "profile" / f"step_{step:04d}"


def trace_file(role: str, rank: int | None = None) -> str:
    """`actor_rank0.pt.trace.json`, `critic_rank1...`, `driver.pt.trace.json`: the plugin's worker names."""
    return (role if rank is None else f"{role}_rank{rank}") + TRACE_SUFFIX


def is_profiled(steps: list[int] | None, step: int) -> bool:
    """Whether profile.steps ([first, last], inclusive; None: off) covers RL step `step`."""
    return steps is not None and steps[0] <= step <= steps[1]


@contextmanager
def profiled_step(run: Any, step: int) -> Iterator[None]:
    """Trace RL step `step` of `run` (mrl.run.Run) on the driver and on every rank of the actor
    (and critic) when profile.steps covers it; otherwise do nothing."""
    if not is_profiled(run.cfg.profile.steps, step):
        yield
        return
    groups = {"actor": run.cluster.actor, "critic": run.cluster.critic}
    groups = {role: group for role, group in groups.items() if group is not None}
    for group in groups.values():
        group.start_profile()
    driver = TraceRecorder()
    driver.start()
    folder = step_dir(run.out, step)
    try:
        yield
    finally:
        driver.stop(folder / trace_file("driver"))
    # Only after a step that finished: after a failure the ranks may be dead or inside a
    # collective, and asking them would hide the step's own error.
    for role, group in groups.items():
        group.stop_profile(str(folder), role)
