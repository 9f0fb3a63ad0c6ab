"""Bring up what a run needs: Ray (local or an existing cluster), the Megatron actor's worker group
and the rollout engine's actor; and the two operations that join them: weight sync and parity check.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from mrl.config import RunConfig
from mrl.launch.rollout_actor import start_rollout_actor
from mrl.launch.worker_group import WorkerGroup
from mrl.layout import ParallelLayout
from mrl.megatron.actor import ActorSetup
from mrl.rollout.engine import Generation, SamplingSettings
from mrl.rollout.parity import check_parity, logprob_gap, probe_sequences


def layout_of(cfg: RunConfig) -> ParallelLayout:
    p = cfg.parallel
    return ParallelLayout(tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp, vpp=p.vpp,
                          first_stage_layers=p.first_stage_layers, last_stage_layers=p.last_stage_layers)


def actor_world_size(cfg: RunConfig) -> int:
    launch, layout = cfg.launch, layout_of(cfg)
    if cfg.parallel.world_size:
        return cfg.parallel.world_size
    if launch.gpus_per_node == 0:
        return layout.min_world_size()
    reserved = launch.rollout_gpus if launch.placement == "separate" else 0
    return launch.num_nodes * launch.gpus_per_node - reserved


def optim_settings(cfg: RunConfig, sft: bool = False) -> dict[str, Any]:
    """mrl.megatron.training.OptimConfig fields of the RL phase, or of the SFT warm start (its own
    learning rate, constant after the warmup)."""
    o = cfg.optim
    if sft:
        return dict(lr=cfg.trainer.sft_lr or o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0],
                    adam_beta2=o.betas[1], clip_grad=o.clip_grad, warmup_steps=o.warmup_steps,
                    total_steps=cfg.trainer.sft_steps, decay_style="constant")
    return dict(lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
                clip_grad=o.clip_grad, warmup_steps=o.warmup_steps, total_steps=cfg.trainer.total_steps,
                decay_style=o.schedule)


def critic_optim_settings(cfg: RunConfig) -> dict[str, Any]:
    """The critic's OptimConfig fields: the RL phase's, at critic.lr."""
    lr = cfg.critic.lr or cfg.optim.lr
    return {**optim_settings(cfg), "lr": lr, "min_lr": min(cfg.optim.min_lr, lr)}


def has_critic(cfg: RunConfig) -> bool:
    return cfg.algo.advantage_estimator == "gae"


def data_parallel_size(cfg: RunConfig) -> int:
    return actor_world_size(cfg) // (cfg.parallel.tp * cfg.parallel.pp)


def engine_options(cfg: RunConfig) -> dict[str, Any]:
    r = cfg.rollout
    options = dict(tensor_parallel_size=r.tensor_parallel_size, dtype=r.dtype, max_model_len=r.max_model_len,
                   enforce_eager=r.enforce_eager, seed=r.seed, gpu_memory_utilization=r.gpu_memory_utilization)
    if r.kv_cache_memory_mb is not None:
        options["kv_cache_memory_bytes"] = r.kv_cache_memory_mb << 20
    return options


@dataclass
class Cluster:
    """The run's Ray processes: Megatron ranks (`actor`, and for PPO `critic` in the same layout)
    and the vLLM engine (`engine`)."""

    cfg: RunConfig
    actor: WorkerGroup
    engine: Any
    endpoint: Any
    owns_ray: bool
    syncs: int = 0
    probe: list = field(default_factory=list)
    critic: WorkerGroup | None = None

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSettings) -> list[list[Generation]]:
        return ray.get(self.engine.generate.remote(prompt_ids, sampling), timeout=self.cfg.sync.timeout_s * 4)

    def release_engine(self) -> None:
        """Colocated placement: the engine frees its accelerator memory while the actor trains
        (vLLM sleep; a no-op on CPU). The next sync wakes it."""
        if self.cfg.launch.placement == "colocated":
            ray.get(self.engine.sleep.remote(), timeout=self.cfg.sync.timeout_s)

    def sync_weights(self) -> dict[str, float]:
        """Push the actor's weights into the engine; check parity when due. Returns metrics."""
        sync = self.cfg.sync
        ray.get(self.engine.wake_up.remote(), timeout=sync.timeout_s)
        sync_id = f"sync{self.syncs}-{uuid.uuid4().hex[:6]}"
        channels = 1 if sync.transport == "colocated" else self.cfg.parallel.pp
        start = time.perf_counter()
        receipt = self.engine.receive_weights.remote(sync_id, channels)
        sent = self.actor.first("push_weights", self.endpoint, sync_id, sync.transport, sync.bucket_mb << 20,
                                sync.timeout_s)
        report = ray.get(receipt, timeout=sync.timeout_s)
        metrics = {"sync/bytes": float(sent["bytes"]), "sync/engine_load_s": report.load_seconds,
                   "timing_s/sync_weights": time.perf_counter() - start}
        due = self.syncs == 0 or (sync.parity_every and self.syncs % sync.parity_every == 0)
        if due or report.mismatched or report.not_updated:
            gap = logprob_gap(ray.get(self.engine.score.remote(self.probe)),
                              self.actor.first("probe_logprobs", self.probe))
            metrics.update(gap)
            check_parity(gap, sync.parity_threshold, report, self.syncs)
        self.syncs += 1
        return metrics

    def trainers(self) -> list[WorkerGroup]:
        """The worker groups that train and checkpoint: the actor, then the critic if any."""
        return [self.actor] + ([self.critic] if self.critic is not None else [])

    def close(self) -> None:
        try:
            for group in self.trainers():
                group.call("shutdown", timeout_s=120)
        finally:
            for group in self.trainers():
                group.shutdown()
            if self.engine is not None:
                ray.kill(self.engine)
            if self.owns_ray:
                ray.shutdown()


