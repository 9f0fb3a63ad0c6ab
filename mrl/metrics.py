"""Run metrics: one `MetricsLogger.log(step, metrics)` call feeds every sink of a training run.

Sinks: console progress (a tqdm bar on a terminal, otherwise one plain line per step), metrics.jsonl,
TensorBoard, wandb when asked for, and Prometheus gauges when a port is given (mrl/prometheus.py).
Metric names follow verl's (critic/score/mean, actor/ppo_kl, timing_s/step, ...). A resumed run
(`resume_step=N`) drops the rows of steps after N that the interrupted run logged, so they are not
logged twice. `plot_metrics` draws curves.png from metrics.jsonl; `timer` measures a phase into
timing_s/<name>. The sinks, the names and resuming in full: docs/metrics.md.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence, TextIO

from mrl.atomic import atomic_write
from mrl.profiling import stage

JSONL_NAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_KEYS = ("critic/score/mean", "response_length/mean", "actor/entropy")
# Shown beside the progress bar (or in the step's line) when a step reports them: metric name -> short label.
CONSOLE_KEYS = {
    "critic/score/mean": "score",
    "actor/ppo_kl": "kl",
    "eval/accuracy": "acc",
    "timing_s/step": "s/step",
}


def _tensorboard_writer_class():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError("TensorBoard logging was asked for but tensorboard is not installed; fix: "
                          "pip install tensorboard==2.21.0 (requirements/cpu.txt), or set "
                          "logging.tensorboard=false") from None
    return SummaryWriter


def _wandb_module():
    try:
        import wandb
    except ImportError:
        raise ImportError("wandb logging was asked for but wandb is not installed; fix: pip install wandb "
                          "(and log in), or set logging.wandb=false") from None
    return wandb


def _prometheus_exporter(port: int, run_name: str):
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ImportError("Prometheus export was asked for but prometheus_client is not installed; fix: "
                          "pip install prometheus_client==0.26.0 (requirements/cpu.txt), or set "
                          "logging.prometheus_port=null") from None
    from mrl.prometheus import PrometheusExporter

    return PrometheusExporter(port, run_name)


def _scalar(name: str, value: Any) -> float | int | None:
    """A metric value as a plain Python number (None stays None)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    if hasattr(value, "numel"):  # a torch tensor
        if value.numel() != 1:
            raise ValueError(f"metric {name!r} is a tensor of shape {tuple(value.shape)}; "
                             f"log a scalar (reduce it first, e.g. .mean())")
        return _scalar(name, value.item())
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:  # numpy scalar or 0-d array
        return _scalar(name, value.item())
    raise TypeError(f"metric {name!r} is a {type(value).__name__}, not a number; "
                    f"log floats, ints or one-element tensors")


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _ProgressLines:
    """Progress where the stream is not a terminal (a log file, CI, a pipe): one plain line per
    logged step (step/total, CONSOLE_KEYS, seconds per step) instead of a bar redrawn with \\r."""

    def __init__(self, stream: TextIO, desc: str, total: int, initial: int):
        self.stream, self.desc, self.total = stream, desc, total
        self._step, self._time = initial, time.perf_counter()

    def show(self, step: int, shown: list[str], values: Mapping[str, float | int]) -> None:
        now = time.perf_counter()
        if "timing_s/step" not in values and step > self._step:  # the run did not time its steps: measure
            shown = shown + [f"s/step {(now - self._time) / (step - self._step):.4g}"]
        self._step, self._time = max(step, self._step), now
        print(f"{self.desc} step {step}/{self.total}", *shown, file=self.stream, flush=True)


def read_metrics(jsonl_path: str | os.PathLike) -> list[dict]:
    """The rows of a metrics.jsonl; a line cut short (a crash mid-write) is skipped."""
    path = Path(jsonl_path)
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}; fix: point at the metrics.jsonl a run wrote "
                                f"(<trainer.output_dir>/{JSONL_NAME})")
    return step_rows(path.read_text())


