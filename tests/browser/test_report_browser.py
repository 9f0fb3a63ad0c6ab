"""The report page in a real browser: headless Chromium runs the page's script, and the DOM it
leaves has a drawn curve for every metric, a row for every traced sample (no markup injected by a
response), and a search that narrows the rows. Needs Chromium: scripts/setup_browser.sh (run by
`make test`) installs it; without one these tests fail and say so, they do not skip."""

from __future__ import annotations

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


def test_the_browser_draws_every_curve_and_every_traced_sample(browser, page, tmp_path):
    data, url = page
    dom = headless(browser, tmp_path / "profile", url, "--dump-dom")
    charts = [chart for section in data["sections"] for chart in section["charts"]]
    assert dom.count('<svg class="chart"') == len(charts) == 11
    assert len(re.findall(r'class="series(?: area)?" data-key="', dom)) == sum(len(c["keys"]) for c in charts)
    assert re.search(r'<path class="series" data-key="critic/score/mean" d="M[\d.]+,[\d.]+(L[\d.]+,[\d.]+){5}"', dom)
    assert _rows(dom) == len(data["samples"]) == 18
    assert '<span id="trace-count">18 of 18 matching samples shown (18 traced)</span>' in dom
    # A response is text, never markup: shown escaped in its cell, no element made of it.
    assert '<b id="injected">' not in dom and "&lt;/script&gt;&lt;b id=injected&gt;x&lt;/b&gt;</td>" in dom
    assert re.search(r'<pre id="config-text">trainer:\n  name: tiny-cpu-grpo', dom)


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
