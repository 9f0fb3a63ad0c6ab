"""The calls an OpenAI-compatible endpoint (openai_server.py) made for each episode, as trajectories.

Every call keeps its exact prompt ids, completion ids, log-probs and weight versions. `assemble`
cuts an episode's calls into runs in which each call's prompt extends the previous call's prompt +
completion; a run becomes one trajectory: the completions trained (loss mask 1, the engine's
log-probs), the tokens appended between calls (tool results, user turns, template boundaries)
masked (0, log-prob 0.0). An episode of one run is linear; otherwise each run is a trajectory of
its own, with a note saying why it does not continue the one before. See docs/agents.md.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any, Sequence


@dataclass(frozen=True)
class CallRecord:
    """One call of an episode, exactly as the engine saw it."""

    kind: str  # "chat" or "completion"
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    token_versions: list[int] | None  # per completion token; None: the engine did not say
    finish_reason: str  # the engine's ("stop", "length", ...), before tool-call parsing
    text: str
    generate_s: float  # time the generate handle took
    appended: int | None  # tokens added after the previous call's completion; None: rendered afresh
    note: str = ""  # why the prompt was rendered afresh although the episode had a previous call
    tool_call_errors: tuple[str, ...] = ()  # malformed tool calls in the completion's text
    context: Any = field(default=None, compare=False, repr=False)  # what the endpoint needs to extend it
    routed_experts: Any = field(default=None, compare=False, repr=False)  # the engine's (Generation's)


@dataclass
class EndpointTrajectory:
    """Consecutive calls of one episode as one sample: `prompt_ids` then `token_ids`, where the
    completions carry loss_mask 1 and the tokens appended between calls 0 (log-prob 0.0, and the
    version of the completion before them)."""

    prompt_ids: list[int]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    token_versions: list[int] | None
    calls: list[int]  # the episode's calls this trajectory holds, by index
    linear: bool  # True: the whole episode is this one trajectory
    finish_reason: str  # the last call's
    text: str  # the last call's completion text (what a reward function scores)
    note: str = ""  # why calls[0] does not continue the previous trajectory ("" for the first)
    routed_experts: Any = field(default=None, compare=False, repr=False)  # the last call's: it forwarded
    # every earlier token too (mrl/routes.py); None when the engine recorded none


def _extends(previous: CallRecord, call: CallRecord) -> bool:
    head = previous.prompt_ids + previous.completion_ids
    return call.prompt_ids[: len(head)] == head


def _new_run(call: CallRecord, index: int, note: str) -> EndpointTrajectory:
    versions = None if call.token_versions is None else list(call.token_versions)
    return EndpointTrajectory(list(call.prompt_ids), list(call.completion_ids), [1] * len(call.completion_ids),
                      list(call.logprobs), versions, [index], True, call.finish_reason, call.text, note,
                      call.routed_experts)


def _continue_run(run: EndpointTrajectory, previous: CallRecord, call: CallRecord, index: int) -> None:
    appended = call.prompt_ids[len(previous.prompt_ids) + len(previous.completion_ids):]
    run.token_ids += appended + call.completion_ids
    run.loss_mask += [0] * len(appended) + [1] * len(call.completion_ids)
    run.logprobs += [0.0] * len(appended) + list(call.logprobs)
    if run.token_versions is not None and call.token_versions is not None:
        # Appended tokens take the version of the completion before them: never older than the
        # tokens around them, so an oldest-token staleness bound does not see them.
        before = run.token_versions[-1] if run.token_versions else min(call.token_versions, default=0)
        run.token_versions += [before] * len(appended) + list(call.token_versions)
    else:
        run.token_versions = None
    run.calls.append(index)
    run.finish_reason, run.text, run.routed_experts = call.finish_reason, call.text, call.routed_experts


def assemble(calls: Sequence[CallRecord]) -> list[EndpointTrajectory]:
    """The calls cut into maximal runs where each prompt extends the previous prompt + completion,
    one EndpointTrajectory per run; each one's `linear` says whether there is only one run."""
    runs: list[EndpointTrajectory] = []
    for index, call in enumerate(calls):
        if runs and _extends(calls[index - 1], call):
            _continue_run(runs[-1], calls[index - 1], call, index)
            continue
        note = "" if index == 0 else (call.note or f"call {index}'s prompt does not extend call {index - 1}'s "
                                      "prompt + completion")
        runs.append(_new_run(call, index, note))
    for run in runs:
        run.linear = len(runs) == 1
    return runs


class CallLog:
    """Calls per episode id. The endpoint records from its event loop; `assemble`, `calls` and `pop`
    may run on any thread."""

    def __init__(self) -> None:
        self._calls: dict[str, list[CallRecord]] = {}
        self._lock = threading.Lock()

    def record(self, episode_id: str, call: CallRecord) -> int:
        """Add a call; its index in the episode."""
        with self._lock:
            calls = self._calls.setdefault(episode_id, [])
            if calls:  # only the last call's context is read (the next call extends it): an
                calls[-1] = replace(calls[-1], context=None)  # episode holds its messages once, not per call
            calls.append(call)
            return len(calls) - 1

    def last(self, episode_id: str) -> tuple[int, CallRecord | None]:
        """How many calls the episode has, and its last one (None before the first)."""
        with self._lock:
            calls = self._calls.get(episode_id, [])
            return len(calls), (calls[-1] if calls else None)

    def calls(self, episode_id: str) -> list[CallRecord]:
        with self._lock:
            return list(self._known(episode_id))

    def episodes(self) -> list[str]:
        with self._lock:
            return list(self._calls)

    def pop(self, episode_id: str) -> list[CallRecord]:
        """The episode's calls, forgotten here (call it when the episode is done)."""
        with self._lock:
            self._known(episode_id)
            return self._calls.pop(episode_id)

    def _known(self, episode_id: str) -> list[CallRecord]:
        if episode_id not in self._calls:
            raise KeyError(f"no calls recorded for episode {episode_id!r}: its agent must use base_url "
                           f".../episodes/{episode_id}/v1 (recorded: {sorted(self._calls)[:5]})")
        return self._calls[episode_id]

    def assemble(self, episode_id: str, pop: bool = False) -> list[EndpointTrajectory]:
        """The episode's trajectories (see `assemble`); pop=True also forgets the episode."""
        return assemble(self.pop(episode_id) if pop else self.calls(episode_id))
