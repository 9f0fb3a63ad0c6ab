"""rollout.engine_restarts: a fleet that survives a dead or hung engine.

An engine that dies or stops answering during a generate, or is found dead or silent just before
a weight push, is replaced: its actor killed, a new one started in its place with the same
options, the event logged in one line and counted (`rollout/engine_restarts`). The prompts it had
in flight are generated again, with their own seeds, on the engines that hold the same weights;
the new engine takes the weights at the next push, parity-gated as every engine's first sync is.
With no engine left to generate (a one-engine fleet) it takes the trainer's weights at once.
When the restarts are used up, the engine's error stops the run as it did before.
The story, and what is not restarted: docs/rollout.md#engine-restarts.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import ray

from mrl.launch.proxies import EngineError, EngineHandle, close_engines, engine_died, engine_silent, engine_wait
from mrl.launch.rollout_actor import RolloutServer
from mrl.sync.parity import ParityError

if TYPE_CHECKING:
    from mrl.launch.fleet import EngineFleet, FleetGeneration

log = logging.getLogger(__name__)


@dataclass
class Task:
    """A call in flight on one engine: `prompts`, indices into the batch (none for a ping)."""

    engine: int
    handle: Any  # the EngineHandle it was sent to (the engine's index may hold a new one since)
    prompts: list[int]
    resent: bool = False  # sent again after its first engine failed


@dataclass
class Piece:
    """Some of a batch's prompts as one engine generated them, and when they came back."""

    engine: int
    prompts: list[int]
    answer: list
    finished: float  # time.perf_counter()


