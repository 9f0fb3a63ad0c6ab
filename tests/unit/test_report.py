"""`mrl report`: what it gathers from a run directory (curves of RL and SFT, constants, evaluations,
the saved summary), the page it writes (self-contained, data escaped) and its one-line errors. The
page as a browser draws it: tests/browser/test_report_browser.py."""

import json
import re

import pytest

from mrl.cli import main as mrl
from mrl.report import ReportError, collect_run, render_page, write_report
from mrl.report.collect import chart_sections


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
                              "Timing", "Other"]  # the drift and the sync bytes never change: not charted
    reward = sections["Reward and accuracy"]
    assert [(c["title"], c["keys"]) for c in reward] == [
        ("critic/score", ["critic/score/mean", "critic/score/max", "critic/score/min"]),
        ("eval/accuracy", ["eval/accuracy"])]  # max and min are constant, but drawn beside the mean
    assert [(c["title"], c["keys"]) for c in sections["Response length"]] == [
        ("response_length", ["response_length/mean", "response_length/max"])]
    assert [c["keys"] for c in sections["Other"]] == [["custom/thing"]]
    drift = "rollout/train_logprob_abs_diff_"
    sections, _ = chart_sections({f"{drift}max": [1.0, 2.0], f"{drift}mean": [0.5, 1.0]})
    assert sections[0]["charts"][0]["keys"] == [f"{drift}mean", f"{drift}max"]  # mean first


