"""Rollout trace: the samples behind a step's averages, for reading (`mrl report` shows them).

Every `logging.trace_every` steps (0: never) the trainer writes OUTPUT_DIR/rollouts/step_XXXXXX.jsonl,
one JSON object per sample, in the step's sample order: its prompt, response and reward, what the
update made of it (reward, advantage, engine-vs-trainer log-prob drift; None where dynamic sampling
dropped its group) and the weight versions that generated it. At most `logging.trace_samples`
records a step and `logging.trace_chars` characters per text field; a step's file is written whole,
atomically. Every field and the bounds: docs/metrics.md, "The rollout trace".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from mrl.atomic import atomic_write
from mrl.metrics import step_rows
from mrl.modes import policy_step

if TYPE_CHECKING:
    from mrl.rewards import RewardResult
    from mrl.rollout.engine import Generation
    from mrl.run import Run

TRACE_DIR = "rollouts"
TEXT_FIELDS = ("prompt", "response", "ground_truth", "reward_error")


def trace_path(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / TRACE_DIR / f"step_{step:06d}.jsonl"


def trace_rollouts(run: Run, step: int, prompts: Sequence[dict], groups: Sequence[Sequence[Generation]],
                   rewards: Sequence[RewardResult], batch: dict,
                   policy_steps: Sequence[int | None] | None = None) -> Path | None:
    """Write step `step`'s trace when `logging.trace_every` says so; returns the file written.
    `policy_steps`: per sample, the trainer step whose weights generated it (mrl.modes.GeneratedBatch;
    None: counted from this run's start)."""
    log = run.cfg.logging
    if not log.trace_every or step % log.trace_every:
        return None
    records = trace_records(step, prompts, groups, rewards, batch, start_step=run.start,
                            max_samples=log.trace_samples, max_chars=log.trace_chars, policy_steps=policy_steps)
    return write_trace(trace_path(run.out, step), records)


def trace_records(step: int, prompts: Sequence[dict], groups: Sequence[Sequence[Generation]],
                  rewards: Sequence[RewardResult], batch: dict, *, start_step: int, max_samples: int,
                  max_chars: int, sync_every: int = 1, policy_steps: Sequence[int | None] | None = None) -> list[dict]:
    """The step's first `max_samples` samples as trace records (fields: docs/metrics.md).

    `batch` is the one the actor trains on: rows may be missing (dynamic sampling); its
    `sample_ids` say which sample each remaining row is. `start_step` is the step the run started
    or resumed from, whose weights the run's first sync carried; `policy_steps`, where given, are
    each sample's instead (a batch generated before a resume, or mixing groups of two runs)."""
    samples = [(g, prompt, generation) for g, (prompt, group) in enumerate(zip(prompts, groups))
               for generation in group]
    if len(samples) != len(rewards):
        raise ValueError(f"{len(rewards)} reward results for {len(samples)} samples")
    trained = _trained_rows(batch, max_samples)
    records = []
    for index, (group, prompt, generation) in enumerate(samples[:max_samples]):
        result = rewards[index]
        record = {
            "step": step, "sample": index, "of": len(samples), "group": group,
            "prompt": prompt.get("prompt"), "response": generation.text, "ground_truth": prompt.get("ground_truth"),
            "score": result.score, "reward_info": _json_safe(result.info), "reward_error": result.error,
            "reward": None, "advantage": None, "logprob_drift_mean": None, "logprob_drift_max": None,
            "response_tokens": len(generation.token_ids), "finish_reason": generation.finish_reason,
            "weight_version": generation.weight_version,
            "policy_step": (policy_step(generation.weight_version, start_step, sync_every) if policy_steps is None
                            else policy_steps[index]),
            "weight_versions": sorted(set(generation.versions())),
            "kept": index in trained,
        }
        if generation.agent is not None:  # an agent's episode: its conversation, which turns train, its counts
            record.update(_episode(generation.agent, max_chars))
        record.update(trained.get(index, {}))
        records.append(_bounded(record, max_chars))
    return records


def _trained_rows(batch: dict, limit: int) -> dict[int, dict[str, float]]:
    """Per sample id below `limit` still in the batch: the reward, advantage and log-prob drift it
    trained with (only the traced ones: a batch can hold thousands of rows)."""
    mask = batch["response_mask"].bool()
    drift = (batch["rollout_logprobs"] - batch["old_logprobs"]).abs()
    rows = {}
    for row, sample in enumerate(batch["sample_ids"].tolist()):
        if sample >= limit:
            continue
        tokens = mask[row]
        empty = not bool(tokens.any())  # an empty response has no token to average over
        rows[sample] = {
            "reward": float(batch["token_level_rewards"][row].sum()),
            "advantage": None if empty else float(batch["advantages"][row][tokens].mean()),
            "logprob_drift_mean": None if empty else float(drift[row][tokens].mean()),
            "logprob_drift_max": None if empty else float(drift[row][tokens].max()),
        }
    return rows


def _episode(agent: dict, max_chars: int) -> dict:
    """An episode's trace fields: `conversation` (role, content cut to `max_chars`, `trains`: the
    policy generated it, so the update learns from it) and its `agent` counts."""
    conversation = [{"role": m.get("role"), "content": str(m.get("content") or "")[:max_chars],
                     "trains": m.get("role") == "assistant"} for m in agent.get("messages", [])]
    counts = {k: agent[k] for k in ("turns", "tool_calls", "tool_errors", "truncated", "error") if k in agent}
    return {"conversation": conversation, "agent": counts}


def _json_safe(info: dict) -> Any:
    """A reward's details as plain JSON (a custom reward may return numpy numbers or objects)."""
    return json.loads(json.dumps(info, default=str))


def _bounded(record: dict, max_chars: int) -> dict:
    """Cut each text field to `max_chars` characters; `truncated` names each cut field's full length."""
    truncated = {}
    for field in TEXT_FIELDS:
        text = record[field]
        if isinstance(text, str) and len(text) > max_chars:
            truncated[field] = len(text)
            record[field] = text[:max_chars]
    info = json.dumps(record["reward_info"])
    if len(info) > max_chars:  # too long to keep as a dict: keep the start of its JSON text
        truncated["reward_info"] = len(info)
        record["reward_info"] = info[:max_chars]
    record["truncated"] = truncated
    return record


def write_trace(path: Path, records: list[dict]) -> Path:
    """Write `records` as JSON lines to `path`, atomically (a reader never sees half a step)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in records).encode()))
    return path


def read_traces(output_dir: str | os.PathLike) -> list[dict]:
    """Every traced sample of a run, by step then sample; lines that do not parse are skipped."""
    return [record for path in sorted((Path(output_dir) / TRACE_DIR).glob("step_*.jsonl"))
            for record in step_rows(path.read_text())]
