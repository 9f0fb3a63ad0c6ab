"""docs/images/report.png: the top of a run's report (summary and the first curves) above its
traced-sample table, as headless Chromium draws them.

    .venv/bin/python scripts/report_screenshot.py RUN_DIR [--out docs/images/report.png] [--search TEXT]

Writes the report to a temporary directory (RUN_DIR is only read), asks Chromium where the sample
table starts (a first pass that dumps the DOM), takes one full-page screenshot and stacks the two crops.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from PIL import Image

from mrl.report import write_report

WIDTH, TOP, TABLE = 1280, 1130, 760  # pixels: page width, the top crop, the table crop


def chromium(*args: str) -> str:
    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    if browser is None:
        raise SystemExit("no Chromium; fix: bash scripts/setup_browser.sh")
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args],
                          capture_output=True, text=True, timeout=300, check=True)
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--out", default="docs/images/report.png")
    parser.add_argument("--search", default="", help="text typed into the sample search")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        page = write_report(args.run_dir, Path(tmp) / "report.html")
        # A copy that records where the table starts, for the crop (layout as at WIDTH pixels).
        probe = Path(tmp) / "probe.html"
        probe.write_text(page.read_text().replace("</body>", "<script>document.body.dataset.samplesTop = "
                         "Math.round(document.getElementById('samples').getBoundingClientRect().top);"
                         "document.body.dataset.height = document.documentElement.scrollHeight;</script></body>"))
        hash_ = f"#q={args.search}" if args.search else ""
        dom = chromium(f"--user-data-dir={tmp}/p1", f"--window-size={WIDTH},{TOP}", "--dump-dom", probe.as_uri() + hash_)
        samples = int(re.search(r'data-samples-top="(\d+)"', dom).group(1))
        height = int(re.search(r'data-height="(\d+)"', dom).group(1))
        shot = Path(tmp) / "full.png"
        chromium(f"--user-data-dir={tmp}/p2", f"--window-size={WIDTH},{height}", f"--screenshot={shot}",
                 page.as_uri() + hash_)
        full = Image.open(shot)
        top, table = full.crop((0, 0, WIDTH, TOP)), full.crop((0, samples - 8, WIDTH, samples + TABLE))
        out = Image.new("RGB", (WIDTH, TOP + 6 + TABLE), "#c9ced6")
        out.paste(top, (0, 0))
        out.paste(table, (0, TOP + 6))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        out.save(args.out, optimize=True)
    print(args.out)


if __name__ == "__main__":
    main()