class EngineRestarts:
    """The fleet's restart budget (`allowed`, for the whole run) and its engines not yet given
    the weights (`fresh`). `launch(i)` starts a new engine i with the fleet's options; `version` is
    the weight version every other engine holds (the pushes made through `push`); `join_now`,
    set by the run's cluster, gives the fresh engines the trainer's weights at once."""

    def __init__(self, allowed: int, launch: Callable[[int], EngineHandle], start_timeout_s: float = 600.0):
        if allowed < 1:
            raise ValueError(f"EngineRestarts needs at least one restart allowed, got {allowed}")
        self.allowed, self.launch, self.start_timeout_s = allowed, launch, start_timeout_s
        self.used, self.version = 0, 0
        self.fresh: set[int] = set()
        self.join_now: Callable[[], dict] | None = None

    # --- replacing an engine --------------------------------------------------------------------

    def replace(self, fleet: EngineFleet, i: int, error: EngineError) -> None:
        """Engine i failed with `error`: kill it and start another in its place (fresh: no weights
        yet); or, with the restarts used up, raise `error`."""
        if self.used >= self.allowed:
            raise EngineError(f"{error}; the run's {self.allowed} engine restarts (rollout.engine_restarts) are "
                              "used up") from error
        self.used += 1
        log.warning("%s; restarting it (restart %d of %d, rollout.engine_restarts)", error, self.used, self.allowed)
        try:
            close_engines([fleet.handles[i]])
        except Exception as err:  # noqa: BLE001 - a dead actor may refuse its shutdown; it is killed all the same
            log.debug("closing the failed %s: %s", fleet.name(i), err)
        fleet.handles[i] = self.launch(i)
        fleet.nodes[i] = "not known: restarting"
        fleet._name_handles()
        self.fresh.add(i)

    def wait(self, fleet: EngineFleet, waiting: dict[Any, Task], what: str, timeout_s: float,
             lost: Callable[[list[Task]], None]) -> list[tuple[Task, Any, float]]:
        """Each task's answer with the time it came back. An engine that dies, or is silent at the
        deadline (`timeout_s` from the start, or from the last re-send), is replaced and its tasks
        handed to `lost`, which may add tasks to `waiting`. An engine that raised fails the call."""
        done, deadline = [], time.perf_counter() + timeout_s
        while waiting:
            # a node of an engine spanning nodes that dies fails that engine's tasks (EngineNode.watch)
            watched = {w: t for t in waiting.values() for w in t.handle.watchers}
            ready, _ = ray.wait(list(waiting) + list(watched), num_returns=1,
                                timeout=max(deadline - time.perf_counter(), 0.0))
            if not ready:  # every engine still holding a task is silent
                silent = {id(t.handle): t for t in waiting.values()}.values()
                self._lose(fleet, waiting, [(t, engine_silent(what, fleet.name(t.engine), timeout_s)) for t in silent],
                           lost)
                deadline = time.perf_counter() + timeout_s
                continue
            if ready[0] in watched:
                task = watched[ready[0]]
                self._lose(fleet, waiting, [(task, engine_died(what, f"{fleet.name(task.engine)}: one of its nodes"))],
                           lost)
                deadline = time.perf_counter() + timeout_s
                continue
            task = waiting.pop(ready[0])
            try:
                done.append((task, ray.get(ready[0]), time.perf_counter()))
            except ray.exceptions.RayActorError as err:
                died = engine_died(what, fleet.name(task.engine))
                died.__cause__ = err
                waiting[ready[0]] = task  # lost with the others on its engine
                self._lose(fleet, waiting, [(task, died)], lost)
                deadline = time.perf_counter() + timeout_s
            except ray.exceptions.RayError as err:  # it raised: a new engine would raise the same
                from mrl.launch.fleet import _first_line

                raise EngineError(f"{what}: {fleet.name(task.engine)} failed: {_first_line(err)}") from err
        return done

    def _lose(self, fleet: EngineFleet, waiting: dict[Any, Task], failed: list[tuple[Task, EngineError]],
              lost: Callable[[list[Task]], None]) -> None:
        """Replace each failed engine (once, though several tasks were on it), then hand every task
        that was on them to `lost`."""
        gone = {id(task.handle) for task, _ in failed}
        for task, error in failed:
            if fleet.handles[task.engine] is task.handle:  # not replaced already
                self.replace(fleet, task.engine, error)
        tasks = {ref: task for ref, task in waiting.items() if id(task.handle) in gone}
        for ref in tasks:
            del waiting[ref]
        lost(list(tasks.values()))

    # --- a generation ---------------------------------------------------------------------------

    def collect(self, generation: FleetGeneration) -> list[Piece]:
        """Every prompt of `generation`, each from the engine that generated it; a failed engine's
        prompts again on the engines that hold the weights (the same prompts, sampling settings
        and seeds: the same samples up to the engines' own nondeterminism)."""
        fleet = generation.fleet
        waiting = {ref: Task(i, fleet.handles[i], generation.parts[i]) for i, ref in generation.refs.items()}

        def again(tasks: list[Task]) -> None:
            prompts = sorted(j for t in tasks for j in t.prompts)
            if prompts:
                sent = self.resend(generation, prompts)
                waiting.update(sent)
                generation.rerouted.update(sent)

        pieces = []
        for task, answer, finished in self.wait(fleet, waiting, "generate", generation.timeout_s, again):
            if not task.resent:  # its engine's own part: its time is the engine's (FleetGeneration._done)
                generation._done(task.engine)
                finished = generation.finished[task.engine]
            else:
                fleet.in_flight[task.engine] -= generation.cost_of(task.prompts)
            pieces.append(Piece(task.engine, task.prompts, answer, finished))
        return pieces

    def resend(self, generation: FleetGeneration, prompts: list[int]) -> dict[Any, Task]:
        """Send these prompts of `generation` to the engines that hold the weights, spread by load
        (none holds them: the fresh engines take the trainer's weights first)."""
        from mrl.launch.fleet import assign_by_load

        fleet = generation.fleet
        live = fleet.live()
        if not live:
            self.give_weights_now(fleet)
            live = fleet.live()
        costs = [generation.prompt_costs[j] for j in prompts]
        parts = assign_by_load(costs, len(live), [fleet.in_flight[k] for k in live])
        sent = {}
        for k, part in zip(live, parts):
            if part:
                chosen = [prompts[x] for x in part]
                sent[generation.send(k, chosen)] = Task(k, fleet.handles[k], chosen, resent=True)
                fleet.in_flight[k] += generation.cost_of(chosen)
        log.info("the %d prompts of the failed engine go to %s", len(prompts),
                 ", ".join(f"engine {k}" for k in sorted({t.engine for t in sent.values()})))
        return sent

    # --- weights for a new engine ---------------------------------------------------------------

    def give_weights_now(self, fleet: EngineFleet) -> None:
        """No engine holds the weights: the fresh ones take them now. Before the run's first push
        every engine holds the checkpoint it started from, which a new one loads too; after it,
        the trainer's weights (the cluster's `join_now`)."""
        fresh = sorted(self.fresh)
        if self.version == 0:
            self.await_started(fleet, fresh)
            self.fresh.clear()
            return
        if self.join_now is None:
            raise EngineError(f"{', '.join(fleet.name(i) for i in fresh)}: restarted, and no engine holds the weights "
                              "to generate with (a fleet without a weight sync cannot give them)")
        self.join_now()

    def await_started(self, fleet: EngineFleet, engines: list[int]) -> None:
        """Wait until these new engines are up (rollout.start_timeout_s); learn their nodes."""
        if not engines:
            return
        nodes = fleet.await_nodes(engines, "restart (its log is in the Ray session's worker logs)",
                                  self.start_timeout_s)
        for i, node in nodes.items():
            fleet.nodes[i] = node
        fleet._name_handles()

    def check_alive(self, fleet: EngineFleet) -> None:
        """Before a push (the engines are idle then): an engine that is dead or silent for the
        fleet's timeout is replaced, so that it joins this push instead of failing it."""
        waiting = {fleet.handles[i].submit(RolloutServer.node_ip): Task(i, fleet.handles[i], [])
                   for i in fleet.live()}
        self.wait(fleet, waiting, "the check before a weight push", fleet.timeout_s, lambda tasks: None)

    def push(self, fleet: EngineFleet, sync: Any) -> dict[str, float]:
        """The run's weight push (`sync`, a mrl.sync.driver.WeightSync) to the engines that hold
        the weights, then to the fresh ones (`join`); the push's metrics and the restarts so far."""
        self.check_alive(fleet)
        live, fresh = fleet.live(), sorted(self.fresh)
        metrics: dict[str, float] = {}
        if live:
            point(sync, [fleet.handles[i] for i in live])
            metrics = sync()
        if fresh:
            metrics = _merged(metrics, self.join(fleet, sync, fresh, self.version))
        self.version += 1
        point(sync, fleet.handles)
        metrics["rollout/engine_restarts"] = float(self.used)
        return metrics

    def join(self, fleet: EngineFleet, sync: Any, engines: list[int], version: int) -> dict[str, float]:
        """The trainer's weights into these new engines, as a first sync (parity-gated on each);
        their weight version becomes `version` + 1, as the push makes it on the others. Metrics:
        the sync's, with each one's gap as rollout/engine{i}/logprob_abs_diff_max."""
        self.await_started(fleet, engines)
        handles = [fleet.handles[i] for i in engines]
        for handle in handles:
            engine_wait(handle.submit(RolloutServer.set_weight_version, version), handle.timeout_s,
                        "set_weight_version", handle.name)
        first = dataclasses.replace(sync, engines=handles, syncs=0)  # a first sync: every engine parity-gated
        try:
            metrics = first()
        except ParityError as err:
            raise ParityError(f"{', '.join(h.name for h in handles)}, restarted: {err}") from err
        sync.opened = None  # the actor's sender is open for these engines now
        gaps = {i: metrics.pop(f"rollout/engine{k}/logprob_abs_diff_max", metrics.get("rollout/logprob_abs_diff_max"))
                for k, i in enumerate(engines)}
        for i, gap in gaps.items():
            metrics[f"rollout/engine{i}/logprob_abs_diff_max"] = gap
            log.warning("%s, restarted, took the weights (version %d) and passed the parity gate: max |Δ logprob| "
                        "%.3g", fleet.name(i), version + 1, gap)
        self.fresh -= set(engines)
        return metrics


def point(sync: Any, handles: list[EngineHandle]) -> None:
    """Aim `sync` at these engines (their endpoints: known ones kept, a new engine's asked)."""
    known = dict(zip(map(id, sync.engines), sync.endpoints))
    sync.endpoints = [known[id(h)] if id(h) in known else h.endpoint() for h in handles]
    sync.engines = list(handles)


def _merged(push: dict[str, float], joined: dict[str, float]) -> dict[str, float]:
    """A push's metrics with a join's after it: bytes, engines and time add up; the worst gap is kept."""
    out = {**joined, **push}
    for key in ("sync/bytes", "sync/engines", "timing_s/sync_weights"):
        out[key] = push.get(key, 0.0) + joined.get(key, 0.0)
    for key in ("sync/engine_load_s", "rollout/logprob_abs_diff_max", "rollout/logprob_abs_diff_mean"):
        if key in push and key in joined:
            out[key] = max(push[key], joined[key])
    return out
