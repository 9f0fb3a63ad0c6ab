"""mrl/metrics.py: metrics.jsonl, resume truncation, TensorBoard events, the curves PNG, Timer, errors,
console progress (a bar on a terminal, plain lines elsewhere)."""

import io
import json
import sys

import pytest
import torch

from mrl.metrics import MetricsLogger, plot_metrics, read_metrics, timer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _step_metrics(step: int) -> dict:
    return {
        "critic/score/mean": 0.1 * step,
        "actor/ppo_kl": torch.tensor(0.01 * step),  # a 0-d tensor
        "actor/grad_norm": torch.tensor([2.0]),  # a one-element tensor
        "response_length/mean": 10 + step,  # an int stays an int
        "timing_s/step": 1.5,
        "eval/accuracy": None,  # skipped
    }


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_has_one_row_per_step_with_every_metric(tmp_path):
    with MetricsLogger(tmp_path, 3, tensorboard=False, progress=False) as logger:
        for step in (1, 2, 3):
            logged = logger.log(step, _step_metrics(step))
    assert logged == {"critic/score/mean": pytest.approx(0.3), "actor/ppo_kl": pytest.approx(0.03),
                      "actor/grad_norm": 2.0, "response_length/mean": 13, "timing_s/step": 1.5}
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert rows[1] == {"step": 2, "critic/score/mean": 0.2, "actor/ppo_kl": pytest.approx(0.02),
                       "actor/grad_norm": 2.0, "response_length/mean": 12, "timing_s/step": 1.5}
    assert isinstance(rows[1]["response_length/mean"], int) and "eval/accuracy" not in rows[1]


def test_resume_drops_the_rows_after_the_checkpoint_and_appends(tmp_path):
    with MetricsLogger(tmp_path, 5, tensorboard=False, progress=False) as logger:
        logger.log(0, {"eval/accuracy": 0.25})
        for step in range(1, 5):  # the run got to step 4; its checkpoint is from step 2
            logger.log(step, {"critic/score/mean": float(step)})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "critic/sco')  # a line cut short by the crash
    with MetricsLogger(tmp_path, 5, tensorboard=False, progress=False, resume_step=2) as logger:
        for step in range(3, 6):
            logger.log(step, {"critic/score/mean": 10.0 + step})
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4, 5]
    assert [row.get("critic/score/mean") for row in rows] == [None, 1.0, 2.0, 13.0, 14.0, 15.0]
    # A fresh run (resume_step=0) in the same directory starts from an empty file; None keeps it all.
    MetricsLogger(tmp_path, 5, tensorboard=False, progress=False, resume_step=None).close()
    assert len(_rows(tmp_path / "metrics.jsonl")) == 6
    with MetricsLogger(tmp_path, 5, tensorboard=False, progress=False, resume_step=0) as logger:
        logger.log(0, {"eval/accuracy": 0.5})
    assert _rows(tmp_path / "metrics.jsonl") == [{"step": 0, "eval/accuracy": 0.5}]


def test_tensorboard_event_file_is_written_and_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, 2, jsonl=False, progress=False, config={"lr": 1e-6}) as logger:
        logger.log(1, {"critic/score/mean": 0.5, "timing_s/gen": 3.0})
        logger.log(2, {"critic/score/mean": torch.tensor(0.75)})
    assert not (tmp_path / "metrics.jsonl").exists()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"critic/score/mean", "timing_s/gen"}
    score = acc.Scalars("critic/score/mean")
    assert [e.step for e in score] == [1, 2] and [e.value for e in score] == [0.5, 0.75]
    assert [(e.step, e.value) for e in acc.Scalars("timing_s/gen")] == [(1, 3.0)]
    # Resumed from the step-1 checkpoint: step 2 of the first run is purged, the new one shown.
    with MetricsLogger(tmp_path, 2, jsonl=False, progress=False, resume_step=1) as logger:
        logger.log(2, {"critic/score/mean": 0.25})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("critic/score/mean")] == [(1, 0.5), (2, 0.25)]


def test_plot_writes_a_png_and_names_missing_keys(tmp_path):
    from PIL import Image

    with MetricsLogger(tmp_path, 4, tensorboard=False, progress=False) as logger:
        for step in range(1, 5):
            logger.log(step, {"critic/score/mean": step / 4, "response_length/mean": 20.0 - step})
    png = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "plots" / "curves.png")
    assert png == tmp_path / "plots" / "curves.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    with Image.open(png) as image:
        image.verify()
    assert [p.name for p in png.parent.iterdir()] == ["curves.png"]  # no temp file left behind
    # No requested key has data: still a valid PNG, saying so.
    png = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "empty.png", keys=("actor/entropy",))
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_missing_wandb_or_tensorboard_fails_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"wandb is not installed; fix: pip install wandb"):
        MetricsLogger(tmp_path / "a", 1, tensorboard=False, wandb=True, progress=False)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"tensorboard is not installed; fix: pip install tensorboard"):
        MetricsLogger(tmp_path / "b", 1, progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_bad_values_get_a_one_line_error(tmp_path):
    with MetricsLogger(tmp_path, 1, tensorboard=False, progress=False) as logger:
        with pytest.raises(ValueError, match=r"'actor/entropy' is a tensor of shape \(2,\)"):
            logger.log(1, {"actor/entropy": torch.zeros(2)})
        with pytest.raises(TypeError, match=r"'actor/entropy' is a str, not a number"):
            logger.log(1, {"actor/entropy": "high"})
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(1, {})


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_shows_step_and_key_metrics(tmp_path):
    terminal = _Terminal()
    with MetricsLogger(tmp_path, 4, jsonl=False, tensorboard=False, resume_step=1, progress_stream=terminal) as logger:
        logger.log(2, {"critic/score/mean": 0.5, "actor/ppo_kl": 0.001, "timing_s/step": 2.0})
    shown = terminal.getvalue()
    assert "\r" in shown  # tqdm's bar, redrawn in place
    assert "2/4" in shown and "score 0.5" in shown and "kl 0.001" in shown and "s/step 2" in shown


def test_progress_elsewhere_is_one_plain_line_per_step(tmp_path, capsys):
    log = io.StringIO()  # a log file, CI, a pipe: not a terminal
    with MetricsLogger(tmp_path, 4, jsonl=False, tensorboard=False, resume_step=1, run_name="run",
                       progress_stream=log) as logger:
        logger.log(2, {"critic/score/mean": 0.5, "actor/ppo_kl": 0.001, "timing_s/step": 2.0})
        logger.log(3, {"critic/score/mean": 0.75})  # no timing_s/step: the time between the two logs
        logger.log(4, {"eval/accuracy": 0.25, "timing_s/step": 1.25})
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 3
    assert lines[0] == "run step 2/4 score 0.5 kl 0.001 s/step 2"
    assert lines[1].startswith("run step 3/4 score 0.75 s/step ") and float(lines[1].split()[-1]) >= 0
    assert lines[2] == "run step 4/4 acc 0.25 s/step 1.25"
    assert capsys.readouterr() == ("", "")  # the stream given, nothing else


def test_timer_records_and_adds_up():
    metrics = {}
    with timer("gen", metrics) as t:
        pass
    with pytest.raises(KeyError):
        with timer("gen", metrics):
            raise KeyError
    assert t.elapsed >= 0 and metrics["timing_s/gen"] >= t.elapsed and set(metrics) == {"timing_s/gen"}


def test_read_metrics_of_a_missing_file_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics file at .*; fix"):
        read_metrics(tmp_path / "metrics.jsonl")
