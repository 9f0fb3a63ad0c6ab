"""The actor's Megatron ranks as Ray actors in one placement group, without torchrun.

Rank 0 picks the rendezvous address; every worker sets RANK/WORLD_SIZE/MASTER_* and joins the
default process group itself. `call` runs a collective method on every rank and waits with a
timeout: a rank that raises or dies is reported by number, a stuck collective is an error.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import ray

from mrl.launch.placement import RankPlacement, place_ranks
from mrl.layout import ParallelLayout
from mrl.rank_map import RankPlace
from mrl.workers.actor import MegatronActor

# Workers never print through the driver's console unless asked: their logs stay in Ray's files.
_WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore::FutureWarning"}


# After a rank raised: how long to wait for Ray to report a dead peer. A killed rank's peers fail
# at once in their collectives ("Connection reset by peer"), and those errors can reach the driver
# before the death that caused them.
_DEATH_REPORT_S = 5.0


def _deaths(errors: dict[int, Exception]) -> list[int]:
    """The ranks whose process died or became unreachable (not an exception in our code)."""
    return [rank for rank, err in errors.items() if isinstance(err, ray.exceptions.RayActorError)]


def _death_reason(err: Exception) -> str:
    if isinstance(err, ray.exceptions.ActorUnavailableError):
        return "unreachable"
    return "its process exited: killed, out of memory or crashed; Ray's worker log of that pid may say which"


def _one_line(err: Exception) -> str:
    """`Type: first line` of the exception a rank raised (the remote traceback stays in __cause__)."""
    cause = getattr(err, "cause", None) or err
    first = next(iter(str(cause).strip().splitlines()), "")
    return f"{type(cause).__name__}: {first}"


class WorkerGroupError(RuntimeError):
    """A rank failed or did not answer in time; the message names the rank and the method."""


class WorkerGroup:
    """`world_size` MegatronActor processes, packed onto as few nodes as possible, numbered by node
    (mrl.launch.placement); `ranks[rank]` says where each runs (node, local rank, devices)."""

    def __init__(self, world_size: int, *, cpus_per_worker: float = 1.0, gpus_per_worker: float = 0.0,
                 timeout_s: float = 600.0, layout: ParallelLayout | None = None, allow_split: bool = False,
                 placement: RankPlacement | None = None):
        self.world_size, self.timeout_s = world_size, timeout_s
        bundle = {"CPU": cpus_per_worker, **({"GPU": gpus_per_worker} if gpus_per_worker else {})}
        # Before any rank starts: a layout whose TP group Ray's placement splits is refused here.
        # `placement`: the run's, shared with engines and a critic (colocated on GPUs), freed by the run
        self.owns_placement = placement is None
        self.placement = placement or place_ranks(world_size, bundle, timeout_s, layout, allow_split)
        remote = ray.remote(MegatronActor)
        self.workers = [
            remote.options(
                num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, runtime_env={"env_vars": _WORKER_ENV},
                scheduling_strategy=self.placement.strategy(rank),
            ).remote(rank, world_size)
            for rank in range(world_size)
        ]
        self.places: list[str] = []  # "pid P on HOST" by rank: a failure names the process and node
        master = self._get([self.workers[0].address.remote()], "address")[0]
        hosts = self.call("hostname")
        self.places = [f"pid {pid} on {host}" for pid, host in zip(self.call("pid"), hosts, strict=True)]
        self.ranks: list[RankPlace] = [dataclasses.replace(place, devices=devices) for place, devices
                                       in zip(self.placement.places, self.call("visible_devices"), strict=True)]
        joins = [worker.init_process_group.remote(master, place.local_rank)
                 for worker, place in zip(self.workers, self.ranks, strict=True)]
        self._get(joins, "init_process_group")

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Run `method(*args)` on every rank at once; return the results by rank."""
        refs = [getattr(worker, method).remote(*args) for worker in self.workers]
        return self._get(refs, method, timeout_s)

    def first(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """The one non-None result of a collective method (the rank that reports it)."""
        return next(r for r in self.call(method, *args, timeout_s=timeout_s) if r is not None)

    def by_dp(self, method: str, *args: Any, timeout_s: float | None = None) -> list[dict]:
        """The reporting ranks' results ({"dp": rank, ...}), one per data-parallel slice, in DP order."""
        results = [r for r in self.call(method, *args, timeout_s=timeout_s) if r is not None]
        return sorted(results, key=lambda r: r["dp"])

    def _get(self, refs: list, method: str, timeout_s: float | None = None) -> list[Any]:
        """The results of `refs` (rank i's call is refs[i]) by rank. On the first failure the group
        stops and WorkerGroupError names the rank: its peers are then stuck in, or failing out of,
        a collective with it, so waiting for them would only delay (or misattribute) the error."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        results: dict[int, Any] = {}
        errors: dict[int, Exception] = {}
        pending = self._gather(refs, list(refs), start + timeout_s, results, errors, lambda: bool(errors))
        if errors:
            elapsed = time.monotonic() - start
            if not _deaths(errors):  # a peer's death may explain this error: give Ray time to report it
                pending = self._gather(refs, pending, time.monotonic() + _DEATH_REPORT_S, results, errors,
                                       lambda: bool(_deaths(errors)))
            self._fail(*self._failure(errors, method, elapsed), unfinished=pending)
        if pending:
            stuck = sorted(refs.index(ref) for ref in pending)
            self._fail(f"ranks {stuck} did not finish {method} within {timeout_s:.0f}s (the others did)",
                       unfinished=pending)
        return [results[rank] for rank in range(len(refs))]

    @staticmethod
    def _gather(refs: list, pending: list, deadline: float, results: dict, errors: dict,
                stop: Callable[[], bool]) -> list:
        """Wait for `pending` one completion at a time until `stop()` or the deadline; file each
        result or error under its rank. Returns what is still pending."""
        while pending and not stop():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in done:
                try:
                    results[refs.index(ref)] = ray.get(ref)
                except ray.exceptions.RayError as err:
                    errors[refs.index(ref)] = err
        return pending

    def _failure(self, errors: dict[int, Exception], method: str, elapsed: float) -> tuple[str, Exception]:
        """One line naming the rank to blame (a dead one before those that failed because of it)."""
        dead = _deaths(errors)
        rank = min(dead or errors)
        if dead:
            others = f"; also dead: ranks {sorted(dead)[1:]}" if len(dead) > 1 else ""
            message = (f"{self._where(rank)} died during {method}, {elapsed:.1f} s in ({_death_reason(errors[rank])})"
                       f"{others}; the other ranks were stopped")
        else:
            message = (f"{self._where(rank)} failed in {method} after {elapsed:.1f} s: {_one_line(errors[rank])}; "
                       "the other ranks were stopped")
        return message, errors[rank]

    def _where(self, rank: int) -> str:
        return f"rank {rank}" + (f" ({self.places[rank]})" if rank < len(self.places) else "")

    def _fail(self, message: str, cause: Exception | None = None, unfinished: list = ()) -> None:
        self.shutdown()
        # The stopped ranks' calls end in errors too: fetch them, or Ray prints each one's traceback
        # as "Unhandled error" beside our one-line message.
        done, _ = ray.wait(list(unfinished), num_returns=len(unfinished), timeout=_DEATH_REPORT_S)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                pass
        raise WorkerGroupError(message) from cause

    def shutdown(self) -> None:
        """Kill every rank and free the placement (again after a failure: a no-op)."""
        for worker in self.workers:
            ray.kill(worker)
        if self.owns_placement:
            self.placement.remove()
        self.workers = []
