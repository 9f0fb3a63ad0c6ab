"""What a run directory holds, gathered for the report page: the RL and SFT curves grouped into
charts (a metric constant over the run is listed, not charted), the evaluations, the saved summary,
the resolved config and the traced samples. Pure reading: nothing in the run directory changes."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import yaml

from mrl.checkpoint_dir import list_iterations
from mrl.config import SAVED_NAME as CONFIG_NAME
from mrl.metrics import JSONL_NAME, read_metrics
from mrl.report.evaluations import evaluations, read_summary, summary_rows
from mrl.rollout_trace import read_traces


class ReportError(ValueError):
    """A run directory the report cannot be made from; the message names the problem and the fix."""


# Sections of the page, in order: (title, metric-name prefixes). A metric goes to the first section
# with a matching prefix (so critic/score/ lands in the rewards, not with the PPO critic).
SECTIONS: list[tuple[str, tuple[str, ...]]] = [
    ("Reward and accuracy", ("critic/score/", "eval/", "actor/kept_sample_fraction")),
    ("Response length", ("response_length/",)),
    ("Policy update: entropy, KL, clipping", ("actor/",)),
    ("Advantages and returns", ("critic/advantages", "critic/returns")),
    ("Critic (PPO)", ("critic/",)),
    ("Drift: engine vs trainer log-probs", ("rollout/",)),
    ("Weight sync", ("sync/",)),
    ("Timing", ("timing_s/", "perf/")),
]
OTHER = "Other"
SFT_DIR = "sft"  # mrl/sft.py logs the warm start's steps to OUTPUT_DIR/sft/metrics.jsonl
SFT_SECTIONS: list[tuple[str, tuple[str, ...]]] = [("SFT warm start", ("",))]
STEP_TIME = "timing_s/step"
REST_OF_STEP = "timing_s/(rest of step)"  # the step's time no timed phase accounts for
# The loop's phases in the order they run (mrl/trainer.py), stacked bottom to top; others follow.
PHASES = ("gen", "reward", "old_log_prob", "values", "update_critic", "update_actor", "sync_weights")
# What a chart shows, for the metric families whose name alone does not say it.
NOTES = {
    "critic/score": "the reward function's score per sample",
    "eval/accuracy": "greedy accuracy on the held-out split",
    "actor/entropy": "the policy's mean token entropy on the sampled responses",
    "actor/ppo_kl": "KL between the rollout policy and the updated one, in the update",
    "actor/kl_loss": "KL to the frozen reference (algo.kl_coef)",
    "actor/pg_clipfrac": "fraction of tokens whose ratio was clipped",
    "response_length/clip_ratio": "fraction of responses cut at rollout.max_new_tokens",
    "rollout/train_logprob_abs_diff": "|engine's sampling log-prob - trainer's log-prob| on the sampled tokens",
    "rollout/train_kl": "KL(engine || trainer) on the sampled tokens (k3 estimate)",
    "rollout/logprob_abs_diff": "the parity gate: |engine - trainer| log-prob on the probe batch, when checked",
    "critic/vf_explained_var": "how much of the returns' variance the critic's values explain",
    "timing_s/phases": "seconds per step by phase, stacked; the line is the whole step",
    "sft/loss": "next-token loss on the answer tokens",
    "sft/padding_fraction": "fraction of the batch's tokens that are padding",
}
# Families shown first in their section, in this order (the rest follow alphabetically).
FIRST = ("sft/loss", "critic/score", "eval/accuracy", "response_length", "actor/entropy", "actor/ppo_kl",
         "actor/kl_loss", "actor/pg_loss", "actor/pg_clipfrac", "actor/ratio", "actor/grad_norm",
         "rollout/train_logprob_abs_diff")
_STAT = re.compile(r"(?:[/_])(mean|max|min)$")
_STATS = ("mean", "max", "min")


def collect_run(run_dir: str | Path) -> dict[str, Any]:
    """Everything the page shows, as plain JSON-able data. Raises ReportError for a run directory
    that is missing or has no metrics."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ReportError(f"no run directory at {run}; fix: pass a run's trainer.output_dir (e.g. runs/tiny-cpu-grpo)")
    if not (run / JSONL_NAME).is_file():
        raise ReportError(f"{run} has no {JSONL_NAME}; fix: pass the trainer.output_dir of a run that logged "
                          f"metrics (logging.jsonl: true), not its checkpoint directory")
    steps, series = metric_series(read_metrics(run / JSONL_NAME))
    if not steps:
        raise ReportError(f"{run / JSONL_NAME} has no step rows yet; fix: report on a run that has logged a step")
    config, config_source = read_config(run)
    sections, constant = chart_sections(series)
    sft = sft_curves(run)
    summary, summary_source = read_summary(run)
    return {
        "run": _run_name(config) or run.resolve().name,
        "path": str(run.resolve()),
        "steps": steps,
        "series": series,
        "sections": sections,
        "constant": constant,
        "sft": sft,
        "evaluations": _finite(evaluations(steps, series, summary, sft is not None or "sft" in (summary or {}))),
        "summary": _finite(summary),
        "summary_rows": _finite(summary_rows(summary)),
        "summary_source": summary_source,
        "config": config,
        "config_source": config_source,
        "samples": _finite(read_traces(run)),
    }


def sft_curves(run: Path) -> dict | None:
    """The SFT warm start's steps, series and charts (its own x axis), or None for a run without one."""
    path = run / SFT_DIR / JSONL_NAME
    if not path.is_file():
        return None
    steps, series = metric_series(read_metrics(path), rest_of_step=False)
    if not steps:
        return None
    sections, constant = chart_sections(series, SFT_SECTIONS)
    return {"steps": steps, "series": series, "sections": sections, "constant": constant, "source": str(path)}


