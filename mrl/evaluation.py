"""Held-out evaluation, one code for the trainer (before, during and after RL, the merged HF model)
and `mrl eval`: generate on the samples, score with the run's reward, summarise.

A sample is correct when the reward scores it >= 1. Greedy accuracy always; with k samples a
prompt, drawn as the rollout draws them (seeded per prompt, so two evaluations use the same random
numbers and differ by the weights): pass@1 (the mean), pass@k (some sample correct) and maj@k (the
most common extracted answer is a correct one), overall and per `data_source` when the records
have one. Agent episodes (the `agent` section) also give the share with a tool call that succeeded.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Callable, Sequence

from mrl.rewards import RewardInput, RewardResult
from mrl.rollout.engine import Generation, SamplingSettings, Task, seeded_per_prompt

Generate = Callable[[list[list[int]], "SamplingSettings | list[SamplingSettings]"], list[list[Generation]]]
ScoreBatch = Callable[[list[RewardInput]], list[RewardResult]]


def greedy_settings(rollout: Any) -> SamplingSettings:
    """Greedy decoding within the rollout's token budget and stop strings (a RolloutConfig)."""
    return SamplingSettings(temperature=0.0, max_tokens=rollout.max_new_tokens, stop=tuple(rollout.stop))


def rollout_settings(rollout: Any, seed: int) -> SamplingSettings:
    """The rollout's own sampling settings (a RolloutConfig), seeded with `seed`."""
    return SamplingSettings(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                            max_tokens=rollout.max_new_tokens, n=rollout.n_samples_per_prompt,
                            stop=tuple(rollout.stop), seed=seed)


def rollout_prompt(sample: dict, rows: bool) -> list[int] | Task:
    """A tokenized dataset sample as the rollout takes it: its token ids, or (`rows`: a run with an
    agent loop) a Task, whose episodes get the sample's row."""
    return Task.of(sample) if rows else sample["prompt_ids"]


def evaluate(generate: Generate, score_batch: ScoreBatch, samples: list[dict], greedy: SamplingSettings,
             sampled: SamplingSettings | None = None, rows: bool = False) -> dict:
    """{"prompts", "greedy": {"accuracy"}, "sampled": {"k", "pass@1", "pass@k", "maj@k"} (with
    `sampled`, its n = k), "by_source": {source: the same}, "agent": {"greedy", "sampled": episodes(...)}
    (agent episodes only)} of `samples` ({"prompt_ids", "prompt", "ground_truth", "metadata"});
    `rows`: each episode gets its sample's row (rollout_prompt)."""
    prompts = [rollout_prompt(s, rows) for s in samples]
    greedy_groups = generate(prompts, greedy)
    greedy_ok = correct(score_batch, samples, greedy_groups)
    sampled_ok = answers = None
    agent = {"greedy": episodes(greedy_groups)}
    if sampled is not None:
        groups = generate(prompts, seeded_per_prompt(sampled, range(len(samples))))
        sampled_ok, answers = correct(score_batch, samples, groups, with_answers=True)
        agent["sampled"] = episodes(groups)
    sources = [str((s["metadata"] or {}).get("data_source", "")) for s in samples]
    summary = {"prompts": len(samples), **summarise(range(len(samples)), greedy_ok, sampled_ok, answers)}
    if agent["greedy"] is not None:
        summary["agent"] = agent
    if any(sources):
        by_source = defaultdict(list)
        for i, source in enumerate(sources):
            by_source[source or "(none)"].append(i)
        summary["by_source"] = {name: summarise(rows, greedy_ok, sampled_ok, answers)
                                for name, rows in sorted(by_source.items())}
    return summary


def correct(score_batch: ScoreBatch, samples: list[dict], groups: list[list[Generation]], with_answers: bool = False):
    """Per prompt, per sample: scored >= 1 by the reward (and, with_answers, the answer each gave:
    what the reward extracted, else the response)."""
    inputs = [RewardInput(s["prompt"], g.text, s["ground_truth"], s["metadata"])
              for s, group in zip(samples, groups) for g in group]
    results = iter(score_batch(inputs))
    scored = [[next(results) for _ in group] for group in groups]
    ok = [[r.score >= 1.0 for r in group] for group in scored]
    if not with_answers:
        return ok
    answers = [[str(r.info.get("extracted", g.text.strip())) for r, g in zip(rs, group)]
               for rs, group in zip(scored, groups)]
    return ok, answers


def episodes(groups: list[list[Generation]]) -> dict | None:
    """Of agent episodes: the share with a tool call that succeeded (parsed, and the tool answered
    without an error), mean turns and tool errors; None for plain samples."""
    stats = [g.agent for group in groups for g in group if g.agent is not None]
    if not stats:
        return None
    return {"tool_call_success": mean(a["tool_calls"] > a["tool_errors"] for a in stats),
            "turns_mean": mean(a["turns"] for a in stats), "tool_errors": mean(a["tool_errors"] for a in stats)}


def summarise(rows: Sequence[int], greedy_ok: list[list[bool]], sampled_ok: list[list[bool]] | None,
              answers: list[list[str]] | None) -> dict:
    rows = list(rows)
    out: dict[str, Any] = {"greedy": {"accuracy": mean(greedy_ok[i][0] for i in rows)}}
    if sampled_ok is not None:
        k = len(sampled_ok[rows[0]])
        out["sampled"] = {"k": k, "pass@1": mean(c for i in rows for c in sampled_ok[i]),
                          f"pass@{k}": mean(any(sampled_ok[i]) for i in rows),
                          f"maj@{k}": mean(majority_correct(answers[i], sampled_ok[i]) for i in rows)}
    return out


def majority_correct(answers: Sequence[str], ok: Sequence[bool]) -> bool:
    """Whether the most common answer (ties: the one given first) is a correct one."""
    counts = Counter(answers)
    top = max(counts.values())
    winner = next(a for a in answers if counts[a] == top)
    return any(c for a, c in zip(answers, ok) if a == winner)


def mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else 0.0
