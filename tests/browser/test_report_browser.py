"""The report page in a real browser: headless Chromium runs the page's script, and the DOM it
leaves has a drawn curve for every metric that varies (the constant ones listed in one line), the
SFT curves, the evaluations and the saved summary, a row for every traced sample (no markup injected
by a response), a search that narrows the rows and a smoothing control that redraws the curves.
Needs Chromium: scripts/setup_browser.sh (run by `make test`) installs it; without one these tests
fail and say so, they do not skip."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mrl.report import collect_run, write_report

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")  # as setup_browser.sh


@pytest.fixture(scope="module")
def browser() -> str:
    path = os.environ.get("MRL_CHROMIUM") or next(filter(None, map(shutil.which, BROWSERS)), None)
    if not path:
        pytest.fail("no Chromium for the report's browser test; fix: bash scripts/setup_browser.sh (apt-installs "
                    "chromium; `make test` runs it), or set MRL_CHROMIUM to a Chrome/Chromium binary", pytrace=False)
    return path


def headless(browser: str, profile: Path, url: str, *flags: str) -> str:
    """Chromium's stdout after loading `url` headless (--dump-dom: the DOM once the page's script ran)."""
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--hide-scrollbars", f"--user-data-dir={profile}", *flags, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{browser} failed ({done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


@pytest.fixture
def page(synthetic_run, tmp_path) -> tuple[dict, str]:
    return collect_run(synthetic_run), write_report(synthetic_run, tmp_path / "report.html").as_uri()


def _rows(dom: str) -> int:
    return len(re.findall(r'<tr class="sample(?: dropped)?">', dom))


@pytest.fixture
def whole_run(synthetic_run) -> Path:
    """The synthetic run as a finished `mrl train` with SFT leaves it: sft/metrics.jsonl, summary.json,
    sampled accuracies at steps 0 and 6, and the async metrics a sync run logs as zeros."""
    sft = [{"step": s, "sft/loss": 2.5 / s, "sft/grad_norm": 1.0 + s, "sft/lr": 1e-5, "timing_s/step": 0.5 + 0.1 * s}
           for s in range(1, 5)]
    (synthetic_run / "sft").mkdir()
    (synthetic_run / "sft" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    rows = [json.loads(line) for line in (synthetic_run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row.update({"async/staleness_mean": 0.0, "async/queue_size": 0})
        if "eval/accuracy" in row:
            row["eval/accuracy_sampled"] = row["eval/accuracy"] - 0.05
    (synthetic_run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"resumed_from": 0, "output_dir": str(synthetic_run), "accuracy_initial": 0.125,
               "sft": {"steps": 4, "loss_first": 2.5, "loss_last": 0.625, "seconds": 12.3},
               "accuracy_before": 0.25, "accuracy_sampled_before": 0.2, "accuracy_after": 0.5,
               "accuracy_sampled_after": 0.45, "hf_model": str(synthetic_run / "hf"), "merged_hf_logprob_gap": 3e-6,
               "accuracy_merged_hf": 0.5, "seconds": 350.2}
    (synthetic_run / "summary.json").write_text(json.dumps(summary))
    return synthetic_run


def _cells(dom: str, row_class: str) -> list[list[str]]:
    """The text of each cell of the table rows of this class (tags inside a cell dropped)."""
    rows = re.findall(rf'<tr class="{row_class}">(.*?)</tr>', dom, re.S)
    return [[re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.S)] for row in rows]


def _charted(dom: str) -> list[str]:
    return re.findall(r'<svg class="chart" viewBox="[^"]*" data-title="([^"]+)"', dom)


def _points(dom: str, key: str) -> list[tuple[float, float]]:
    d = re.search(rf'<path class="series" data-key="{re.escape(key)}" d="([^"]*)"', dom).group(1)
    return [(float(x), float(y)) for x, y in re.findall(r"[ML]([\d.]+),([\d.]+)", d)]


def _ema(values: list[float], weight: float) -> list[float]:
    """The page's smoothing: an EMA debiased as TensorBoard's (the first point is the first value)."""
    out, acc = [], 0.0
    for n, v in enumerate(values, 1):
        acc = weight * acc + (1 - weight) * v
        out.append(acc / (1 - weight ** n))
    return out


def test_the_browser_draws_every_curve_and_every_traced_sample(browser, page, tmp_path):
    data, url = page
    dom = headless(browser, tmp_path / "profile", url, "--dump-dom")
    charts = [chart for section in data["sections"] for chart in section["charts"]]
    assert dom.count('<svg class="chart"') == len(charts) == 8
    assert len(re.findall(r'class="series(?: area)?" data-key="', dom)) == sum(len(c["keys"]) for c in charts)
    assert re.search(r'<path class="series" data-key="critic/score/mean" d="M[\d.]+,[\d.]+(L[\d.]+,[\d.]+){5}"', dom)
    assert _rows(dom) == len(data["samples"]) == 18
    assert '<span id="trace-count">18 of 18 matching samples shown (18 traced)</span>' in dom
    # A response is text, never markup: shown escaped in its cell, no element made of it.
    assert '<b id="injected">' not in dom and "&lt;/script&gt;&lt;b id=injected&gt;x&lt;/b&gt;</td>" in dom
    assert re.search(r'<pre id="config-text">trainer:\n  name: tiny-cpu-grpo', dom)
    # A run without summary.json (it ended early, or predates it) still renders, and says so.
    assert '<div class="muted" data-item="run wall time">run wall time<b>– (no summary.json)</b></div>' in dom
    assert re.search(r'<div id="summary-source" class="muted">no summary.json in [^<]*synthetic-run: ', dom)
    assert _cells(dom, "summary-row") == [] and "SFT" not in _charted(dom)


def test_the_whole_run_sft_evaluations_summary_and_constants(browser, whole_run, tmp_path):
    dom = headless(browser, tmp_path / "profile", write_report(whole_run, tmp_path / "r.html").as_uri(), "--dump-dom")
    charted = _charted(dom)
    assert charted[:3] == ["sft/loss", "sft/grad_norm", "timing_s/step"]  # the SFT section comes first
    assert '<h2 id="section-0">SFT warm start</h2>' in dom
    assert '<p class="constant" data-part="SFT"><b>SFT constant: </b>sft/lr=1e-5</p>' in dom
    constant = re.search(r'<p class="constant" data-part="RL"><b>RL constant: </b>([^<]*)</p>', dom).group(1)
    assert constant.split(", ") == ["async/queue_size=0", "async/staleness_mean=0", "response_length/clip_ratio=0",
                                    "rollout/train_logprob_abs_diff_max=4e-6", "rollout/train_logprob_abs_diff_mean=1e-6",
                                    "sync/bytes=1e+6"]
    assert not any(title.startswith(("async/", "rollout/", "sync/")) for title in charted)  # listed, not charted
    assert _cells(dom, "evaluation") == [
        ["before SFT", "–", "0.125", "–", "summary.json accuracy_initial"],
        ["after SFT, before RL", "0", "0.25", "0.2", "metrics.jsonl step 0 = summary.json accuracy_before"],
        ["after RL", "6", "0.5", "0.45", "metrics.jsonl step 6 = summary.json accuracy_after"],
        ["merged HF model", "–", "0.5", "–", f"summary.json accuracy_merged_hf ({whole_run / 'hf'} in a fresh engine); "
                                             "log-prob gap to the run's engine 3e-6 (merged_hf_logprob_gap)"]]
    summary = dict(_cells(dom, "summary-row"))
    assert summary["accuracy_initial"] == "0.125" and summary["sft.loss_last"] == "0.625"
    assert summary["seconds"] == "350.2" and summary["hf_model"] == str(whole_run / "hf")
    assert len(summary) == 15  # every entry, sft's four flattened
    # The run's wall time is the summary's, not the RL steps' sum, and both are said.
    assert '<div class="muted" data-item="run wall time">run wall time<b>5 min 50 s</b></div>' in dom
    assert '<div class="muted" data-item="time in RL steps">time in RL steps<b>6 s</b></div>' in dom
    assert '<div class="muted" data-item="SFT">SFT<b>4 steps, 12 s</b></div>' in dom


def test_the_smoothing_control_redraws_the_curves(browser, whole_run, tmp_path):
    page = write_report(whole_run, tmp_path / "r.html")
    raw = headless(browser, tmp_path / "profile", page.as_uri(), "--dump-dom")
    assert '<section id="curves" data-smoothing="0">' in raw
    # The address picks the smoothing (a link keeps the view); the axes stay, the curve moves.
    smoothed = headless(browser, tmp_path / "profile", f"{page.as_uri()}#smooth=0.9", "--dump-dom")
    assert '<section id="curves" data-smoothing="0.9">' in smoothed
    values = [0.1, 0.2, 0.3, 0.99, 0.5, 0.6]  # critic/score/mean, steps 1-6
    drawn = _points(raw, "critic/score/mean")
    scale = (drawn[3][1] - drawn[0][1]) / (values[3] - values[0])  # pixels per unit, from the extremes

    def expected(weight):  # the smoothed values on the raw curve's axes, x then y per point
        return [c for (x, _), v in zip(drawn, _ema(values, weight)) for c in (x, drawn[0][1] + scale * (v - values[0]))]

    def flat(points):
        return [c for point in points for c in point]

    assert _points(smoothed, "critic/score/mean") != drawn
    assert flat(_points(smoothed, "critic/score/mean")) == pytest.approx(expected(0.9), abs=0.2)  # drawn to 0.1 px
    assert _points(smoothed, "sft/loss") != _points(raw, "sft/loss")  # the SFT curves too
    # The control itself: choosing EMA 0.6 redraws in place and records it in the address.
    script = ("<script>const s = document.getElementById('smoothing'); s.value = '0.6';"
              "s.dispatchEvent(new Event('change')); document.body.setAttribute('data-hash', location.hash);</script>")
    chosen = tmp_path / "chosen.html"
    chosen.write_text(page.read_text().replace("</body>", f"{script}</body>"))
    dom = headless(browser, tmp_path / "profile", chosen.as_uri(), "--dump-dom")
    assert '<section id="curves" data-smoothing="0.6">' in dom and 'data-hash="#smooth=0.6"' in dom
    assert flat(_points(dom, "critic/score/mean")) == pytest.approx(expected(0.6), abs=0.2)
    assert re.search(r'<path class="raw" d="M[^"]*" stroke="[^"]*" visibility="visible"', dom)  # raw curve kept, faint


@pytest.mark.parametrize("hash_, rows", [("q=17%2B25", 6), ("step=4", 6), ("q=17%2B25&step=4", 2), ("q=nowhere", 0)])
def test_the_search_narrows_the_table(browser, page, tmp_path, hash_, rows):
    _, url = page
    dom = headless(browser, tmp_path / "profile", f"{url}#{hash_}", "--dump-dom")
    assert _rows(dom) == rows
    assert f'<span id="trace-count">{rows} of {rows} matching samples shown (18 traced)</span>' in dom


def test_a_screenshot_of_the_page(browser, page, tmp_path):
    _, url = page
    shot = tmp_path / "report.png"
    headless(browser, tmp_path / "profile", url, f"--screenshot={shot}", "--window-size=1280,1600")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_an_episode_shows_its_conversation_and_the_turns_that_train(browser, synthetic_run, tmp_path):
    record = {"step": 8, "sample": 0, "of": 1, "group": 0, "prompt": "12*2", "response": "24", "score": 1.0,
              "reward_info": {}, "kept": True, "truncated": {},
              "conversation": [{"role": "assistant", "content": "<tool_call>x</tool_call>", "trains": True},
                               {"role": "tool", "content": "24", "trains": False},
                               {"role": "assistant", "content": "24", "trains": True}],
              "agent": {"turns": 2, "tool_calls": 1, "tool_errors": 0, "truncated": False}}
    (synthetic_run / "rollouts" / "step_000008.jsonl").write_text(json.dumps(record) + "\n")
    url = write_report(synthetic_run, tmp_path / "report.html").as_uri()
    dom = headless(browser, tmp_path / "profile", url, "--dump-dom")
    assert ('<div class="turn trains"><b>assistant (trains): </b>&lt;tool_call&gt;x&lt;/tool_call&gt;</div>'
            '<div class="turn"><b>tool: </b>24</div><div class="turn trains"><b>assistant (trains): </b>24</div>'
            '<div class="cut">2 turns, 1 tool calls (0 failed)</div>') in dom
