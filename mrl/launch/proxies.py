"""Typed calls from the driver to its workers: one method per worker method, same name, same
arguments, so a reader (and an editor's go-to-definition) follows `actor.save(...)` to
MegatronActor.save and `engine.generate(...)` to RolloutServer.generate.

Every call names the worker method by reference (MegatronActor.save, not "save") and checks its
arguments against that method's signature before anything is sent: a wrong call fails on the
driver, at once, with Python's own message.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import ray
import torch

from mrl.config.schema import OptimConfig, SyncConfig
from mrl.launch.rollout_actor import RolloutServer
from mrl.launch.worker_group import WorkerGroup
from mrl.rollout.engine import Generation, SamplingSettings
from mrl.routes import agreement_from_counts
from mrl.sync.channel import SyncEndpoint
from mrl.sync.wire import WeightUpdateReport
from mrl.workers.actor import ActorSetup, MegatronActor

SHUTDOWN_S = 10.0  # how long closing an engine waits for it to stop its worker processes before the kill


def _checked(method: Callable, *args: Any, **kwargs: Any) -> str:
    """`method`'s name, once its signature accepts these arguments (self excluded)."""
    inspect.signature(method).bind(None, *args, **kwargs)
    return method.__name__


@dataclass
class Scored:
    """A log-prob pass over the whole batch: `logprobs` [B, L]; for a batch with MoE routes the
    routing metrics (rollout/routing_agreement, …: the DP ranks' agreement counts summed, then
    mrl.routes.agreement_from_counts); with algo.router_replay R2 the routes the pass recorded,
    `replay` {"routes" [B, L, M, K], "routes_len" [B]}, for the updates to replay. Both empty otherwise."""

    logprobs: torch.Tensor
    routing: dict[str, float] = field(default_factory=dict)
    replay: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, results: list[dict]) -> Scored:
        """From the DP slices' results, in DP order (their rows concatenate into the batch's)."""
        counts = [r["routing_counts"] for r in results if "routing_counts" in r]
        routing = agreement_from_counts(torch.stack(counts).sum(0)) if counts else {}
        replay = {key: torch.cat([r[key] for r in results]) for key in ("routes", "routes_len") if key in results[0]}
        return cls(torch.cat([r["logprobs"] for r in results]), routing, replay)


