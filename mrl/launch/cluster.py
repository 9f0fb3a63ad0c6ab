"""Bring up what a run needs: Ray (local or an existing cluster), the Megatron actor's worker group
(and a PPO critic's), and the rollout engines (rollout.num_engines, mrl.launch.fleet), each behind a
typed proxy (mrl.launch.proxies); and the one operation that joins them, the weight sync (mrl.sync.driver)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

import ray

from mrl.config import RunConfig
from mrl.config.derived import actor_world_size, engine_options, has_critic, layout_of, optim_for, recompute_of
from mrl.launch.colocation import engine_slots, rank_gpus
from mrl.launch.engine_nodes import EnginePart
from mrl.launch.fleet import EngineFleet, FleetGeneration
from mrl.launch.placement import RankPlacement, place_ranks
from mrl.launch.proxies import ActorGroup, EngineHandle
from mrl.launch.route_probe import routing_check
from mrl.launch.worker_group import WorkerGroup
from mrl.rank_map import write_rank_map
from mrl.rollout.engine import Generation, SamplingSettings
from mrl.sync.channel import channel_count
from mrl.sync.driver import WeightSync
from mrl.sync.parity import probe_sequences
from mrl.workers.actor import ActorSetup


@dataclass
class Cluster:
    """The run's Ray processes: Megatron ranks (`actor`, and for PPO `critic` in the same layout)
    and the vLLM engines (`engines`, None for SFT only), and the weight sync between them."""

    cfg: RunConfig
    actor: ActorGroup
    engines: EngineFleet | None
    owns_ray: bool
    critic: ActorGroup | None = None
    sync: WeightSync | None = None
    shared: RankPlacement | None = None  # on shared GPUs: the run's placement group (_shared_gpus)
    engine_parts: Any = None  # colocated on GPUs: where engine i's parts run in it (EngineFleet.start's parts)
    offloaded: bool = field(default=False, init=False)  # the trainers' state is in host memory now
    _unreported: dict = field(default_factory=dict, init=False)  # an offload outside the push, for the next onload
    # trainer.offload_actor_during_rollout: move the ranks' host tensors too (tests on CPU only)
    offload_host_tensors: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        restarts = getattr(self.engines, "restarts", None)  # rollout.engine_restarts (mrl/launch/restarts.py)
        if restarts is not None and self.sync is not None:
            self.sync.engines = list(self.sync.engines)  # its own list: the fleet replaces engines in its own
            restarts.join_now = self._join_restarted

    def generate(self, prompt_ids: list[list[int]],
                 sampling: SamplingSettings) -> tuple[list[list[Generation]], dict[str, float]]:
        """Samples per prompt, spread over the engines; and each engine's throughput metrics."""
        self._away_before_generating()
        return self.engines.generate(prompt_ids, sampling)

    def generate_async(self, prompt_ids: list[list[int]],
                       sampling: SamplingSettings | list[SamplingSettings]) -> FleetGeneration:
        """Start generating; the driver goes on until the result is asked for (trainer.mode one_step_off)."""
        self._away_before_generating()
        return self.engines.generate_async(prompt_ids, sampling)

    def interrupt_engines(self) -> None:
        """async.partial_rollout: the engines stop generating until the next weight push (EngineFleet.interrupt)."""
        self.engines.interrupt()

    def release_engines(self) -> dict[str, float]:
        """Colocated placement: the engines free their accelerator memory while the actor trains
        (vLLM sleep; a no-op on CPU). Whatever they are asked next (generate, a sync) wakes them.
        Never while they generate (one_step_off does not call this: validation keeps it off colocated GPUs).
        With trainer.offload_actor_during_rollout the trainers' state then comes back: its metrics."""
        if self.cfg.launch.placement == "colocated":
            self.engines.sleep()
        return self._onload()

    def sync_weights(self) -> dict[str, float]:
        """Push the actor's weights into every engine; check parity when due. Returns metrics.
        With trainer.offload_actor_during_rollout the trainers' state leaves the GPU around the push
        (the engines generate next): gradients, optimizer state and the KL reference (and a critic's
        everything) before it, the actor's weights, which the push reads, after it."""
        if not self.cfg.trainer.offload_actor_during_rollout:
            return self._push()
        metrics = self._offload(["grads", "optimizer", "reference"], list(OFFLOAD_PARTS))
        metrics.update(self._push())
        return _added(metrics, self._offload(["weights"], []))

    def _push(self) -> dict[str, float]:
        """The weight sync; with rollout.engine_restarts, an engine found failed is replaced first
        and restarted ones join (EngineRestarts.push)."""
        restarts = getattr(self.engines, "restarts", None)
        return self.sync() if restarts is None else restarts.push(self.engines, self.sync)

    def _join_restarted(self) -> dict[str, float]:
        """No engine holds the weights mid-generation (every one was restarted): the trainer's go
        to the restarted engines now, its state on the device for the push and away again after."""
        restarts, offload = self.engines.restarts, self.cfg.trainer.offload_actor_during_rollout
        if offload:
            self._onload()
        try:
            return restarts.join(self.engines, self.sync, sorted(restarts.fresh), restarts.version - 1)
        finally:
            if offload:
                self._away_before_generating()

    @contextmanager
    def trainers_on_device(self) -> Iterator[None]:
        """For a checkpoint save between steps while the trainers are offloaded: the engines sleep,
        the state comes back for the block and leaves again after it (not in the step's metrics)."""
        if not self.offloaded:
            yield
            return
        self.engines.sleep()
        self._onload()
        try:
            yield
        finally:
            self._offload(list(OFFLOAD_PARTS), list(OFFLOAD_PARTS))

    def _away_before_generating(self) -> None:
        """trainer.offload_actor_during_rollout: the engines generate only with the trainers' state
        away. The push sends it away; an evaluation before the first push has not pushed: the state
        leaves here, reported with the next onload."""
        if self.cfg.trainer.offload_actor_during_rollout and not self.offloaded:
            self._unreported = _added(self._unreported, self._offload(list(OFFLOAD_PARTS), list(OFFLOAD_PARTS)))

    def _offload(self, actor_parts: list[str], critic_parts: list[str]) -> dict[str, float]:
        """Move these parts of the actor's (and a critic's) state to host memory; per role the bytes
        moved (summed over ranks) and the driver's wait."""
        metrics: dict[str, float] = {}
        for role, group, parts in zip(("actor", "critic"), self.trainers(), (actor_parts, critic_parts)):
            if not parts:
                continue
            start = time.perf_counter()
            reports = group.offload_state(parts, self.offload_host_tensors)
            metrics[f"perf/{role}_offload_bytes"] = float(sum(r["bytes"] for r in reports))
            metrics[f"timing_s/{role}_offload"] = time.perf_counter() - start
        self.offloaded = True
        return metrics

    def _onload(self) -> dict[str, float]:
        """Bring the trainers' offloaded state back (nothing to do: no metrics)."""
        if not self.offloaded:
            return {}
        metrics, self._unreported = self._unreported, {}
        for role, group in zip(("actor", "critic"), self.trainers()):
            start = time.perf_counter()
            reports = group.onload_state()
            metrics[f"perf/{role}_onload_bytes"] = float(sum(r["bytes"] for r in reports))
            metrics[f"timing_s/{role}_onload"] = time.perf_counter() - start
        self.offloaded = False
        return metrics

    def trainers(self) -> list[ActorGroup]:
        """The worker groups that train and checkpoint: the actor, then the critic if any."""
        return [self.actor] + ([self.critic] if self.critic is not None else [])

    def stop_engines(self) -> None:
        """Stop the engines (the run has no more use for them): their nodes and GPUs are free again."""
        if self.engines is not None:
            engines, self.engines, self.sync = self.engines, None, None
            engines.close()

    def close(self) -> None:
        """Stop every group, the engines and an owned Ray, whatever fails on the way (the first
        error is raised at the end)."""
        errors = []
        for group in self.trainers():
            try:
                group.shutdown()
            except Exception as err:  # noqa: BLE001 - the other groups must stop too
                errors.append(err)
        if self.engines is not None:
            try:
                self.engines.close()
            except Exception as err:  # noqa: BLE001 - Ray must stop too
                errors.append(err)
        if self.shared is not None:
            self.shared.remove()
        if self.owns_ray:
            ray.shutdown()
        if errors:
            raise errors[0]


