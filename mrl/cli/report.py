"""`mrl report RUN_DIR [--out FILE]`: write a run's report, one self-contained HTML page.

The page holds the learning curves of RUN_DIR/metrics.jsonl, the resolved config and the traced
samples (logging.trace_every); it opens offline in any browser. Exit 0 with the page's path;
exit 2 with a one-line error for a run directory it cannot read.
"""

from __future__ import annotations

import argparse
import sys

REPORT_NAME = "report.html"  # mrl.report.REPORT_NAME, named without importing the report's dependencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mrl report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run's output directory (trainer.output_dir), e.g. runs/tiny-cpu-grpo")
    parser.add_argument("--out", help=f"where to write the page (default: RUN_DIR/{REPORT_NAME})")
    args = parser.parse_args(argv)
    from mrl.report import ReportError, write_report

    try:
        path = write_report(args.run_dir, args.out)
    except ReportError as exc:
        print(f"mrl report: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. --out in a directory that cannot be written
        print(f"mrl report: cannot write the page: {exc}; fix: choose another --out", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
