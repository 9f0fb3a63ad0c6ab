"""Settings derived from a RunConfig, computed in one place: the launcher, the trainer and
validation all read them from here (world size, data-parallel size, the optimizer of each phase,
the engine's options), so no two layers can disagree about them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from mrl.config.schema import OptimConfig, Recompute, RunConfig
from mrl.layout import ParallelLayout


def fill_run_paths(cfg: RunConfig) -> None:
    """Paths left empty go under the run's output dir: its checkpoints, and a tiny-zoo model."""
    out = Path(cfg.trainer.output_dir)
    if not cfg.checkpoint.dir:
        cfg.checkpoint.dir = str(out / "checkpoints")
    if cfg.model.tiny and not cfg.model.path:
        cfg.model.path = str(out / "model")


def layout_of(cfg: RunConfig) -> ParallelLayout:
    p = cfg.parallel
    return ParallelLayout(tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp, vpp=p.vpp, cp=p.cp,
                          first_stage_layers=p.first_stage_layers, last_stage_layers=p.last_stage_layers)


def actor_gpus(cfg: RunConfig) -> int:
    """GPUs the actor may use: the cluster's, less those reserved for rollout (separate placement)."""
    launch = cfg.launch
    reserved = launch.rollout_gpus if launch.placement == "separate" else 0
    return launch.num_nodes * launch.gpus_per_node - reserved


def actor_world_size(cfg: RunConfig) -> int:
    """Actor processes: parallel.world_size, else every actor GPU (a CPU run: the layout's minimum)."""
    if cfg.parallel.world_size:
        return cfg.parallel.world_size
    if cfg.launch.gpus_per_node == 0:
        return layout_of(cfg).min_world_size()
    return actor_gpus(cfg)


def data_parallel_size(cfg: RunConfig) -> int:
    return layout_of(cfg).data_parallel_size(actor_world_size(cfg))


def has_critic(cfg: RunConfig) -> bool:
    return cfg.algo.advantage_estimator == "gae"


def mini_batches(cfg: RunConfig) -> int:
    """Optimizer steps per pass over a rollout batch (trainer.ppo_mini_batch_size)."""
    size = cfg.trainer.ppo_mini_batch_size
    return cfg.data.batch_size // size if size else 1


def epochs_of(cfg: RunConfig, role: Literal["actor", "critic"]) -> int:
    """Passes over each rollout batch: trainer.ppo_epochs, or critic.ppo_epochs for the critic."""
    return (cfg.critic.ppo_epochs or cfg.trainer.ppo_epochs) if role == "critic" else cfg.trainer.ppo_epochs


def optim_for(cfg: RunConfig, phase: Literal["rl", "sft", "critic"] = "rl") -> OptimConfig:
    """optim with the schedule of a phase: RL over trainer.total_steps; the SFT warm start at
    trainer.sft_lr after the warmup, by trainer.sft_schedule over trainer.sft_steps (to 0); the
    critic as RL at critic.lr.

    The scheduler counts optimizer steps; an RL step takes epochs × mini-batches of them, so RL's
    warmup and length (given in RL steps) are scaled by that: a schedule then ends with the run."""
    o = cfg.optim
    if phase == "sft":
        return replace(o, lr=cfg.trainer.sft_lr or o.lr, min_lr=0.0, schedule=cfg.trainer.sft_schedule,
                       total_steps=cfg.trainer.sft_steps)
    per_step = epochs_of(cfg, "critic" if phase == "critic" else "actor") * mini_batches(cfg)
    rl = replace(o, total_steps=(o.total_steps or cfg.trainer.total_steps) * per_step,
                 warmup_steps=o.warmup_steps * per_step)
    if phase == "critic":
        lr = cfg.critic.lr or o.lr
        return replace(rl, lr=lr, min_lr=min(o.min_lr, lr))
    return rl


def recompute_of(cfg: RunConfig) -> Recompute:
    m = cfg.model
    modules = None if m.recompute_modules is None else tuple(m.recompute_modules)
    return Recompute(m.recompute, modules, m.recompute_num_layers)


def agent_rows(cfg: RunConfig) -> bool:
    """Whether the rollout's prompts carry their dataset rows (mrl.rollout.engine.Task): episodes get them."""
    return cfg.agent.loop != "none"


def returns_routes(cfg: RunConfig) -> bool:
    """Whether samples carry the engine's MoE routes: rollout.return_routes, or algo.router_replay R3,
    which replays them and means nothing without them (so it turns the capture on, not refuses)."""
    return cfg.rollout.return_routes or cfg.algo.router_replay == "R3"


def engine_options(cfg: RunConfig) -> dict[str, Any]:
    """vllm.LLM keyword arguments of the rollout section."""
    r = cfg.rollout
    options = dict(tensor_parallel_size=r.tensor_parallel_size, dtype=r.dtype, max_model_len=r.max_model_len,
                   enforce_eager=r.enforce_eager, seed=r.seed, gpu_memory_utilization=r.gpu_memory_utilization,
                   weight_apply=cfg.sync.apply, interruptible=cfg.async_.partial_rollout,
                   streaming=cfg.async_.streaming, return_routes=returns_routes(cfg))
    if r.kv_cache_memory_mb is not None:
        options["kv_cache_memory_bytes"] = r.kv_cache_memory_mb << 20
    if r.expert_parallel:
        options["expert_parallel"] = True
    if cfg.agent.loop != "none":  # the rollout actor runs episodes; their turns are concurrent engine calls
        options["agent"] = agent_settings(cfg)
    return options


def agent_settings(cfg: RunConfig) -> dict[str, Any]:
    """The agent section as the rollout actor takes it (mrl.agent.runner.AgentSettings' fields); a
    "file.py:name" spec made absolute, since the actor runs elsewhere than the config was read."""
    a = cfg.agent
    return dict(loop=_absolute(a.loop), tools=tuple(_absolute(t) for t in a.tools), max_turns=a.max_turns,
                max_tokens=a.max_tokens or cfg.rollout.max_model_len, max_tool_response_chars=a.max_tool_response_chars,
                tool_timeout_s=a.tool_timeout_s, environment=a.environment and _absolute(a.environment),
                openai_agent=a.openai_agent and _absolute(a.openai_agent), episode_timeout_s=a.episode_timeout_s,
                turn_batching=a.turn_batching, workdir=str(Path.cwd()))


def _absolute(spec: str) -> str:
    target, sep, name = spec.rpartition(":")
    return f"{Path(target).resolve()}{sep}{name}" if target.endswith(".py") else spec
