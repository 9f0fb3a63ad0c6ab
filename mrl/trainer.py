"""The RL loop, top to bottom: generate → reward → advantages → old/ref log-probs → update → sync.

The driver process holds the data, the reward functions and the algorithm's batch-level math;
the Megatron ranks (mrl/megatron/actor.py) and the vLLM engine run in Ray actors (mrl/launch).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mrl import algo
from mrl.config import RunConfig, config_to_dict
from mrl.data import EpochSampler, load_splits
from mrl.experience import actor_inputs, critic_inputs, rollout_batch, select_rows
from mrl.inputs import prepare_model, tokenize_samples
from mrl.launch.cluster import Cluster, data_parallel_size, generate_once, optim_settings, start_cluster
from mrl.metrics import MetricsLogger, plot_metrics, timer
from mrl.rewards import RewardInput, build_reward
from mrl.rollout.engine import SamplingSettings
from mrl.sft import refuse_to_overwrite_sft, run_sft, save_sft_checkpoint


def train(cfg: RunConfig) -> dict:
    """Run SFT warm start (if asked), then RL; returns held-out accuracies and where things went."""
    hf_dir, tokenizer = prepare_model(cfg.model, cfg.trainer.seed)
    train_set, heldout = (tokenize_samples(s, tokenizer) for s in load_splits(cfg.data, cfg.trainer.seed, tokenizer))
    sampler = EpochSampler(len(train_set), cfg.data.batch_size, seed=cfg.trainer.seed)
    reward = build_reward(cfg.reward.name, cfg.reward.timeout_s, cfg.reward.workers)
    out = Path(cfg.trainer.output_dir)
    refuse_to_overwrite(cfg)
    out.mkdir(parents=True, exist_ok=True)
    cluster = start_cluster(cfg, hf_dir, len(tokenizer))
    logger = None
    try:
        start, rl_start = resume(cfg, cluster, sampler)
        summary = {"resumed_from": start, "output_dir": str(out)}
        if start == 0 and rl_start is None and cfg.trainer.sft_steps:
            summary["accuracy_initial"] = evaluate(cluster, heldout, reward, cfg)  # the engine holds the HF weights
            summary["sft"] = run_sft(cfg, cluster, train_set, tokenizer)
            rl_start = save_sft_checkpoint(cfg, cluster)
        if rl_start is not None:
            start_from_policy(cfg, cluster, rl_start, fresh=start == 0)
        logger = MetricsLogger(out, cfg.trainer.total_steps, jsonl=cfg.logging.jsonl,
                               tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                               wandb_project=cfg.logging.wandb_project, run_name=cfg.trainer.name,
                               config=config_to_dict(cfg), resume_step=start)
        # The engine starts from the HF weights; SFT or a resume changed them. This first sync is
        # always parity-checked.
        first = cluster.sync_weights()
        first["eval/accuracy"] = summary["accuracy_before"] = summary["accuracy_after"] = evaluate(
            cluster, heldout, reward, cfg)
        if start == 0:
            logger.log(0, first)
        for step in range(start + 1, cfg.trainer.total_steps + 1):
            metrics = rl_step(step, cfg, cluster, train_set, sampler, reward)
            if step == cfg.trainer.total_steps or (cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0):
                metrics["eval/accuracy"] = summary["accuracy_after"] = evaluate(cluster, heldout, reward, cfg)
            logger.log(step, metrics)
            if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
                save(cfg, cluster, step, sampler, rl_start)
        if cfg.checkpoint.save_every and cfg.trainer.total_steps % cfg.checkpoint.save_every:
            save(cfg, cluster, cfg.trainer.total_steps, sampler, rl_start)
        for group in cluster.trainers():
            group.call("finish_save")
        if cfg.checkpoint.export_hf and cfg.checkpoint.save_every:
            summary.update(export_and_evaluate(cfg, heldout, reward, out / "hf"))
    finally:
        if logger is not None:
            logger.close()
        cluster.close()
        reward.close()
    if cfg.logging.jsonl and (out / "metrics.jsonl").exists():
        keys = ("critic/score/mean", "eval/accuracy", "response_length/mean", "actor/entropy")
        summary["plot"] = str(plot_metrics(out / "metrics.jsonl", out / "curves.png", keys=keys))
    return summary


def rl_step(step: int, cfg: RunConfig, cluster: Cluster, train_set: list[dict], sampler: EpochSampler,
            reward) -> dict:
    """One RL step; returns its metrics."""
    metrics: dict[str, float] = {}
    with timer("step", metrics):
        prompts = [train_set[i] for i in sampler.next_batch()]
        with timer("gen", metrics):
            groups = cluster.generate([p["prompt_ids"] for p in prompts], sampling_for(cfg, step))
        cluster.release_engine()
        with timer("reward", metrics):
            scores = score(reward, prompts, groups, Path(cfg.trainer.output_dir) / "reward_errors.jsonl")
        batch = rollout_batch(groups, scores.tolist())
        metrics.update(rollout_metrics(batch, groups, scores))
        batch = shape_rewards(batch, scores, cfg, metrics)
        if batch is None:  # dynamic sampling left no group with a learning signal
            return metrics
        with timer("old_log_prob", metrics):
            old = cluster.actor.by_dp("logprobs", actor_inputs(batch))
            batch["old_logprobs"] = torch.cat([r["logprobs"] for r in old])
            if cfg.algo.kl_coef > 0:
                ref = cluster.actor.by_dp("logprobs", actor_inputs(batch), True)
                batch["ref_logprobs"] = torch.cat([r["logprobs"] for r in ref])
        metrics.update(drift_metrics(batch))
        if cluster.critic is not None:
            with timer("values", metrics):
                values = cluster.critic.by_dp("values", critic_inputs(batch))
                batch["values"] = torch.cat([r["values"] for r in values])
        batch["advantages"], batch["returns"] = advantages(batch, cfg)
        metrics.update(algo.advantage_metrics(batch))
        if cluster.critic is not None:
            with timer("update_critic", metrics):
                metrics.update(train_epochs(cluster.critic, "update_critic", cfg, critic_inputs(batch),
                                            cfg.critic.cliprange_value, cfg.algo.aggregation))
        with timer("update_actor", metrics):
            metrics.update(train_epochs(cluster.actor, "update", cfg, actor_inputs(batch), cfg.algo))
        metrics.update(cluster.sync_weights())
    tokens = float(batch["response_mask"].sum())
    metrics["perf/throughput"] = tokens / metrics["timing_s/step"]
    return metrics


def sampling_for(cfg: RunConfig, step: int) -> SamplingSettings:
    """The rollout's sampling settings; seeded per step, so a resumed run samples the same."""
    r = cfg.rollout
    return SamplingSettings(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_new_tokens,
                            n=r.n_samples_per_prompt, stop=tuple(r.stop), seed=r.seed * 1_000_003 + step)


