"""The run's saved summary (OUTPUT_DIR/summary.json, written by `mrl train` when it ends) and its
held-out evaluations in the order they happened: before SFT, before RL (step 0), during RL, after
RL and of the merged HF model, each with the file and key its number came from.
docs/observability.md ("The run report") says what the page shows."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

SUMMARY_NAME = "summary.json"
GREEDY, SAMPLED = "eval/accuracy", "eval/accuracy_sampled"


def read_summary(run: Path) -> tuple[dict | None, str]:
    """summary.json's object and where it came from, or None and why there is none."""
    path = run / SUMMARY_NAME
    if not path.is_file():
        return None, (f"no {SUMMARY_NAME} in {run}: `mrl train` writes it when the run ends, so the run "
                      f"did not finish or predates it")
    try:
        summary = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"{path} is not JSON ({exc}); the summary is not shown"
    if not isinstance(summary, dict):
        return None, f"{path} holds no JSON object; the summary is not shown"
    return summary, str(path)


def summary_rows(summary: dict | None) -> list[list[Any]]:
    """[key, value] per entry, in the file's order; nested objects flattened (sft.loss_first)."""
    rows: list[list[Any]] = []
    for key, value in (summary or {}).items():
        if isinstance(value, dict):
            rows.extend([f"{key}.{k}", v] for k, v in value.items())
        else:
            rows.append([key, value])
    return rows


def evaluations(steps: list[int], series: dict[str, list], summary: dict | None, sft_ran: bool) -> list[dict]:
    """One row per held-out evaluation: when (a phrase), step (None outside RL), greedy and sampled
    accuracy, source (file and key), and for the merged model the log-prob gap to the run's engine.
    A row whose number the summary also holds says so (= summary.json accuracy_after)."""
    s = summary or {}
    rows = []
    if sft_ran or "accuracy_initial" in s:
        rows.append(_row("before SFT", None, s.get("accuracy_initial"), None,
                         f"{SUMMARY_NAME} accuracy_initial" if "accuracy_initial" in s else _absent(summary)))
    greedy, sampled = series.get(GREEDY, [None] * len(steps)), series.get(SAMPLED, [None] * len(steps))
    logged = [i for i in range(len(steps)) if greedy[i] is not None or sampled[i] is not None]
    resumed = s.get("resumed_from") or 0
    matched, rl = set(), []
    for i in logged:
        step, source = steps[i], [f"metrics.jsonl step {steps[i]}"]
        if step == 0:
            when = "after SFT, before RL" if sft_ran else "before RL"
            if not resumed and _matches(s, "before", greedy[i], sampled[i]):
                source.append(f"= {SUMMARY_NAME} accuracy_before")
                matched.add("before")
        else:
            when = "after RL" if i == len(steps) - 1 else "during RL"
        if i == logged[-1] and _matches(s, "after", greedy[i], sampled[i]):
            source.append(f"= {SUMMARY_NAME} accuracy_after")
            matched.add("after")
        rl.append(_row(when, step, greedy[i], sampled[i], " ".join(source)))
    # The summary's own numbers that no metrics.jsonl row holds: a resumed run evaluates on resuming
    # without logging it, and a run stopped by a signal keeps its last evaluation as "after".
    if "accuracy_before" in s and "before" not in matched:
        when = f"on resuming at step {resumed}" if resumed else "before RL"
        rl.append(_row(when, resumed, s["accuracy_before"], s.get("accuracy_sampled_before"),
                       f"{SUMMARY_NAME} accuracy_before (not in metrics.jsonl)"))
        rl.sort(key=lambda row: row["step"])  # stable: after a row of the same step from before the resume
    rows += rl
    if "accuracy_after" in s and "after" not in matched:
        rows.append(_row("after RL", None, s["accuracy_after"], s.get("accuracy_sampled_after"),
                         f"{SUMMARY_NAME} accuracy_after (no metrics.jsonl row holds it)"))
    if "accuracy_merged_hf" in s or "merged_hf_logprob_gap" in s:
        model = f" ({s['hf_model']} in a fresh engine)" if s.get("hf_model") else ""
        rows.append(_row("merged HF model", None, s.get("accuracy_merged_hf"), None,
                         f"{SUMMARY_NAME} accuracy_merged_hf{model}", gap=s.get("merged_hf_logprob_gap")))
    return rows


def _row(when: str, step: int | None, greedy: Any, sampled: Any, source: str, gap: Any = None) -> dict:
    return {"when": when, "step": step, "greedy": greedy, "sampled": sampled, "source": source, "gap": gap}


def _absent(summary: dict | None) -> str:
    return f"not recorded: no {SUMMARY_NAME}" if summary is None else f"not in {SUMMARY_NAME}"


def _matches(summary: dict, when: str, greedy: Any, sampled: Any) -> bool:
    """The summary's accuracy_<when> (and accuracy_sampled_<when>, if any) is this row's."""
    key, sampled_key = f"accuracy_{when}", f"accuracy_sampled_{when}"
    return key in summary and _same(summary[key], greedy) and (
        sampled_key not in summary or _same(summary[sampled_key], sampled))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a is None and b is None