def metric_series(rows: list[dict], rest_of_step: bool = True) -> tuple[list[int], dict[str, list[float | None]]]:
    """Steps in order and each numeric metric's value at each step (None where not logged); a step
    logged twice keeps its last row; non-finite values become None (JSON has no NaN). With
    `rest_of_step`, timing_s/(rest of step): the step's time that no timed phase accounts for."""
    by_step: dict[int, dict] = {}
    for row in rows:
        by_step[row["step"]] = row
    steps = sorted(by_step)
    keys = sorted({k for row in by_step.values() for k, v in row.items() if k != "step" and _number(v)})
    series = {key: [_finite(by_step[s].get(key)) if _number(by_step[s].get(key)) else None for s in steps]
              for key in keys}
    if rest_of_step and STEP_TIME in series:
        series[REST_OF_STEP] = _rest_of_step(series, len(steps))
    return steps, series


def _rest_of_step(series: dict[str, list], count: int) -> list[float | None]:
    phases = [k for k in series if k.startswith("timing_s/") and k != STEP_TIME]
    rest = []
    for i in range(count):
        total = series[STEP_TIME][i]
        rest.append(None if total is None else max(0.0, total - sum(series[k][i] or 0.0 for k in phases)))
    return rest


def chart_sections(series: dict[str, list], layout: list[tuple[str, tuple[str, ...]]] = SECTIONS,
                   ) -> tuple[list[dict], list[list]]:
    """The page's sections, each a list of charts, and the [name, value] of each metric constant over
    the run. A chart draws one metric family (a name and its _mean/_max/_min or /mean/max/min
    variants share a scale); timing phases are one stacked chart. A chart none of whose curves varies
    is not drawn: its metrics join the constants (an all-zero async metric of a sync run)."""
    sections: dict[str, list[str]] = {title: [] for title, _ in layout}
    sections[OTHER] = []
    for key in series:
        title = next((t for t, prefixes in layout if key.startswith(prefixes)), OTHER)
        sections[title].append(key)
    out, constant = [], {}
    for title, members in sections.items():
        charts = []
        for chart in _charts(members):
            keys = chart["keys"] + ([chart["total"]] if chart["total"] else [])
            if not any(_varies(series[k]) for k in keys):
                constant.update((k, _constant_value(series[k])) for k in keys)
                continue
            if chart["kind"] == "stack":  # a phase that never took time adds nothing to the stack
                idle = [k for k in chart["keys"] if not any(series[k])]
                constant.update((k, _constant_value(series[k])) for k in idle)
                chart["keys"] = [k for k in chart["keys"] if k not in idle]
            charts.append(chart)
        if charts:
            out.append({"title": title, "charts": charts})
    return out, [[k, constant[k]] for k in sorted(constant)]


def _varies(values: list) -> bool:
    return len({v for v in values if v is not None}) > 1


def _constant_value(values: list) -> float | None:
    return next((v for v in values if v is not None), None)


def _charts(keys: list[str]) -> list[dict]:
    timing = sorted((k for k in keys if k.startswith("timing_s/") and k != STEP_TIME), key=_phase_order)
    charts = []
    if timing:
        charts.append({"title": "timing_s/phases", "note": NOTES["timing_s/phases"], "kind": "stack",
                       "keys": timing, "total": STEP_TIME if STEP_TIME in keys else None})
    families: dict[str, list[str]] = {}
    for key in keys:
        if key not in timing and (key != STEP_TIME or not timing):  # no phases (SFT): the step is a curve
            families.setdefault(_STAT.sub("", key), []).append(key)
    for family in sorted(families, key=lambda f: (FIRST.index(f) if f in FIRST else len(FIRST), f)):
        members = sorted(families[family], key=_stat_order)
        charts.append({"title": family, "note": NOTES.get(family, ""), "kind": "line", "keys": members,
                       "total": None})
    return charts


def _stat_order(key: str) -> int:
    """mean before max before min: the legend reads from the curve that matters most."""
    stat = _STAT.search(key)
    return _STATS.index(stat.group(1)) if stat else -1


def _phase_order(key: str) -> tuple[int, str]:
    name = key.removeprefix("timing_s/")
    rank = PHASES.index(name) if name in PHASES else len(PHASES) + (key == REST_OF_STEP)
    return rank, name


def read_config(run: Path) -> tuple[str | None, str]:
    """The run's resolved config as YAML text, and where it came from: OUTPUT_DIR/config.yaml, or
    for runs made before it was saved there, the newest checkpoint under OUTPUT_DIR/checkpoints."""
    saved = run / CONFIG_NAME
    if saved.is_file():
        return saved.read_text(), str(saved)
    iterations = list_iterations(run / "checkpoints")
    if iterations:
        common = iterations[-1][1] / "common.pt"
        config = _checkpoint_config(common)
        if config:
            return yaml.safe_dump(config, sort_keys=False), f"{common} (no {CONFIG_NAME} in the run directory)"
    return None, f"no {CONFIG_NAME} in {run} and no checkpoint under {run / 'checkpoints'} records one"


def _run_name(config: str | None) -> str | None:
    """trainer.name of the config: the run's own name, whatever its directory is called."""
    try:
        tree = yaml.safe_load(config) if config else None
    except yaml.YAMLError:
        return None
    name = (tree.get("trainer") or {}).get("name") if isinstance(tree, dict) else None
    return str(name) if name else None


def _checkpoint_config(common: Path) -> dict | None:
    if not common.is_file():
        return None
    import torch  # only for runs without config.yaml

    try:
        return torch.load(common, map_location="cpu", weights_only=True).get("config")
    except Exception:  # noqa: BLE001 - an unreadable checkpoint just means no config to show
        return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: Any) -> Any:
    """`value` with every NaN or infinity (nested in lists and dicts too) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value