def greedy_settings(cfg: RunConfig) -> SamplingSettings:
    return SamplingSettings(temperature=0.0, max_tokens=cfg.rollout.max_new_tokens, stop=tuple(cfg.rollout.stop))


def score(reward, prompts: list[dict], groups, error_log: Path | None = None) -> torch.Tensor:
    """Scores in sample order; failed reward calls (scored 0) are appended to `error_log`."""
    inputs = [RewardInput(p["prompt"], g.text, p["ground_truth"], p["metadata"])
              for p, group in zip(prompts, groups) for g in group]
    results = reward.score_batch(inputs)
    failed = [{"prompt": i.prompt, "response": i.response, "error": r.error} for i, r in zip(inputs, results) if r.error]
    if failed and error_log is not None:
        with open(error_log, "a") as log:
            log.writelines(json.dumps(row) + "\n" for row in failed)
    return torch.tensor([r.score for r in results], dtype=torch.float32)


def shape_rewards(batch: dict, scores: torch.Tensor, cfg: RunConfig, metrics: dict) -> dict | None:
    """DAPO's overlong penalty and dynamic sampling (drop groups whose samples all scored alike)."""
    a = cfg.algo
    if a.overlong.enable:
        lengths = batch["response_mask"].sum(-1)
        penalty = algo.overlong_penalty(lengths, cfg.rollout.max_new_tokens, a.overlong.buffer_length,
                                        a.overlong.penalty_factor)
        last = batch["token_level_rewards"] != 0
        scores = scores + penalty
        batch["token_level_rewards"] = torch.where(last, batch["token_level_rewards"] + penalty[:, None], 0.0)
    if a.dynamic_sampling:
        keep = algo.informative_groups(scores, batch["group_ids"])
        metrics["actor/kept_sample_fraction"] = float(keep.float().mean())
        keep = _whole_dp_slices(keep, data_parallel_size(cfg))
        if not keep.any():
            return None
        batch = select_rows(batch, keep)
    return batch


