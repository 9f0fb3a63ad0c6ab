"""The engine fleet: rollout.num_engines vLLM engines, each in its own Ray actor (RolloutServer),
behind one driver-side object with the calls the trainer makes (generate, score, sleep, close).

A batch is spread by load: a prompt's n samples stay on one engine (their shared prompt is
computed once, in its prefix cache), and prompts go to engines by estimated work, longest first
(`assign_by_load`). The engines run concurrently; the driver waits for all of them at once, with
one deadline, and hands back the results in the batch's order. An engine that dies, raises or
does not answer by the deadline fails the call with an EngineError naming the engine and its node;
with rollout.engine_restarts it is replaced instead and its prompts generated again
(mrl.launch.restarts).

Sampling needs no per-engine seeding: vLLM seeds each request from SamplingSettings.seed (sample j
of a prompt from seed + j), and the trainer gives each prompt its seed from the prompt's index in
the data (seeded_per_prompt), so a prompt's samples do not depend on which engine, or which batch,
generates them (tests/e2e/test_fleet.py checks a 2-engine fleet against one engine token for token).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import ray

from mrl.launch.engine_nodes import EnginePart, launch_spanning_engine, start_engine_parts
from mrl.launch.proxies import EngineError, EngineHandle, close_engines, engine_died, engine_silent
from mrl.launch.restarts import EngineRestarts, Piece
from mrl.launch.rollout_actor import RolloutServer
from mrl.rollout.engine import Generation, SamplingSettings, Task, per_prompt


def assign_by_load(costs: Sequence[float], engines: int, loads: Sequence[float] | None = None) -> list[list[int]]:
    """Prompt indices per engine, each list in batch order. Greedy longest-first: the costliest
    prompt left goes to the engine with the least work so far (ties: the lower index), which keeps
    the slowest engine within 4/3 of the best possible split. One engine gets the batch as it is.
    `loads`: each engine's work already in flight (default none)."""
    if engines < 1:
        raise ValueError(f"an engine fleet needs at least one engine, got {engines}")
    loads, parts = list(loads or [0.0] * engines), [[] for _ in range(engines)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        engine = min(range(engines), key=lambda e: (loads[e], e))
        parts[engine].append(i)
        loads[engine] += costs[i]
    return [sorted(part) for part in parts]


def prompt_costs(prompt_ids: Sequence[list[int]],
                 sampling: SamplingSettings | Sequence[SamplingSettings]) -> list[float]:
    """Estimated work per prompt: its tokens and the most it may generate, for each of its n samples
    (an agent's episode a push cut, a Generation, goes on from all its tokens)."""
    return [float((_length(p) + s.max_tokens) * s.n) for p, s in zip(prompt_ids, per_prompt(sampling, len(prompt_ids)))]


def _length(prompt: list[int] | Generation | Task) -> int:
    if isinstance(prompt, Generation):
        return len(prompt.prompt_ids) + len(prompt.token_ids)
    return len(prompt.prompt_ids if isinstance(prompt, Task) else prompt)


class EngineFleet:
    """N rollout engines (`handles`, with the node each runs on): the trainer's engine calls."""

    def __init__(self, handles: list[EngineHandle], nodes: list[str], streaming: bool = False,
                 restarts: EngineRestarts | None = None):
        if not handles or len(nodes) != len(handles):
            raise ValueError(f"an engine fleet needs one node per engine, got {len(handles)} engines, {len(nodes)} nodes")
        self.handles, self.nodes = handles, nodes
        self.timeout_s = handles[0].timeout_s
        # async.streaming: generate calls run at once on each engine (RolloutServer.generate_streaming),
        # and a call's prompts go to the engines with the least work in flight (`in_flight`)
        self.streaming = streaming
        self.in_flight = [0.0] * len(handles)
        self.restarts = restarts  # rollout.engine_restarts (None: a failed engine fails the call)
        self._name_handles()

    def _name_handles(self) -> None:
        """Each engine's own calls (a weight receipt, a parity score) name it as the fleet does."""
        for i, handle in enumerate(self.handles):
            handle.name = self.name(i)

    @classmethod
    def start(cls, model: str, engine_options: dict[str, Any], count: int, *, num_cpus: float = 1,
              num_gpus: float = 0, sync_timeout_s: float = 300.0, timeout_s: float = 300.0,
              start_timeout_s: float = 600.0, restarts: int = 0, nodes_per_engine: int = 1,
              parts: Callable[[int], list[EnginePart]] | None = None) -> "EngineFleet":
        """Start `count` engines at once and wait for all of them together (N engines start in about
        the time of one); one that fails or hangs stops them all and raises EngineError naming it.
        `restarts`: how many failed engines the run may replace (rollout.engine_restarts);
        `nodes_per_engine` > 1: each engine spans that many nodes (mrl.launch.engine_nodes);
        `parts(i)`: where engine i's parts run, in the run's bundles (colocated on GPUs, mrl.launch.colocation)."""

        def launch(i: int) -> EngineHandle:  # a restart starts engine i again with the same options, in its place
            if parts is None and nodes_per_engine > 1:
                return launch_spanning_engine(model, engine_options, nodes_per_engine, num_cpus=num_cpus,
                                              num_gpus=num_gpus, sync_timeout_s=sync_timeout_s,
                                              call_timeout_s=timeout_s, timeout_s=start_timeout_s)
            where = parts(i) if parts is not None else [EnginePart(None, num_cpus, num_gpus)]  # None: Ray places it
            return start_engine_parts(model, engine_options, where, sync_timeout_s=sync_timeout_s,
                                      call_timeout_s=timeout_s, timeout_s=start_timeout_s)

        handles: list[EngineHandle] = []
        try:
            handles += [launch(i) for i in range(count)]
        except BaseException:
            close_engines(handles)
            raise
        fleet = cls(handles, ["not known: starting"] * count, bool(engine_options.get("streaming")),
                    EngineRestarts(restarts, launch, start_timeout_s) if restarts else None)
        try:
            nodes = fleet.await_nodes(range(count), f"start (model {model}; its log is in the Ray session's "
                                                    "worker logs)", start_timeout_s)
        except BaseException:
            fleet.close()
            raise
        fleet.nodes = [nodes[i] for i in range(count)]
        fleet._name_handles()
        return fleet

    def __len__(self) -> int:
        return len(self.handles)

    def await_nodes(self, engines: Sequence[int], what: str, timeout_s: float) -> dict[int, str]:
        """The node of each of these engines once it is up, within rollout.start_timeout_s. One not up
        by then is killed on the way out: an engine still starting runs no call, so closing it with
        a shutdown would wait SHUTDOWN_S for nothing."""
        answers = {i: self.handles[i].submit(RolloutServer.node_ip) for i in engines}
        # an engine spanning nodes is up once its other nodes' workers are too; one that fails fails it at once
        answers |= {(i, k): node.node_ip.remote() for i in engines
                    for k, node in enumerate(self.handles[i].node_actors, start=1)}
        try:
            return {i: node for i, node in self._gather(answers, what, timeout_s, "rollout.start_timeout_s").items()
                    if isinstance(i, int)}
        except BaseException:
            _, starting = ray.wait(list(answers.values()), num_returns=len(answers), timeout=0)
            for i in {key if isinstance(key, int) else key[0] for key, ref in answers.items() if ref in starting}:
                self.handles[i].kill()
            raise

    def places(self) -> list[list[dict]]:
        """Per engine, where each of its processes runs (its leader's first): Ray's node id, the GPUs it sees."""
        refs = [[h.submit(RolloutServer.place)] + [node.place.remote() for node in h.node_actors]
                for h in self.handles]
        return [ray.get(parts, timeout=self.timeout_s) for parts in refs]

    def name(self, i: int | tuple[int, int]) -> str:
        """Engine i, or (i, k): node k of engine i when it spans nodes."""
        if isinstance(i, tuple):
            return f"node {i[1]} of rollout engine {i[0]} of {len(self)}"
        return f"rollout engine {i} of {len(self)} (node {self.nodes[i]})"

    def live(self) -> list[int]:
        """The engines that hold the run's weights: all, but a restarted one until it takes them."""
        fresh = self.restarts.fresh if self.restarts is not None else set()
        return [i for i in range(len(self)) if i not in fresh]

    def _generating(self) -> list[int]:
        """The engines to generate on (with none holding the weights, the restarted ones take them first)."""
        if not self.live():
            self.restarts.give_weights_now(self)
        return self.live()

    # --- the trainer's calls ------------------------------------------------------------------

    def generate(self, prompt_ids: Sequence[list[int]],
                 sampling: SamplingSettings) -> tuple[list[list[Generation]], dict[str, float]]:
        """Per prompt (in batch order) its `sampling.n` generations, and each engine's throughput
        (FleetGeneration.metrics)."""
        pending = self.generate_async(prompt_ids, sampling)
        return pending.result(), pending.metrics

    def generate_async(self, prompt_ids: Sequence[list[int]],
                       sampling: SamplingSettings | Sequence[SamplingSettings]) -> "FleetGeneration":
        """Start generating on every engine and return at once (trainer.mode one_step_off trains
        meanwhile). Each engine runs one call at a time: what it is asked next (a weight update,
        sleep) starts only when its part of this generation has finished (or was interrupted).
        `sampling`: one for every prompt, or one per prompt."""
        settings = per_prompt(sampling, len(prompt_ids))
        costs = prompt_costs(prompt_ids, settings)
        live, parts = self._generating(), [[] for _ in self.handles]
        loads = [self.in_flight[i] for i in live] if self.streaming else None
        for i, part in zip(live, assign_by_load(costs, len(live), loads)):
            parts[i] = part

        def engine_sampling(part: list[int]) -> SamplingSettings | list[SamplingSettings]:
            return sampling if isinstance(sampling, SamplingSettings) else [settings[j] for j in part]

        method = RolloutServer.generate_streaming if self.streaming else RolloutServer.generate

        def send(i: int, part: list[int]) -> Any:  # also a failed engine's prompts, to another (restarts)
            return self.handles[i].submit(method, [prompt_ids[j] for j in part], engine_sampling(part))

        refs = {i: send(i, part) for i, part in enumerate(parts) if part}
        return FleetGeneration(self, parts, refs, len(prompt_ids), [sum(costs[j] for j in part) for part in parts],
                               send, costs)

    def score(self, sequences: Sequence[list[int]]) -> list[list[float]]:
        """Teacher-forced log-probs on the first engine (every engine holds the same weights)."""
        i = self._generating()[0]
        return self._gather({i: self.handles[i].submit(RolloutServer.score, sequences)}, "score", self.timeout_s)[i]

    def interrupt(self) -> None:
        """async.partial_rollout, before a weight push: every engine stops the generation it runs
        and returns its samples as they are (so do the calls queued behind it) until its next
        weight update. Waits for every engine's acknowledgement, not for the generations."""
        self._gather({i: self.handles[i].submit(RolloutServer.interrupt) for i in self.live()}, "interrupt",
                     self.timeout_s)  # a restarted engine without the weights has generated nothing

    def sleep(self) -> None:
        """Every engine frees its accelerator memory (colocated placement, while the actor trains);
        a restarted one once it is up."""
        if self.restarts is not None:
            self.restarts.await_started(self, sorted(self.restarts.fresh))
        self._gather({i: h.submit(RolloutServer.sleep) for i, h in enumerate(self.handles)}, "sleep", self.timeout_s)

    def close(self) -> None:
        """Stop every engine, whatever fails on the way (the first error is raised at the end)."""
        close_engines(self.handles)

    # --- waiting ------------------------------------------------------------------------------

    def _gather(self, refs: dict[Any, Any], what: str, timeout_s: float,
                setting: str = "sync.timeout_s") -> dict[Any, Any]:
        """Each engine's answer (by engine index), all within one deadline (`setting`'s). The first
        engine to fail, or the ones still silent at the deadline, raise EngineError naming them and their nodes."""
        deadline = time.perf_counter() + timeout_s
        engine_of = {ref: i for i, ref in refs.items()}
        # the nodes of engines spanning nodes: one whose workers die fails its engine at once
        watched = {w: i for i in refs if isinstance(i, int) for w in self.handles[i].watchers}
        pending, answers = list(engine_of), {}
        while pending:
            ready, _ = ray.wait(pending + list(watched), num_returns=1,
                                timeout=max(deadline - time.perf_counter(), 0.0))
            if not ready:
                raise engine_silent(what, ", ".join(self.name(engine_of[ref]) for ref in pending), timeout_s, setting)
            if ready[0] in watched:
                raise engine_died(what, self.name(watched[ready[0]])) from _error_of(ready[0])
            pending.remove(ready[0])
            i = engine_of[ready[0]]
            try:
                answers[i] = ray.get(ready[0])
            except ray.exceptions.RayActorError as err:  # one line; Ray's whole report stays in __cause__
                raise engine_died(what, self.name(i)) from err
            except ray.exceptions.RayError as err:
                raise EngineError(f"{what}: {self.name(i)} failed: {_first_line(err)}") from err
        return answers


def _error_of(ref: Any) -> BaseException | None:
    """What a finished Ray call raised (None: it returned)."""
    try:
        ray.get(ref)
    except Exception as err:  # noqa: BLE001 - returned as the cause of the caller's error
        return err
    return None


def _first_line(err: Exception) -> str:
    """`Type: first line` of what an engine raised (Ray wraps it: the remote traceback follows)."""
    cause = getattr(err, "cause", None) or err
    return f"{type(cause).__name__}: {next(iter(str(cause).strip().splitlines()), '')}"


class FleetGeneration:
    """A batch being generated on the fleet. Each engine's finishing time is recorded when it
    finishes (not when the driver asks), so `seconds` and the throughput metrics are the engines'
    own even when the driver was busy training meanwhile."""

    def __init__(self, fleet: EngineFleet, parts: list[list[int]], refs: dict[int, Any], prompts: int,
                 costs: list[float] | None = None, send: Callable[[int, list[int]], Any] | None = None,
                 prompt_costs: list[float] | None = None):
        self.fleet, self.parts, self.refs, self.prompts = fleet, parts, refs, prompts
        self.started = time.perf_counter()
        self.timeout_s = fleet.timeout_s * EngineHandle.GENERATE_TIMEOUT_FACTOR
        # rollout.engine_restarts: how to send prompts to another engine, each prompt's cost, and
        # the calls that carry a failed engine's prompts (mrl.launch.restarts)
        self._send, self.prompt_costs = send, prompt_costs or []
        self.rerouted: dict[Any, Any] = {}
        self.finished: dict[int, float] = {}
        self.metrics: dict[str, float] = {}  # filled by result()
        self.costs = costs or [0.0] * len(parts)  # each engine's share of the work: in flight until it finishes
        for i, ref in refs.items():
            fleet.in_flight[i] += self.costs[i]
            ref.future().add_done_callback(lambda _done, i=i: self._done(i))

    def send(self, engine: int, prompts: list[int]) -> Any:
        """Start generating these prompts (indices into the batch) on `engine`: its Ray reference."""
        return self._send(engine, prompts)

    def cost_of(self, prompts: list[int]) -> float:
        return sum(self.prompt_costs[j] for j in prompts)

    def _done(self, i: int) -> None:
        """Engine i's part came back (on Ray's thread, or result()'s, whichever is first): its
        finishing time, and its work is no longer in flight."""
        now = time.perf_counter()
        if self.finished.setdefault(i, now) is now:  # atomic: the other caller finds it set
            self.fleet.in_flight[i] -= self.costs[i]

    @property
    def seconds(self) -> float | None:
        """From the call until the last engine finished; None while one is still generating."""
        if len(self.finished) < len(self.refs):
            return None
        return max(self.finished.values()) - self.started

    def cancel(self) -> None:
        """Abandon the engines' parts not finished: queued ones never start (a running one ends
        with the engine, which the run closes next). Nothing is waited for; errors are ignored
        (an engine that died has dropped its part already)."""
        for ref in [ref for i, ref in self.refs.items() if i not in self.finished] + list(self.rerouted):
            try:
                ray.cancel(ref)
            except Exception:  # noqa: BLE001 - cancelling is best effort on the way out
                pass

    def result(self) -> list[list[Generation]]:
        """Per prompt (in batch order) its generations; waits at most the generate timeout from now.
        Sets `metrics`: `rollout/engine{i}/tokens_per_s` and `rollout/engine{i}/gen_s` for each
        engine that generated."""
        restarts = getattr(self.fleet, "restarts", None)
        if restarts is not None:
            pieces = restarts.collect(self)
        else:
            pieces = []
            for i, answer in self.fleet._gather(self.refs, "generate", self.timeout_s).items():
                self._done(i)  # Ray runs the callback on its own thread, possibly just after get returned
                pieces.append(Piece(i, self.parts[i], answer, self.finished[i]))
        groups: list[list[Generation]] = [[] for _ in range(self.prompts)]
        tokens: dict[int, int] = {}
        finished: dict[int, float] = {}
        for piece in pieces:
            if len(piece.answer) != len(piece.prompts):
                raise EngineError(f"{self.fleet.name(piece.engine)} answered {len(piece.answer)} prompts of the "
                                  f"{len(piece.prompts)} it was sent")
            for j, generations in zip(piece.prompts, piece.answer):
                groups[j] = generations
            made = sum(len(g.token_ids) for generations in piece.answer for g in generations)
            tokens[piece.engine] = tokens.get(piece.engine, 0) + made
            finished[piece.engine] = max(finished.get(piece.engine, piece.finished), piece.finished)
        for i in tokens:
            seconds = finished[i] - self.started
            self.metrics[f"rollout/engine{i}/tokens_per_s"] = tokens[i] / max(seconds, 1e-9)
            self.metrics[f"rollout/engine{i}/gen_s"] = seconds
        return groups