class ActorGroup:
    """The Megatron ranks of one worker group (the actor, or a PPO critic): typed collective calls."""

    def __init__(self, group: WorkerGroup):
        self.group = group

    def _all(self, method: Callable, *args: Any, timeout_s: float | None = None) -> list[Any]:
        return self.group.call(_checked(method, *args), *args, timeout_s=timeout_s)

    def _by_dp(self, method: Callable, *args: Any) -> list[dict]:
        return self.group.by_dp(_checked(method, *args), *args)

    def _first(self, method: Callable, *args: Any) -> Any:
        return self.group.first(_checked(method, *args), *args)

    # --- set-up and schedule ------------------------------------------------------------------

    def setup(self, setup: ActorSetup) -> list[dict]:
        return self._all(MegatronActor.setup, setup)

    def restart_lr_schedule(self, optim: OptimConfig) -> None:
        self._all(MegatronActor.restart_lr_schedule, optim)

    # --- per-step work --------------------------------------------------------------------------

    def logprobs(self, batch: dict, reference: bool = False) -> Scored:
        """The whole batch's log-probs under the policy (or the frozen reference), with what the
        policy's pass says about MoE routes (Scored)."""
        return Scored.of(self._by_dp(MegatronActor.logprobs, batch, reference))

    def values(self, batch: dict) -> torch.Tensor:
        """[B, L] values of the whole batch (a critic)."""
        return torch.cat([r["values"] for r in self._by_dp(MegatronActor.values, batch)])

    def update(self, batch: dict, algo: Any) -> list[dict]:
        """One policy step; each DP slice's metrics."""
        return self._by_dp(MegatronActor.update, batch, algo)

    def update_critic(self, batch: dict, cliprange: float, aggregation: str) -> list[dict]:
        return self._by_dp(MegatronActor.update_critic, batch, cliprange, aggregation)

    def sft_step(self, batch: dict) -> list[dict]:
        return self._by_dp(MegatronActor.sft_step, batch)

    def probe_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        return self._first(MegatronActor.probe_logprobs, sequences)

    # --- colocated offload (trainer.offload_actor_during_rollout) -----------------------------

    def offload_state(self, parts: list[str], move_host_tensors: bool = False) -> list[dict]:
        """Move `parts` of every rank's state off its GPU; each rank's report (bytes, by part), by rank."""
        return self._all(MegatronActor.offload_state, parts, move_host_tensors)

    def onload_state(self) -> list[dict]:
        """Bring every rank's offloaded state back; each rank's report, by rank."""
        return self._all(MegatronActor.onload_state)

    # --- profiling (profile.steps) --------------------------------------------------------------

    def start_profile(self) -> None:
        self._all(MegatronActor.start_profile)

    def stop_profile(self, directory: str, role: str) -> list[str]:
        """Each rank's trace file, by rank."""
        return self._all(MegatronActor.stop_profile, directory, role)

    # --- weight sync and checkpoints ------------------------------------------------------------

    def open_sender(self, endpoints: list[SyncEndpoint], settings: SyncConfig) -> None:
        """Every rank's weight sender for these engines (endpoints[0] is the hub) and settings:
        once before the first push, and again when the engines change."""
        self._all(MegatronActor.open_sender, endpoints, settings)

    def push_weights(self, sync_id: str) -> dict:
        """One export sent to every engine of the open sender; the sending leader's report
        (bytes, seconds, checksums)."""
        return self._first(MegatronActor.push_weights, sync_id)

    def save(self, root: str, step: int, data_state: dict, config: dict, keep: int, async_save: bool) -> None:
        self._all(MegatronActor.save, root, step, data_state, config, keep, async_save)

    def finish_save(self) -> None:
        self._all(MegatronActor.finish_save)

    def load(self, path: str) -> dict:
        """{"step", "data"} of the loaded checkpoint (rank 0's; every rank loads the same)."""
        return self._all(MegatronActor.load, path)[0]

    def load_policy(self, path: str, into_reference: bool = False) -> None:
        self._all(MegatronActor.load_policy, path, into_reference)

    def shutdown(self, timeout_s: float = 120.0) -> None:
        """Finish saves and leave the process group, then stop the processes."""
        try:
            self._all(MegatronActor.shutdown, timeout_s=timeout_s)
        finally:
            self.group.shutdown()


class EngineError(RuntimeError):
    """A rollout engine failed, died or did not answer in time; the message names it and its node."""


def engine_silent(what: str, names: str, timeout_s: float, setting: str = "sync.timeout_s") -> EngineError:
    """The error for engines that did not answer `what` within `timeout_s` (the value of `setting`)."""
    return EngineError(f"{what}: {names} did not answer within {timeout_s:.0f}s (hung or overloaded; "
                       f"raise {setting} if it is only slow)")


def engine_died(what: str, name: str) -> EngineError:
    """The error for an engine whose process exited during `what`."""
    return EngineError(f"{what}: {name} died (its process exited: killed, out of memory or crashed; Ray's "
                       "worker log of that actor may say which)")


def engine_wait(ref: Any, timeout_s: float, what: str, name: str) -> Any:
    """The answer of one engine call, or EngineError in one line naming the engine (Ray's report
    stays in __cause__): a dead engine fails the wait at once, a silent one at `timeout_s`."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as err:
        raise engine_silent(what, name, timeout_s) from err
    except ray.exceptions.RayActorError as err:
        raise engine_died(what, name) from err


class PendingReport:
    """An engine's weight receipt in progress (the engine blocks in it until the update is whole)."""

    def __init__(self, ref: Any, timeout_s: float, name: str = "the rollout engine"):
        self.ref, self.timeout_s, self.name = ref, timeout_s, name

    def result(self) -> WeightUpdateReport:
        return engine_wait(self.ref, self.timeout_s, "weight update", self.name)

    def failure(self, within_s: float) -> EngineError | None:
        """EngineError if the engine turns out dead within `within_s`; None if its receipt is still
        waiting, succeeded, or raised (an engine that refused an update: the senders' error says why)."""
        ready, _ = ray.wait([self.ref], timeout=within_s)
        if not ready:
            return None
        try:
            self.result()
        except EngineError as err:  # died (the ref is ready: never a timeout here)
            return err
        except ray.exceptions.RayError:  # it raised: the senders' error already says why
            pass
        return None