def step_rows(jsonl: str) -> list[dict]:
    """The objects of JSON-lines text that carry an integer "step"; a line cut short is skipped."""
    rows = []
    for line in jsonl.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def _drop_steps_from(jsonl_path: Path, first_dropped: int) -> None:
    """Rewrite metrics.jsonl (atomically) keeping only the rows of steps < first_dropped."""
    if not jsonl_path.exists():
        return
    kept = [row for row in read_metrics(jsonl_path) if row["step"] < first_dropped]
    text = "".join(json.dumps(row) + "\n" for row in kept)
    atomic_write(jsonl_path, lambda f: f.write(text.encode()))


class MetricsLogger:
    """Logs one dict of metrics per step to the console, metrics.jsonl, TensorBoard and wandb.

    Every sink that was asked for is checked before anything is written, so a missing package fails
    at construction with a one-line error naming the fix. Use as a context manager, or call close().
    """

    def __init__(self, output_dir: str | os.PathLike, total_steps: int, *, jsonl: bool = True,
                 tensorboard: bool = True, wandb: bool = False, wandb_project: str = "mrl",
                 run_name: str | None = None, config: dict | None = None, resume_step: int | None = None,
                 progress: bool = True, prometheus_port: int | None = None, progress_stream: TextIO | None = None):
        if not isinstance(total_steps, int) or total_steps < 0:
            raise ValueError(f"total_steps={total_steps!r}; fix: pass the run's number of steps (an int >= 0)")
        if resume_step is not None and (not isinstance(resume_step, int) or resume_step < 0):
            raise ValueError(f"resume_step={resume_step!r}; fix: pass the step of the checkpoint the run "
                             f"resumed from (an int >= 0; 0 for a fresh run) or None")
        writer_class = _tensorboard_writer_class() if tensorboard else None
        wandb_module = _wandb_module() if wandb else None

        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.run_name = run_name or self.output_dir.resolve().name
        # First of the sinks that open something: a port that cannot be opened leaves no file open.
        self._prometheus = None if prometheus_port is None else _prometheus_exporter(prometheus_port, self.run_name)
        # The first step the interrupted run logged but this one logs again (0: a fresh run).
        first_dropped = None if resume_step is None else (resume_step + 1 if resume_step else 0)
        self._closed = False
        self._jsonl = self._writer = self._wandb_run = self._bar = self._lines = None

        self.jsonl_path = self.output_dir / JSONL_NAME if jsonl else None
        if self.jsonl_path is not None:
            if first_dropped is not None:
                _drop_steps_from(self.jsonl_path, first_dropped)
            self._jsonl = open(self.jsonl_path, "a")
        if writer_class is not None:
            self._writer = writer_class(log_dir=str(self.output_dir / TENSORBOARD_DIR), purge_step=first_dropped)
            if config is not None and not resume_step:
                # TensorBoard renders text as markdown: indent 4 spaces for a code block.
                text = "\n".join("    " + line for line in json.dumps(config, indent=2, default=str).splitlines())
                self._writer.add_text("config", text, 0)
                self._writer.flush()
        if wandb_module is not None:
            self._wandb_run = wandb_module.init(project=wandb_project, name=self.run_name, config=config,
                                                dir=str(self.output_dir))
        if progress:  # on progress_stream (default: stderr, where tqdm writes)
            stream = sys.stderr if progress_stream is None else progress_stream
            initial = min(resume_step or 0, total_steps)
            if _is_terminal(stream):
                from tqdm.auto import tqdm

                self._bar = tqdm(total=total_steps, initial=initial, desc=self.run_name, unit="step",
                                 dynamic_ncols=True, file=stream)
            else:
                self._lines = _ProgressLines(stream, self.run_name, total_steps, initial)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float | int]:
        """Log the metrics of one step to every sink; returns the values logged (None dropped)."""
        if self._closed:
            raise RuntimeError(f"MetricsLogger for {self.output_dir} is closed; fix: log before close()")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step={step!r}; fix: log with an int step >= 0")
        values: dict[str, float | int] = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not name or name == "step":
                raise ValueError(f"metric name {name!r}; fix: use a non-empty string other than 'step'")
            number = _scalar(name, value)
            if number is not None:
                values[name] = number
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
            self._jsonl.flush()
        if self._writer is not None:
            for name, number in values.items():
                self._writer.add_scalar(name, number, step)
            self._writer.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=step)
        if self._prometheus is not None:
            self._prometheus.update(step, values)
        shown = [f"{label} {values[name]:.4g}" for name, label in CONSOLE_KEYS.items() if name in values]
        if self._lines is not None:
            self._lines.show(step, shown, values)
        if self._bar is not None:
            self._bar.set_postfix_str(" ".join(shown), refresh=False)
            if step > self._bar.n:
                self._bar.update(min(step, self.total_steps) - self._bar.n)
            else:
                self._bar.refresh()
        return values

    def close(self) -> None:
        """Flush and close every sink; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._writer is not None:
            self._writer.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
        if self._prometheus is not None:
            self._prometheus.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def plot_metrics(jsonl_path: str | os.PathLike, png_path: str | os.PathLike,
                 keys: Sequence[str] = PLOT_KEYS) -> Path:
    """Draw one subplot per key against step from a metrics.jsonl into a PNG (written atomically).

    Keys no row reports are skipped and named in the figure title. Returns the PNG's path.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plot_metrics needs matplotlib, which is not installed; fix: "
                          "pip install matplotlib==3.11.2 (requirements/cpu.txt)") from None
    if isinstance(keys, str):
        keys = (keys,)
    rows = read_metrics(jsonl_path)
    series: dict[str, dict[int, float]] = {key: {} for key in keys}
    for row in rows:
        for key in keys:
            if isinstance(row.get(key), (int, float)):
                series[key][row["step"]] = row[key]  # a repeated step: the last row wins
    present = [key for key in keys if series[key]]
    missing = [key for key in keys if not series[key]]

    # The object API with an explicit Agg canvas: no pyplot, no global backend switch.
    fig = Figure(figsize=(7, 2.2 * max(1, len(present)) + 0.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    title = f"{Path(jsonl_path).parent.name}/{Path(jsonl_path).name}"
    if missing:
        title += f"\n(no data, skipped: {', '.join(missing)})"
    fig.suptitle(title, fontsize=10)
    if present:
        axes = fig.subplots(len(present), 1, sharex=True, squeeze=False)[:, 0]
        for ax, key in zip(axes, present):
            steps = sorted(series[key])
            ax.plot(steps, [series[key][s] for s in steps], marker="o" if len(steps) <= 50 else None,
                    markersize=3, linewidth=1.2)
            ax.set_title(key, fontsize=9)
            ax.grid(alpha=0.3)
        axes[-1].set_xlabel("step")
    else:
        ax = fig.add_subplot()
        ax.text(0.5, 0.5, "no data for the requested keys", ha="center", va="center")
        ax.set_axis_off()

    png = Path(png_path)
    png.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(png, lambda f: fig.savefig(f, format="png"))
    return png


class Timer:
    """`with timer("gen", metrics):` adds the block's wall time in seconds to metrics["timing_s/gen"].

    Times add up, so a phase timed in pieces reports its total; `.elapsed` holds this block's time.
    The time is recorded also when the block raises. A timed phase is also a profiler stage range
    ("mrl/gen": torch.profiler traces, NVTX on CUDA; mrl/profiling.py).
    """

    def __init__(self, name: str, metrics: dict | None = None):
        self.key = f"timing_s/{name}"
        self.metrics = metrics
        self.elapsed = 0.0
        self._start = 0.0
        self._stage = stage(name)

    def __enter__(self) -> Timer:
        self._stage.__enter__()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc_info) -> None:
        self.elapsed = time.perf_counter() - self._start
        self._stage.__exit__(*exc_info)
        if self.metrics is not None:
            self.metrics[self.key] = self.metrics.get(self.key, 0.0) + self.elapsed


timer = Timer