def start_cluster(cfg: RunConfig, hf_dir: str, vocab_size: int, with_engine: bool = True) -> Cluster:
    """Ray, the engine (started first: its weights come from `hf_dir` too), the actor ranks and,
    for PPO, the critic ranks (a second group in the same layout, with a value head)."""
    launch, world, critic = cfg.launch, actor_world_size(cfg), has_critic(cfg)
    owns_ray = not ray.is_initialized()
    if owns_ray and launch.address:
        ray.init(address=launch.address, log_to_driver=False)
    elif owns_ray:
        # A local instance: logical CPUs for every process we start, whatever the machine's count.
        ray.init(num_cpus=max(launch.cpus_per_node, world * (1 + critic) + 2), num_gpus=launch.gpus_per_node or None,
                 include_dashboard=False, log_to_driver=False)
    colocated = launch.placement == "colocated"
    # Processes that share each GPU: actor and critic ranks, and the engine when colocated.
    share = 0.0 if launch.gpus_per_node == 0 else 1 / (1 + critic + colocated)
    engine_gpus = 0 if not share else (share if colocated else 1) * cfg.rollout.tensor_parallel_size
    engine, groups = None, []
    try:
        if with_engine:
            engine = start_rollout_actor(hf_dir, engine_options(cfg), num_cpus=1, num_gpus=engine_gpus,
                                         sync_timeout_s=cfg.sync.timeout_s)
        setup = ActorSetup(
            hf_dir=hf_dir, layout=layout_of(cfg), params_dtype=cfg.model.dtype,
            transformer_impl=cfg.model.transformer_impl, seed=cfg.trainer.seed, optim=optim_settings(cfg),
            reference=cfg.algo.kl_coef > 0, micro_batch_size=cfg.optim.micro_batch_size,
            max_tokens_per_micro_batch=cfg.optim.max_tokens_per_micro_batch,
        )
        setups = [setup] + ([replace(setup, hf_dir=cfg.model.critic_path or hf_dir, optim=critic_optim_settings(cfg),
                                     reference=False, value_head=True)] if critic else [])
        for role_setup in setups:
            groups.append(WorkerGroup(world, cpus_per_worker=1, gpus_per_worker=share,
                                      timeout_s=max(600.0, cfg.sync.timeout_s)))
            groups[-1].call("setup", role_setup)
    except BaseException:
        for group in groups:
            group.shutdown()
        if engine is not None:
            ray.kill(engine)
        if owns_ray:
            ray.shutdown()
        raise
    endpoint = None if engine is None else ray.get(engine.endpoint.remote())
    return Cluster(cfg, groups[0], engine, endpoint, owns_ray, probe=probe_sequences(vocab_size),
                   critic=groups[1] if critic else None)


def generate_once(cfg: RunConfig, hf_dir: str, prompt_ids: list[list[int]], sampling: SamplingSettings) -> list:
    """Generate with a one-off engine on `hf_dir` in its own actor (vLLM runs one engine per process)."""
    engine = start_rollout_actor(hf_dir, engine_options(cfg))
    try:
        return ray.get(engine.generate.remote(prompt_ids, sampling), timeout=cfg.sync.timeout_s * 4)
    finally:
        ray.kill(engine)