def _whole_dp_slices(keep: torch.Tensor, dp: int) -> torch.Tensor:
    """Drop the last kept rows until the kept count splits evenly over the DP ranks."""
    extra = int(keep.sum()) % dp
    if extra:
        kept = keep.nonzero().flatten()
        keep = keep.clone()
        keep[kept[-extra:]] = False
    return keep


def train_epochs(group, method: str, cfg: RunConfig, *args) -> dict[str, float]:
    """trainer.ppo_epochs optimizer steps of `method` on the same batch; metrics averaged over
    ranks, then over epochs."""
    epochs = [mean_over_ranks(group.by_dp(method, *args)) for _ in range(cfg.trainer.ppo_epochs)]
    return {k: sum(e[k] for e in epochs) / len(epochs) for k in epochs[0]}


def advantages(batch: dict, cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, L] by algo.advantage_estimator; GAE reads the critic's batch["values"]."""
    a, mask = cfg.algo, batch["response_mask"]
    rewards = batch["token_level_rewards"]
    if a.kl_coef > 0 and a.kl_in_reward:
        kl = algo.KL_ESTIMATORS.get(a.kl_estimator)(batch["old_logprobs"], batch["ref_logprobs"])
        rewards = algo.kl_penalized_rewards(rewards.sum(-1), mask, kl, a.kl_coef)
    return algo.compute_advantages(a.advantage_estimator, token_level_rewards=rewards, response_mask=mask,
                                   group_ids=batch["group_ids"], values=batch.get("values"),
                                   norm_by_std=a.norm_adv_by_std, gamma=a.gamma, lam=a.lam)


