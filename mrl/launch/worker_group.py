"""The actor's Megatron ranks as Ray actors in one placement group, without torchrun.

Rank 0 picks the rendezvous address; every worker sets RANK/WORLD_SIZE/MASTER_* and joins the
default process group itself. `call` runs a collective method on every rank and waits with a
timeout: a rank that raises or dies is reported by number, a stuck collective is an error.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mrl.workers.actor import MegatronActor

# Workers never print through the driver's console unless asked: their logs stay in Ray's files.
_WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore::FutureWarning"}


def local_ranks(hosts: list[str]) -> list[int]:
    """LOCAL_RANK of each global rank: its index among the ranks on the same node."""
    seen: dict[str, int] = {}
    ranks = []
    for host in hosts:
        ranks.append(seen.get(host, 0))
        seen[host] = ranks[-1] + 1
    return ranks


class WorkerGroupError(RuntimeError):
    """A rank failed or did not answer in time; the message names the rank and the method."""


class WorkerGroup:
    """`world_size` MegatronActor processes, packed onto as few nodes as possible."""

    def __init__(self, world_size: int, *, cpus_per_worker: float = 1.0, gpus_per_worker: float = 0.0,
                 timeout_s: float = 600.0):
        self.world_size, self.timeout_s = world_size, timeout_s
        bundle = {"CPU": cpus_per_worker, **({"GPU": gpus_per_worker} if gpus_per_worker else {})}
        self.placement = placement_group([bundle] * world_size, strategy="PACK")
        try:
            ray.get(self.placement.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.placement)
            raise WorkerGroupError(
                f"Ray could not place {world_size} workers of {bundle} within {timeout_s:.0f}s: the cluster has "
                f"{ray.cluster_resources()}; lower the layout or add resources (launch.* settings)"
            ) from None
        remote = ray.remote(MegatronActor)
        self.workers = [
            remote.options(
                num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, runtime_env={"env_vars": _WORKER_ENV},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank),
            ).remote(rank, world_size)
            for rank in range(world_size)
        ]
        master = self._get([self.workers[0].address.remote()], "address")[0]
        joins = [worker.init_process_group.remote(master, local_rank)
                 for worker, local_rank in zip(self.workers, local_ranks(self.call("hostname")), strict=True)]
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
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in done:  # a failure on any rank first: the others may be waiting for it
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:
                self._fail(f"rank {refs.index(ref)} failed in {method}: {err}")
        if pending:
            stuck = sorted(refs.index(ref) for ref in pending)
            self._fail(f"ranks {stuck} did not finish {method} within {timeout_s:.0f}s (the others did)")
        return ray.get(refs)

    def _fail(self, message: str) -> None:
        self.shutdown()
        raise WorkerGroupError(message)

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        remove_placement_group(self.placement)
        self.workers = []