OFFLOAD_PARTS = ("weights", "grads", "optimizer", "reference")  # mrl.megatron.offload.PARTS


def _added(metrics: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    """`metrics` with `more` added key by key (two offloads in one step: their bytes and seconds sum)."""
    return {**metrics, **{k: metrics.get(k, 0.0) + v for k, v in more.items()}}


def start_cluster(cfg: RunConfig, hf_dir: str, vocab_size: int, with_engine: bool = True) -> Cluster:
    """Ray, the engines (started first, all at once: their weights come from `hf_dir` too), the
    actor ranks and, for PPO, the critic ranks (a second group in the same layout, with a value head)."""
    launch, world, critic, engines = cfg.launch, actor_world_size(cfg), has_critic(cfg), cfg.rollout.num_engines
    # Logical CPUs for every process we start, whatever the machine's count.
    owns_ray = init_ray(launch.address, max(launch.cpus_per_node, world * (1 + critic) + engines + 1),
                        launch.gpus_per_node or None)
    share = gpu_share(cfg)
    fleet, groups, shared = None, [], None
    try:
        shared, parts = _shared_gpus(cfg, world, max(600.0, cfg.sync.timeout_s), with_engine)
        if with_engine:
            fleet = EngineFleet.start(engine_checkpoint(cfg, hf_dir), engine_options(cfg), engines, num_cpus=1,
                                      num_gpus=engine_gpus(cfg),
                                      sync_timeout_s=cfg.sync.timeout_s, timeout_s=cfg.sync.timeout_s,
                                      start_timeout_s=cfg.rollout.start_timeout_s,
                                      restarts=cfg.rollout.engine_restarts,
                                      nodes_per_engine=cfg.rollout.nodes_per_engine, parts=parts)
        setup = ActorSetup(hf_dir=hf_dir, layout=layout_of(cfg), params_dtype=cfg.model.dtype,
                           transformer_impl=cfg.model.transformer_impl, recompute=recompute_of(cfg), fp8=cfg.model.fp8,
                           seed=cfg.trainer.seed,
                           optim=optim_for(cfg), reference=cfg.algo.kl_coef > 0,
                           router_replay=cfg.algo.router_replay)
        setups = [setup] + ([replace(setup, hf_dir=cfg.model.critic_path or hf_dir, optim=optim_for(cfg, "critic"),
                                     reference=False, value_head=True, router_replay="none")] if critic else [])
        for role_setup in setups:
            groups.append(ActorGroup(WorkerGroup(world, cpus_per_worker=1, gpus_per_worker=share,
                                                 timeout_s=max(600.0, cfg.sync.timeout_s), layout=setup.layout,
                                                 allow_split=launch.allow_cross_node_tp, placement=shared)))
            groups[-1].setup(role_setup)
        write_rank_map(Path(cfg.trainer.output_dir), dict(zip(("actor", "critic"), (g.group.ranks for g in groups))),
                       fleet.places() if fleet is not None else ())
        probe = probe_sequences(vocab_size)
        sync = None if fleet is None else WeightSync(groups[0], fleet.handles, cfg.sync,
                                                     channel_count(cfg.sync.transport, cfg.parallel.pp), probe,
                                                     routing_check(cfg, hf_dir, probe, groups[0]))
    except BaseException:
        for group in groups:
            group.group.shutdown()
        if fleet is not None:
            fleet.close()
        if shared is not None:
            shared.remove()
        if owns_ray:
            ray.shutdown()
        raise
    return Cluster(cfg, groups[0], fleet, owns_ray, critic=groups[1] if critic else None, sync=sync, shared=shared,
                   engine_parts=parts)


def _shared_gpus(cfg: RunConfig, world: int, timeout_s: float,
                 with_engine: bool = True) -> tuple[RankPlacement | None, Any]:
    """On GPUs that processes share (engines colocated, or a PPO critic beside the actor): the run's
    placement group, a whole GPU a bundle and the ranks numbered by node, so that each rank of a group
    gets a GPU of its own (Ray would pack two half-GPU bundles of one group onto a GPU); and, with
    colocated engines, where each engine's parts run in it (mrl.launch.colocation). (None, None)
    otherwise: the ranks and engines place themselves."""
    launch, r, colocated = cfg.launch, cfg.rollout, cfg.launch.placement == "colocated"
    if not launch.gpus_per_node or gpu_share(cfg) == 1:
        return None, None
    bundle = {"CPU": 1 + has_critic(cfg) + colocated, "GPU": 1}  # a rank, a critic's, an engine's part
    shared = place_ranks(world, bundle, timeout_s, layout_of(cfg), launch.allow_cross_node_tp)
    if not (colocated and with_engine):
        return shared, None
    try:
        slots = engine_slots(shared, rank_gpus(shared, timeout_s), r.num_engines, r.tensor_parallel_size,
                             r.nodes_per_engine)
    except BaseException:
        shared.remove()
        raise
    share = gpu_share(cfg)
    return shared, lambda i: [EnginePart(slot.strategy(shared), 1, share, slot.env()) for slot in slots[i]]


def gpu_share(cfg: RunConfig) -> float:
    """The share of a GPU each process on it takes: actor and critic ranks, and the engine when colocated."""
    colocated = cfg.launch.placement == "colocated"
    return 0.0 if cfg.launch.gpus_per_node == 0 else 1 / (1 + has_critic(cfg) + colocated)


def engine_gpus(cfg: RunConfig) -> int:
    """An engine's GPUs of its own (placement separate, or a one-off engine): whole ones. Colocated on
    GPUs, an engine takes a share of the run's bundles instead (_shared_gpus)."""
    return cfg.rollout.tensor_parallel_size if cfg.launch.gpus_per_node else 0


def init_ray(address: str | None, num_cpus: int, num_gpus: int | None = None) -> bool:
    """Join `address`, or start a local instance with these logical resources; False (and nothing
    done) when Ray is already running. True: the caller owns Ray and shuts it down."""
    if ray.is_initialized():
        return False
    handler = signal.getsignal(signal.SIGTERM)
    with _without_default_auth_notice():
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            # "local": a new instance, even where `ray start` left a cluster (alive or dead) that a bare
            # ray.init() would try to join (Ray's /tmp/ray/ray_current_cluster)
            ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                     log_to_driver=False)
    if callable(handler) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)  # ray.init replaced the driver's own (mrl/stopping.py) with sys.exit
    return True