def test_a_metric_constant_over_the_run_is_listed_not_charted(synthetic_run):
    rows = [json.loads(line) for line in (synthetic_run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # what a sync run logs of the async machinery, and a phase that never waits
        row.update({"async/staleness_mean": 0.0, "async/queue_size": 0, "timing_s/wait_rollout": 0.0})
    rows[3]["async/dropped_samples"] = 0  # logged once
    (synthetic_run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = collect_run(synthetic_run)
    assert data["constant"] == [["async/dropped_samples", 0], ["async/queue_size", 0], ["async/staleness_mean", 0.0],
                                ["response_length/clip_ratio", 0.0], ["rollout/train_logprob_abs_diff_max", 4e-6],
                                ["rollout/train_logprob_abs_diff_mean", 1e-6], ["sync/bytes", 1e6],
                                ["timing_s/wait_rollout", 0.0]]
    charted = {k for section in data["sections"] for chart in section["charts"] for k in chart["keys"]}
    assert not charted & {k for k, _ in data["constant"]}
    stack = next(c for s in data["sections"] for c in s["charts"] if c["kind"] == "stack")
    assert "timing_s/wait_rollout" not in stack["keys"] and "timing_s/gen" in stack["keys"]  # constant, not idle
    only_constant, constant = chart_sections({"timing_s/gen": [0.3, 0.3], "timing_s/step": [1.0, 1.0]})
    assert only_constant == [] and constant == [["timing_s/gen", 0.3], ["timing_s/step", 1.0]]


def _write_sft(run, steps=4):
    rows = [{"step": s, "sft/loss": 2.5 / s, "sft/grad_norm": 1.0 + s, "sft/lr": 1e-5, "sft/skipped": 0.0,
             "sft/padding_fraction": 0.25, "timing_s/step": 0.5 + 0.1 * s} for s in range(1, steps + 1)]
    (run / "sft").mkdir()
    (run / "sft" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_sft_warm_start_has_its_own_curves(synthetic_run):
    assert collect_run(synthetic_run)["sft"] is None  # no SFT, no section
    _write_sft(synthetic_run)
    sft = collect_run(synthetic_run)["sft"]
    assert sft["steps"] == [1, 2, 3, 4] and sft["source"] == str(synthetic_run / "sft" / "metrics.jsonl")
    assert [(s["title"], [c["title"] for c in s["charts"]]) for s in sft["sections"]] == [
        ("SFT warm start", ["sft/loss", "sft/grad_norm", "timing_s/step"])]  # the step time is a curve of its own
    assert sft["constant"] == [["sft/lr", 1e-5], ["sft/padding_fraction", 0.25], ["sft/skipped", 0.0]]
    assert "timing_s/(rest of step)" not in sft["series"]


SUMMARY = {"resumed_from": 0, "output_dir": "runs/x", "accuracy_initial": 0.125,
           "sft": {"steps": 4, "loss_first": 2.5, "loss_last": 0.625, "seconds": 12.3},
           "accuracy_before": 0.25, "accuracy_after": 0.5, "hf_model": "runs/x/hf", "merged_hf_logprob_gap": 3e-6,
           "accuracy_merged_hf": 0.5, "plot": "runs/x/curves.png", "seconds": 350.2}


def _evaluations(data):
    return [(r["when"], r["step"], r["greedy"], r["sampled"], r["source"]) for r in data["evaluations"]]


def test_every_evaluation_of_the_run_with_where_it_came_from(synthetic_run):
    _write_sft(synthetic_run)
    (synthetic_run / "summary.json").write_text(json.dumps(SUMMARY))
    data = collect_run(synthetic_run)
    assert _evaluations(data) == [
        ("before SFT", None, 0.125, None, "summary.json accuracy_initial"),
        ("after SFT, before RL", 0, 0.25, None, "metrics.jsonl step 0 = summary.json accuracy_before"),
        ("after RL", 6, 0.5, None, "metrics.jsonl step 6 = summary.json accuracy_after"),
        ("merged HF model", None, 0.5, None, "summary.json accuracy_merged_hf (runs/x/hf in a fresh engine)")]
    assert data["evaluations"][-1]["gap"] == 3e-6
    assert data["summary"] == SUMMARY and data["summary_source"] == str(synthetic_run / "summary.json")
    assert data["summary_rows"][:4] == [["resumed_from", 0], ["output_dir", "runs/x"], ["accuracy_initial", 0.125],
                                        ["sft.steps", 4]]
    assert ["seconds", 350.2] in data["summary_rows"] and ["sft.seconds", 12.3] in data["summary_rows"]


def test_a_resumed_or_stopped_run_shows_the_evaluations_only_its_summary_holds(synthetic_run):
    resumed = {"resumed_from": 4, "accuracy_before": 0.375, "accuracy_after": 0.5, "seconds": 20.0}
    (synthetic_run / "summary.json").write_text(json.dumps(resumed))
    assert _evaluations(collect_run(synthetic_run)) == [
        ("before RL", 0, 0.25, None, "metrics.jsonl step 0"),
        ("on resuming at step 4", 4, 0.375, None, "summary.json accuracy_before (not in metrics.jsonl)"),
        ("after RL", 6, 0.5, None, "metrics.jsonl step 6 = summary.json accuracy_after")]
    rows = [json.loads(line) for line in (synthetic_run / "metrics.jsonl").read_text().splitlines()]
    (synthetic_run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 3))
    stopped = {"resumed_from": 0, "accuracy_before": 0.25, "accuracy_after": 0.25,  # no evaluation after step 0
               "stopped": {"signal": "SIGTERM", "step": 3, "checkpoint": "ckpt/iter_0000003"}, "seconds": 9.5}
    (synthetic_run / "summary.json").write_text(json.dumps(stopped))
    data = collect_run(synthetic_run)
    assert _evaluations(data) == [
        ("before RL", 0, 0.25, None,
         "metrics.jsonl step 0 = summary.json accuracy_before = summary.json accuracy_after")]
    assert ["stopped.signal", "SIGTERM"] in data["summary_rows"]


def test_a_run_without_summary_json_still_reports_and_says_so(synthetic_run):
    data = collect_run(synthetic_run)
    assert data["summary"] is None and data["summary_rows"] == []
    assert data["summary_source"].startswith(f"no summary.json in {synthetic_run}: `mrl train` writes it")
    assert _evaluations(data) == [("before RL", 0, 0.25, None, "metrics.jsonl step 0"),
                                  ("after RL", 6, 0.5, None, "metrics.jsonl step 6")]
    _write_sft(synthetic_run)
    assert _evaluations(collect_run(synthetic_run))[0] == ("before SFT", None, None, None,
                                                           "not recorded: no summary.json")
    (synthetic_run / "summary.json").write_text('{"seconds": 1')  # cut short
    data = collect_run(synthetic_run)
    assert data["summary"] is None and "summary.json is not JSON" in data["summary_source"]


def test_timing_is_one_stacked_chart_of_the_phases_and_the_rest_of_the_step(synthetic_run):
    data = collect_run(synthetic_run)
    stack, throughput = {s["title"]: s["charts"] for s in data["sections"]}["Timing"]  # phases constant but one
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