class EngineHandle:
    """The rollout engine's Ray actor: typed calls, each waited for with a timeout."""

    GENERATE_TIMEOUT_FACTOR = 4  # a rollout may take longer than other calls: generate waits this × timeout_s

    def __init__(self, actor: Any, timeout_s: float, name: str = "the rollout engine", node_actors: Sequence[Any] = (),
                 placement: Any = None, watchers: Sequence[Any] = ()):
        self.actor, self.timeout_s = actor, timeout_s
        self.name = name  # in errors; a fleet names its engines with their index and node
        # an engine spanning nodes (mrl.launch.engine_nodes): its other nodes' actors, its placement
        # group, and a call per node that ends only when that node's workers die (EngineNode.watch)
        self.node_actors, self.placement, self.watchers = list(node_actors), placement, list(watchers)

    def kill(self) -> None:
        """Kill the engine's actors at once (no shutdown: for one that is dead, hung or still
        starting) and free its placement group (once: a second kill frees nothing)."""
        for actor in [self.actor, *self.node_actors]:
            ray.kill(actor)
        placement, self.placement = self.placement, None
        if placement is not None:
            ray.util.remove_placement_group(placement)

    def submit(self, method: Callable, *args: Any) -> Any:
        """Start RolloutServer.`method` without waiting: its Ray reference (a fleet waits for all
        its engines at once, see mrl.launch.fleet)."""
        return getattr(self.actor, _checked(method, *args)).remote(*args)

    def _call(self, method: Callable, *args: Any, timeout_s: float | None = None) -> Any:
        return engine_wait(self.submit(method, *args), timeout_s or self.timeout_s, method.__name__, self.name)

    def generate(self, prompts: Sequence[list[int]], sampling: SamplingSettings) -> list[list[Generation]]:
        """Samples per prompt; a sleeping engine wakes first (the engine does it, see VLLMEngine)."""
        return self._call(RolloutServer.generate, prompts, sampling,
                          timeout_s=self.timeout_s * self.GENERATE_TIMEOUT_FACTOR)

    def score(self, sequences: Sequence[list[int]]) -> list[list[float]]:
        return self._call(RolloutServer.score, sequences)

    def load_checkpoint(self, model_dir: str, weight_version: int = 0) -> WeightUpdateReport:
        """The engine as if started on `model_dir` (RolloutServer.load_checkpoint)."""
        return self._call(RolloutServer.load_checkpoint, model_dir, weight_version)

    def interrupt(self) -> None:
        """Stop the engine's generation now (its own concurrency group: answered while generate runs)."""
        self._call(RolloutServer.interrupt)

    def sleep(self) -> None:
        self._call(RolloutServer.sleep)

    def endpoint(self) -> SyncEndpoint:
        return self._call(RolloutServer.endpoint)

    def node_ip(self) -> str:
        return self._call(RolloutServer.node_ip)

    def receive_weights(self, sync_id: str, channels: int, engines: int = 1, index: int = 0,
                        hub: SyncEndpoint | None = None) -> PendingReport:
        """Start receiving an update (as engine `index` of `engines`, joining engine 0's `hub`);
        the senders push while this waits (see mrl.sync.driver)."""
        args = (sync_id, channels, engines, index, hub)
        name = _checked(RolloutServer.receive_weights, *args)
        return PendingReport(getattr(self.actor, name).remote(*args), self.timeout_s, self.name)

    def close(self) -> None:
        close_engines([self])


def close_engines(handles: Sequence[EngineHandle]) -> None:
    """Stop every engine (its workers, and the shared memory of worker processes, all at once), then its
    actor. A dead or unresponsive engine is killed all the same, after at most SHUTDOWN_S."""
    stopping, errors = [], []
    for handle in handles:
        try:
            stopping.append(handle.submit(RolloutServer.shutdown))
            stopping += [node.shutdown.remote() for node in handle.node_actors]
        except Exception as err:  # noqa: BLE001 - every engine is killed below all the same
            errors.append(err)
    ray.wait(stopping, num_returns=len(stopping), timeout=SHUTDOWN_S)  # what failed to stop is killed anyway
    for handle in handles:
        try:
            handle.kill()
        except Exception as err:  # noqa: BLE001 - the other engines must stop too; the first error is raised
            errors.append(err)
    if errors:
        raise errors[0]
