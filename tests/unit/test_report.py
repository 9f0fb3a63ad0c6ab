"""`mrl report`: what it gathers from a run directory, the page it writes (self-contained, data
escaped) and its one-line errors. The page as a browser draws it: tests/browser/test_report_browser.py."""

import json
import re

import pytest

from mrl.cli import main as mrl
from mrl.report import ReportError, collect_run, render_page, write_report


def _embedded(page: str) -> dict:
    block = re.search(r'<script type="application/json" id="run-data">(.*?)</script>', page, re.S).group(1)
    return json.loads(block)


def test_metrics_become_charts_grouped_by_section(synthetic_run):
    data = collect_run(synthetic_run)
    assert data["run"] == "tiny-cpu-grpo" and data["steps"] == [0, 1, 2, 3, 4, 5, 6]  # trainer.name
    assert data["series"]["critic/score/mean"][4] == 0.99  # step 4 logged twice: the later row
    assert data["series"]["actor/ppo_kl"][5] is None  # NaN: JSON has none
    assert data["series"]["critic/score/mean"][0] is None  # step 0 logs no score
    sections = {s["title"]: s["charts"] for s in data["sections"]}
    assert list(sections) == ["Reward and accuracy", "Response length", "Policy update: entropy, KL, clipping",
                              "Drift: engine vs trainer log-probs", "Weight sync", "Timing", "Other"]
    reward = sections["Reward and accuracy"]
    assert [(c["title"], c["keys"]) for c in reward] == [
        ("critic/score", ["critic/score/mean", "critic/score/max", "critic/score/min"]),
        ("eval/accuracy", ["eval/accuracy"])]
    assert [c["title"] for c in sections["Response length"]] == ["response_length", "response_length/clip_ratio"]
    assert sections["Drift: engine vs trainer log-probs"][0]["keys"] == [
        "rollout/train_logprob_abs_diff_mean", "rollout/train_logprob_abs_diff_max"]
    assert [c["keys"] for c in sections["Other"]] == [["custom/thing"]]


def test_timing_is_one_stacked_chart_of_the_phases_and_the_rest_of_the_step(synthetic_run):
    data = collect_run(synthetic_run)
    stack, throughput = {s["title"]: s["charts"] for s in data["sections"]}["Timing"]
    assert stack["kind"] == "stack" and stack["total"] == "timing_s/step"
    assert stack["keys"] == ["timing_s/gen", "timing_s/reward", "timing_s/update_actor", "timing_s/sync_weights",
                             "timing_s/(rest of step)"]  # in the loop's order, the unaccounted time on top
    assert data["series"]["timing_s/(rest of step)"][1] == pytest.approx(1.0 - 0.3 - 0.01 - 0.5 - 0.1)
    assert data["series"]["timing_s/(rest of step)"][0] is None  # step 0 (the first sync) is no step
    assert throughput["keys"] == ["perf/throughput"]


def test_config_and_samples_are_read(synthetic_run):
    data = collect_run(synthetic_run)
    assert data["config_source"] == str(synthetic_run / "config.yaml")
    assert "trace_every: 2" in data["config"] and "name: tiny-cpu-grpo" in data["config"]
    assert [(r["step"], r["sample"]) for r in data["samples"]][:7] == [(2, i) for i in range(6)] + [(4, 0)]
    assert len(data["samples"]) == 18 and data["samples"][0]["of"] == 8


def test_a_run_without_config_yaml_shows_the_checkpointed_config(synthetic_run):
    import torch

    from mrl import checkpoint_dir as cd

    (synthetic_run / "config.yaml").unlink()
    data = collect_run(synthetic_run)
    assert data["config"] is None and data["run"] == "synthetic-run"  # no config: the directory's name
    iteration = synthetic_run / "checkpoints" / "iter_0000006"
    iteration.mkdir(parents=True)
    torch.save({"step": 6, "config": {"trainer": {"name": "from-checkpoint"}}}, iteration / "common.pt")
    cd.write_manifest(iteration, step=6)
    data = collect_run(synthetic_run)
    assert data["config"] == "trainer:\n  name: from-checkpoint\n"
    assert data["config_source"].startswith(str(iteration / "common.pt"))


def test_the_page_is_self_contained_and_its_data_cannot_break_out(synthetic_run):
    data = collect_run(synthetic_run)
    page = render_page(data)
    assert "@@" not in page  # every placeholder filled
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|url\(|@import", page)  # nothing fetched when viewed
    assert re.findall(r"https?://[^\s\"'`]+", page) == ["http://www.w3.org/2000/svg"]  # a namespace, not a fetch
    assert page.count("</script>") == 2  # the response holding "</script>" stays inside the data
    assert _embedded(page) == data


def test_write_report_defaults_into_the_run_directory(synthetic_run, tmp_path):
    assert write_report(synthetic_run) == synthetic_run / "report.html"
    out = write_report(synthetic_run, tmp_path / "pages" / "r.html")
    assert _embedded(out.read_text())["path"] == str(synthetic_run.resolve())


def test_bad_run_directories_get_one_line_naming_the_fix(tmp_path, capsys):
    with pytest.raises(ReportError, match=r"no run directory at .*missing; fix: pass a run's trainer.output_dir"):
        collect_run(tmp_path / "missing")
    with pytest.raises(ReportError, match=r"has no metrics.jsonl; fix: pass the trainer.output_dir of a run"):
        collect_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "x": 1.0')  # cut short by a crash
    with pytest.raises(ReportError, match="has no step rows yet"):
        collect_run(tmp_path)
    assert mrl(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mrl report: no run directory at") and err.count("\n") == 1


def test_the_command_writes_the_page_and_prints_its_path(synthetic_run, tmp_path, capsys):
    assert mrl(["report", str(synthetic_run), "--out", str(tmp_path / "r.html")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "r.html")
    assert (tmp_path / "r.html").stat().st_size > 0