# The logger of Ray's token-authentication set-up (Ray 2.60: ray/_private/authentication/).
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


class _DefaultAuthNotice(logging.Filter):
    """Drops Ray's notice that a new local instance turned token authentication on, as it does by
    default when RAY_AUTH_MODE is unset ("Token authentication is enabled for this Ray cluster. Set
    RAY_AUTH_MODE=disabled to opt out."), which every run printed. Nothing else: the warning that
    authentication is disabled passes, and the authentication itself is Ray's (RAY_AUTH_MODE)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


@contextmanager
def _without_default_auth_notice() -> Iterator[None]:
    notice, logger = _DefaultAuthNotice(), logging.getLogger(RAY_AUTH_LOGGER)
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


@contextmanager
def local_ray(num_cpus: int) -> Iterator[None]:
    """A local Ray instance for the block, unless one is running already (then it is left running)."""
    owns = init_ray(None, num_cpus)
    try:
        yield
    finally:
        if owns:
            ray.shutdown()


def engine_checkpoint(cfg: RunConfig, hf_dir: str) -> str:
    """The directory the engines load: `hf_dir`, or for rollout.quantization fp8 its block-FP8 twin,
    written under trainer.output_dir at every start (an FP8 `hf_dir` is loaded as it is)."""
    from mrl.bridge.dequantize import write_quantized
    from mrl.bridge.hf_checkpoint import HFCheckpoint

    if cfg.rollout.quantization != "fp8" or HFCheckpoint(hf_dir).fp8 is not None:
        return hf_dir
    return write_quantized(hf_dir, Path(cfg.trainer.output_dir) / "rollout_fp8", force=True)["out"]


@contextmanager
def one_off_engine(cfg: RunConfig, hf_dir: str, parts: Any = None) -> Iterator[EngineHandle]:
    """A one-off engine on `hf_dir`, laid out as the run's (over rollout.nodes_per_engine nodes), stopped
    after the block: on GPUs of its own, or given `parts`, in the run's engine 0's (Cluster.engine_parts,
    once those engines have stopped). It evaluates: no sample of it is trained, so it records no MoE routes."""
    options = engine_options(cfg) | {"return_routes": False}
    fleet = EngineFleet.start(engine_checkpoint(cfg, hf_dir), options, 1, num_gpus=engine_gpus(cfg),
                              sync_timeout_s=cfg.sync.timeout_s, timeout_s=cfg.sync.timeout_s,
                              start_timeout_s=cfg.rollout.start_timeout_s,
                              nodes_per_engine=cfg.rollout.nodes_per_engine, parts=parts)
    try:
        yield fleet.handles[0]
    finally:
        fleet.close()
