"""A run report: one self-contained HTML page (inline CSS, JS and SVG; nothing fetched when viewed)
with a run's learning curves from metrics.jsonl, its resolved config and its traced samples
(mrl/rollout_trace.py). `mrl report RUN_DIR` (mrl/cli/report.py) writes it."""

from __future__ import annotations

import os
from pathlib import Path

from mrl.atomic import atomic_write
from mrl.report.collect import ReportError, collect_run
from mrl.report.page import render_page

REPORT_NAME = "report.html"


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write the report of the run in `run_dir` to `out` (default RUN_DIR/report.html); returns its path."""
    page = render_page(collect_run(run_dir))
    path = Path(out) if out is not None else Path(run_dir) / REPORT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: f.write(page.encode("utf-8")))  # a reloading browser never reads half of it
    return path


__all__ = ["REPORT_NAME", "ReportError", "collect_run", "render_page", "write_report"]