def rollout_metrics(batch: dict, groups, scores: torch.Tensor) -> dict[str, float]:
    lengths = batch["response_mask"].sum(-1)
    finish = [g.finish_reason for group in groups for g in group]
    return {"critic/score/mean": float(scores.mean()), "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()), "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": sum(f == "length" for f in finish) / len(finish)}


def drift_metrics(batch: dict) -> dict[str, float]:
    """How far the engine's sampling log-probs are from the trainer's: the drift users never see."""
    mask = batch["response_mask"].bool()
    diff = (batch["rollout_logprobs"] - batch["old_logprobs"])[mask].abs()
    return {"rollout/train_logprob_abs_diff_mean": float(diff.mean()),
            "rollout/train_logprob_abs_diff_max": float(diff.max())}


def mean_over_ranks(results: list[dict]) -> dict[str, float]:
    keys = [k for k in results[0] if k != "dp"]
    return {k: sum(float(r[k]) for r in results) / len(results) for k in keys}


def evaluate(cluster: Cluster, heldout: list[dict], reward, cfg: RunConfig) -> float | None:
    """Greedy accuracy on the held-out split (a score >= 1 counts as correct)."""
    if not heldout:
        return None
    groups = cluster.generate([p["prompt_ids"] for p in heldout], greedy_settings(cfg))
    return float((score(reward, heldout, groups) >= 1.0).float().mean())


def export_and_evaluate(cfg: RunConfig, heldout: list[dict], reward, out: Path) -> dict:
    """Merge the final checkpoint into a HuggingFace directory and score it with a fresh vLLM engine:
    the model a user takes away must be the one that was trained."""
    from checkpoints_tools.merge import merge

    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[cfg.model.dtype]
    merge(cfg.checkpoint.dir, out, dtype=dtype, force=True, progress=False)
    if not heldout:
        return {"hf_model": str(out)}
    groups = generate_once(cfg, str(out), [p["prompt_ids"] for p in heldout], greedy_settings(cfg))
    return {"hf_model": str(out), "accuracy_merged_hf": float((score(reward, heldout, groups) >= 1.0).float().mean())}


def save(cfg: RunConfig, cluster: Cluster, step: int, sampler: EpochSampler, rl_start: str | None) -> None:
    """The actor under checkpoint.dir, the critic (PPO) under checkpoint.dir/critic; each records
    the policy checkpoint RL started from (None: the HF model), for the reference on resume."""
    c = cfg.checkpoint
    data = {"sampler": sampler.state_dict(), "rl_step": step, "rl_start": portable_rl_start(rl_start, c.dir)}
    for group, root in zip(cluster.trainers(), (c.dir, critic_checkpoint(c.dir))):
        group.call("save", str(root), step, data, config_to_dict(cfg), c.keep_last, c.async_save)


def portable_rl_start(rl_start: str | None, checkpoint_dir: str) -> str | None:
    """`rl_start` as a checkpoint records it: the SFT iteration directory (not a root, whose
    `latest` could move), relative to the run's checkpoint root when inside it, so the checkpoint
    tree can be moved or copied whole; absolute otherwise."""
    from mrl.checkpoint_dir import resolve

    if rl_start is None:
        return None
    iteration = resolve(rl_start).resolve()
    root = Path(checkpoint_dir).resolve()
    return str(iteration.relative_to(root)) if iteration.is_relative_to(root) else str(iteration)


def located_rl_start(recorded: str | None, checkpoint_path: str) -> str | None:
    """The SFT checkpoint a resumed checkpoint's `rl_start` names, found from where that checkpoint
    is now (a relative one is under the checkpoint's root)."""
    from mrl.checkpoint_dir import resolve

    if recorded is None or Path(recorded).is_absolute():
        return recorded
    return str(resolve(checkpoint_path).parent / recorded)


def critic_checkpoint(actor_path: str) -> Path:
    """Where the critic's checkpoint sits beside the actor's: a root's critic/ sub-root, or the
    same iteration under it (root/iter_N → root/critic/iter_N)."""
    path = Path(actor_path)
    return path / "critic" if not path.name.startswith("iter_") else path.parent / "critic" / path.name


def starts_fresh(cfg: RunConfig) -> bool:
    """No checkpoint to resume: checkpoint.resume is 'never', or 'auto' over an empty checkpoint.dir."""
    from mrl.checkpoint_dir import read_latest

    mode = cfg.checkpoint.resume
    return mode == "never" or (mode == "auto" and read_latest(cfg.checkpoint.dir) is None)


def refuse_to_overwrite(cfg: RunConfig) -> None:
    """A fresh run (resume: never) must not meet an earlier run's checkpoints, nor a fresh run's SFT
    an earlier SFT checkpoint: it would fail at its save, after the work, or mix two runs in one `latest`."""
    from mrl.checkpoint_dir import list_iterations

    if cfg.checkpoint.resume == "never" and list_iterations(cfg.checkpoint.dir):
        raise FileExistsError(
            f"checkpoint.dir {cfg.checkpoint.dir} already holds checkpoints and checkpoint.resume is 'never': "
            "resume them (checkpoint.resume=auto), or choose another checkpoint.dir, or remove it"
        )
    if starts_fresh(cfg) and cfg.trainer.sft_steps:
        refuse_to_overwrite_sft(cfg)


def resume(cfg: RunConfig, cluster: Cluster, sampler: EpochSampler) -> tuple[int, str | None]:
    """Load the checkpoint `checkpoint.resume` points at. Returns the RL step it ended (0: fresh) and
    the policy checkpoint RL started from (None: the HF model). An SFT checkpoint (RL step 0, from
    `mrl sft`) is where RL starts: the RL learning-rate schedule begins, Adam's moments stay."""
    if starts_fresh(cfg):
        return 0, None
    mode = cfg.checkpoint.resume
    path = cfg.checkpoint.dir if mode == "auto" else mode
    data = cluster.actor.call("load", path)[0]["data"]
    if data["rl_step"] == 0:
        cluster.actor.call("restart_lr_schedule", optim_settings(cfg))
        print(f"RL starts from the SFT checkpoint {path}", flush=True)
        return 0, path
    if cluster.critic is not None:
        cluster.critic.call("load", str(critic_checkpoint(path)))
    sampler.load_state_dict(data["sampler"])
    print(f"resumed from {path} at RL step {data['rl_step']}", flush=True)
    return int(data["rl_step"]), located_rl_start(data.get("rl_start"), path)


def start_from_policy(cfg: RunConfig, cluster: Cluster, path: str, fresh: bool) -> None:
    """RL starts from the policy checkpoint at `path` (an SFT result), not the HF model: the KL
    reference is that policy, and so is a fresh critic's transformer unless model.critic_path names one."""
    cluster.actor.call("load_policy", path, True)
    if fresh and cluster.critic is not None and not cfg.model.critic_path:
        cluster.critic.call("load_policy", path)
