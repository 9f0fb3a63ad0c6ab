"""The RL loop, top to bottom: generate → reward → advantages → old/ref log-probs → update → sync.

A step is `collect` (rewards on the driver) then `learn` (log-probs, advantages, updates);
trainer.mode's batch source (mrl/modes/) decides where its generations come from and when the
weights go out: in sync mode right before and right after, in one_step_off and fully_async
overlapped with learning.

The driver process holds the data, the reward functions and the algorithm's batch-level math; the
Megatron ranks (mrl/workers/actor.py) and the vLLM engine run in Ray actors (mrl/launch), reached
through typed proxies. Set-up, resume and checkpoints are the run's state (mrl/run.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mrl import algo, evaluation
from mrl.agent.runner import episode_metrics
from mrl.atomic import atomic_write
from mrl.checkpoint_dir import iter_name
from mrl.config import RunConfig, config_to_dict
from mrl.config.schema import AlgoConfig
from mrl.config.derived import agent_rows, data_parallel_size, epochs_of, mini_batches, returns_routes
from mrl.experience import actor_inputs, critic_inputs, rollout_batch, select_rows, split_rows
from mrl.launch.cluster import one_off_engine
from mrl.launch.proxies import EngineHandle
from mrl.metrics import MetricsLogger, plot_metrics, timer
from mrl.modes import BatchSource, Engines, GeneratedBatch, Prompts, make_source, overlap_metrics
from mrl.profiling import profiled_step
from mrl.rewards import RewardInput, RewardResult
from mrl.rewards.ahead import ScoresAhead
from mrl.rollout.engine import SamplingSettings, route_bytes_per_token
from mrl.rollout_trace import trace_rollouts
from mrl.run import Run, open_run
from mrl.stopping import StopRequest
from mrl.sft import run_sft


def train(cfg: RunConfig) -> dict:
    """Run SFT warm start (if asked), then RL; returns held-out accuracies and where things went
    (also saved as OUTPUT_DIR/summary.json). SIGTERM or Ctrl-C during RL ends the run after the step
    in progress, with a checkpoint (summary["stopped"]; mrl/stopping.py)."""
    with StopRequest() as stop:
        return _train(cfg, stop)


def _train(cfg: RunConfig, stop: StopRequest) -> dict:
    started = time.perf_counter()
    run = open_run(cfg)
    logger = source = None
    try:
        summary = {"resumed_from": run.start, "output_dir": str(run.out)}
        if run.fresh and cfg.trainer.sft_steps:
            # the engine holds the HF weights: how the model starts (greedy is enough here)
            summary["accuracy_initial"] = evaluate(run, sampled=False)["eval/accuracy"]
            summary["sft"] = run_sft(run)
            run.save_sft()
        run.start_from_policy()
        logger = MetricsLogger(run.out, cfg.trainer.total_steps, jsonl=cfg.logging.jsonl,
                               tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                               wandb_project=cfg.logging.wandb_project, run_name=cfg.trainer.name,
                               config=config_to_dict(cfg), resume_step=run.start,
                               prometheus_port=cfg.logging.prometheus_port)
        # The engine starts from the HF weights; SFT or a resume changed them. This first sync is
        # always parity-checked.
        first = run.cluster.sync_weights() | evaluate(run)
        summary |= accuracies(first, "before") | accuracies(first, "after")
        if run.start == 0:
            logger.log(0, first)
        source = batch_source(run)  # trainer.mode: where batches come from, when weights go out
        stop.boundary = True  # from here a signal ends the run at a step boundary, with a checkpoint
        for step in range(run.start + 1, cfg.trainer.total_steps + 1):
            with profiled_step(run, step):  # profile.steps: torch.profiler traces (mrl/profiling.py)
                metrics = rl_step(step, run, source)
            if step == cfg.trainer.total_steps or (cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0):
                metrics |= evaluate(run)
                summary |= accuracies(metrics, "after")
            logger.log(step, metrics)
            if step == cfg.trainer.total_steps or stop.signum or saves_at(cfg, step):  # the last step, always
                run.save(step, source.in_flight())
            if stop.signum:
                summary["stopped"] = {"signal": stop.name, "step": step,
                                      "checkpoint": str(Path(cfg.checkpoint.dir) / iter_name(step))}
                break
        for group in run.cluster.trainers():
            group.finish_save()
        stop.boundary = False
        if cfg.checkpoint.export_hf and not stop.signum:
            summary.update(export_and_evaluate(run, run.out / "hf"))
    finally:  # also on a failure or Ctrl-C: abandon the generations in flight, then stop every process
        if source is not None:
            source.close()
        if logger is not None:
            logger.close()
        run.close()
    if cfg.logging.jsonl and (run.out / "metrics.jsonl").exists():
        keys = ["critic/score/mean", "eval/accuracy", "response_length/mean", "actor/entropy"]
        if cfg.trainer.eval_samples:
            keys.insert(2, "eval/accuracy_sampled")
        summary["plot"] = str(plot_metrics(run.out / "metrics.jsonl", run.out / "curves.png", keys=keys))
    summary["seconds"] = round(time.perf_counter() - started, 1)
    atomic_write(run.out / "summary.json", lambda f: f.write((json.dumps(summary, indent=2) + "\n").encode()))
    return summary


def saves_at(cfg: RunConfig, step: int) -> bool:
    """checkpoint.save_every's steps (the last one and a stop are saved whatever it says)."""
    return bool(cfg.checkpoint.save_every) and step % cfg.checkpoint.save_every == 0


def rl_step(step: int, run: Run, source: BatchSource) -> dict:
    """One RL step; returns its metrics. The mode's batch source says where the batch comes from
    and when the weights go out (mrl/modes/); the step is computed the same in every mode."""
    metrics = {}
    with timer("step", metrics):
        generated = source.next(step, metrics)
        rollout = collect(run, generated, metrics)
        if run.cfg.async_.score_ahead:  # fully_async: the next batch's rewards while this step learns
            score_ahead(run, source.upcoming(step + 1))
        if rollout.batch is not None:  # None: dynamic sampling left no group with a learning signal
            learn(step, run, rollout, metrics)
        source.after_update(step, rollout.batch is not None, metrics)
    metrics.update(overlap_metrics(step, generated, metrics, source.engine_seconds))
    if rollout.batch is not None:
        metrics["perf/throughput"] = float(rollout.batch["response_mask"].sum()) / metrics["timing_s/step"]
    return metrics


@dataclass
class Rollout:
    """A step's samples on the driver, scored: what `learn` trains on (`batch` None: nothing)."""

    generated: GeneratedBatch
    prompts: list[dict]
    rewards: list[RewardResult]
    batch: dict | None


def collect(run: Run, generated: GeneratedBatch, metrics: dict) -> Rollout:
    """Score the generations and shape the rewards (on the driver)."""
    cfg, groups = run.cfg, generated.groups
    prompts = [run.train_set[i] for i in generated.prompt_indices]
    metrics.update(generated.engine_metrics)  # rollout/engine{i}/...: each engine's throughput
    samples = [g for gs in groups for g in gs]
    if generated.gen_seconds > 0:  # the policy's tokens (an episode's appended tool tokens are not generated)
        generated_tokens = sum(len(g.token_ids) if g.loss_mask is None else sum(g.loss_mask) for g in samples)
        metrics["perf/gen_tokens_per_s"] = generated_tokens / generated.gen_seconds
    metrics.update(episode_metrics(samples))  # agent/*: samples that are episodes
    route_bytes = route_bytes_per_token(samples)  # None: samples carry no routes
    if route_bytes is not None:
        metrics["rollout/route_bytes_per_token"] = route_bytes
    with timer("reward", metrics):  # the wait: nothing when the batch was scored ahead
        rewards, ahead = reward_results(run.reward, prompts, groups, run.out / "reward_errors.jsonl",
                                        ahead_key=generated.step)
    metrics["reward/scored_ahead"] = float(ahead)
    metrics.update(run.reward_watch.observe(rewards))  # reward/errors; N steps of nothing but failures stop the run
    rewards = [r if (g.agent or {}).get("reward") is None else RewardResult(g.agent["reward"], {"from": "environment"})
               for r, g in zip(rewards, samples)]  # an environment's episode brings its own reward
    scores = torch.tensor([r.score for r in rewards], dtype=torch.float32)
    batch = rollout_batch(groups, scores.tolist(), route_shape=run.route_shape if returns_routes(cfg) else None,
                          turn_rewards=cfg.agent.turn_rewards)
    metrics.update(rollout_metrics(batch, groups, scores))
    return Rollout(generated, prompts, rewards, shape_rewards(batch, scores, cfg, metrics))


def learn(step: int, run: Run, rollout: Rollout, metrics: dict) -> None:
    """Old/reference log-probs, values, advantages, then the critic's and the actor's updates."""
    cfg, cluster, batch = run.cfg, run.cluster, rollout.batch
    with timer("old_log_prob", metrics):
        old = cluster.actor.logprobs(actor_inputs(batch))
        batch["old_logprobs"] = old.logprobs
        batch.update(old.replay)  # algo.router_replay R2: the routes of this pass, replayed in the updates
        if cfg.algo.kl_coef > 0:
            batch["ref_logprobs"] = cluster.actor.logprobs(actor_inputs(batch), reference=True).logprobs
    metrics.update(drift_metrics(batch))
    metrics.update(old.routing)  # MoE samples with the engine's routes: rollout/routing_agreement, …
    metrics.update(correction_metrics(batch, cfg.algo))
    if cluster.critic is not None:
        with timer("values", metrics):
            batch["values"] = cluster.critic.values(critic_inputs(batch))
    batch["advantages"], batch["returns"] = advantages(batch, cfg)
    metrics.update(algo.advantage_metrics(batch))
    # every logging.trace_every steps
    trace_rollouts(run, step, rollout.prompts, rollout.generated.groups, rollout.rewards, batch,
                   policy_steps=rollout.generated.policy_steps())
    if cluster.critic is not None:
        with timer("update_critic", metrics):
            critic = cluster.critic
            metrics.update(train_epochs(cfg, epochs_of(cfg, "critic"), critic_inputs(batch),
                                        lambda part: critic.update_critic(part, cfg.critic.cliprange_value,
                                                                          cfg.algo.aggregation)))
    with timer("update_actor", metrics):
        inputs = actor_inputs(batch, algo.uses_rollout_logprobs(cfg.algo.rollout_correction, cfg.algo.policy_loss))
        metrics.update(train_epochs(cfg, epochs_of(cfg, "actor"), inputs,
                                    lambda part: cluster.actor.update(part, cfg.algo)))


def batch_source(run: Run) -> BatchSource:
    """trainer.mode's batch source over this run's sampler, engines and weight sync; batches a
    checkpoint saved in flight are trained first."""
    cfg, cluster = run.cfg, run.cluster
    engines = Engines(generate=cluster.generate_async, push=cluster.sync_weights, release=cluster.release_engines,
                      interrupt=cluster.interrupt_engines,
                      generate_timeout_s=cfg.sync.timeout_s * EngineHandle.GENERATE_TIMEOUT_FACTOR)
    rows = agent_rows(cfg)
    prompts = Prompts(next_batch=run.sampler.next_batch,
                      prompt=lambda i: evaluation.rollout_prompt(run.train_set[i], rows),
                      sampling=lambda step: sampling_for(cfg, step), start_step=run.start, tokenizer=run.tokenizer)
    return make_source(cfg, engines, prompts, GeneratedBatch.list_from_state(run.in_flight))


def sampling_for(cfg: RunConfig, step: int) -> SamplingSettings:
    """The rollout's sampling settings; seeded per step, so a resumed run samples the same (each
    prompt then gets a seed of its own from this one: seeded_per_prompt)."""
    return evaluation.rollout_settings(cfg.rollout, seed=cfg.rollout.seed * 1_000_003 + step)


def greedy_settings(cfg: RunConfig) -> SamplingSettings:
    return evaluation.greedy_settings(cfg.rollout)


def reward_inputs(prompts: list[dict], groups) -> list[RewardInput]:
    return [RewardInput(p["prompt"], g.text, p["ground_truth"], p["metadata"])
            for p, group in zip(prompts, groups) for g in group]


def reward_results(reward: ScoresAhead, prompts: list[dict], groups, error_log: Path | None = None,
                   ahead_key: int | None = None) -> tuple[list[RewardResult], bool]:
    """Scores with their details in sample order, and whether they were scored ahead (`ahead_key`:
    the step a batch was submitted for, see score_ahead); failed calls (scored 0) are appended to
    `error_log`."""
    inputs = reward_inputs(prompts, groups)
    results, ahead = reward.take(ahead_key, inputs) if ahead_key is not None else (reward.score_batch(inputs), False)
    failed = [{"prompt": i.prompt, "response": i.response, "error": r.error} for i, r in zip(inputs, results) if r.error]
    if failed and error_log is not None:
        with open(error_log, "a") as log:
            log.writelines(json.dumps(row) + "\n" for row in failed)
    return results, ahead


def score_ahead(run: Run, batch: GeneratedBatch | None) -> None:
    """Start scoring a later step's batch in the background (async.score_ahead; None: not generated yet)."""
    if batch is not None:
        run.reward.submit(batch.step, reward_inputs([run.train_set[i] for i in batch.prompt_indices], batch.groups))


def shape_rewards(batch: dict, scores: torch.Tensor, cfg: RunConfig, metrics: dict) -> dict | None:
    """DAPO's overlong penalty and dynamic sampling (drop groups whose samples all scored alike)."""
    a = cfg.algo
    if a.overlong.enable:
        batch["token_level_rewards"], penalty = algo.penalise_overlong(
            batch["token_level_rewards"], batch["response_mask"], cfg.rollout.max_new_tokens,
            a.overlong.buffer_length, a.overlong.penalty_factor)
        scores = scores + penalty
    if a.dynamic_sampling:  # the fraction trained: informative groups, cut to whole DP slices
        keep = _whole_dp_slices(algo.informative_groups(scores, batch["group_ids"]), data_parallel_size(cfg))
        metrics["actor/kept_sample_fraction"] = float(keep.float().mean())
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


def train_epochs(cfg: RunConfig, epochs: int, inputs: dict, update) -> dict[str, float]:
    """`epochs` passes over `inputs`, each one optimizer step `update(part)` per mini-batch
    (trainer.ppo_mini_batch_size, in batch order); each step's metrics averaged over DP slices,
    then over every step."""
    parts = split_rows(inputs, mini_batches(cfg), data_parallel_size(cfg))
    steps = [mean_over_ranks(update(part)) for _ in range(epochs) for part in parts]
    return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}


def advantages(batch: dict, cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, L] by algo.advantage_estimator; GAE reads the critic's batch["values"]."""
    a, mask = cfg.algo, batch["response_mask"]
    rewards = batch["token_level_rewards"]
    if a.kl_coef > 0 and a.kl_in_reward:
        kl = algo.KL_ESTIMATORS.get(a.kl_estimator)(batch["old_logprobs"], batch["ref_logprobs"])
        rewards = algo.kl_penalized_rewards(rewards, mask, kl, a.kl_coef)
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
    """How far the engine's sampling log-probs are from the trainer's: the drift users never see.
    rollout/train_kl estimates KL(engine ‖ trainer) from the engine's own samples with the k3
    estimator (r - 1 - log r, r = p_trainer / p_engine: unbiased, never negative, per token)."""
    mask = batch["response_mask"].bool()
    delta = (batch["old_logprobs"] - batch["rollout_logprobs"])[mask].double()
    return {"rollout/train_logprob_abs_diff_mean": float(delta.abs().mean()),
            "rollout/train_logprob_abs_diff_max": float(delta.abs().max()),
            "rollout/train_kl": float((delta.exp() - 1 - delta).mean())}


def correction_metrics(batch: dict, a: AlgoConfig) -> dict[str, float]:
    """rollout/is_* of the weights the update applies (algo.rollout_correction, or decoupled_ppo's
    behaviour weights), over the whole batch: exact global means whatever the DP split. The weights
    depend only on the trainer's and the engine's log-probs, so the workers compute the same ones."""
    old, engine, mask = batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"]
    if a.policy_loss in algo.BEHAVIOUR_LOSSES:
        correction = algo.behaviour_weights(old, engine, mask, a.behav_imp_weight_cap)
    elif a.rollout_correction != "none":
        correction = algo.rollout_correction(a.rollout_correction, old, engine, mask,
                                             **algo.correction_settings(a.rollout_correction, a))
    else:
        return {}
    return {f"rollout/{name}": float(value) for name, value in correction.metrics.items()}


def mean_over_ranks(results: list[dict]) -> dict[str, float]:
    keys = [k for k in results[0] if k != "dp"]
    return {k: sum(float(r[k]) for r in results) / len(results) for k in keys}


def evaluate(run: Run, sampled: bool = True) -> dict[str, float | None]:
    """Held-out accuracy (mrl/evaluation.py): greedy (`eval/accuracy`) and, with
    `trainer.eval_samples` N (and `sampled`), the mean over N samples a prompt drawn as the rollout
    draws them (`eval/accuracy_sampled`: the policy's own expected accuracy, what RL optimises;
    greedy decoding can stay put while it moves)."""
    if not run.heldout:
        return {"eval/accuracy": None}
    n = run.cfg.trainer.eval_samples if sampled else 0
    summary = evaluation.evaluate(lambda ids, sampling: run.cluster.generate(ids, sampling)[0],
                                  run.reward.score_batch, run.heldout, greedy_settings(run.cfg),
                                  replace(sampling_for(run.cfg, step=0), n=n) if n else None, agent_rows(run.cfg))
    metrics = {"eval/accuracy": summary["greedy"]["accuracy"]}
    if n:
        metrics["eval/accuracy_sampled"] = summary["sampled"]["pass@1"]
    for kind, episodes in summary.get("agent", {}).items():  # agent episodes: held-out tool-call success
        metrics["eval/tool_call_success" + ("_sampled" if kind == "sampled" else "")] = episodes["tool_call_success"]
    return metrics


def accuracies(metrics: dict, when: str) -> dict[str, float | None]:
    """An evaluation's accuracies for the run's summary: accuracy_<when> (greedy), accuracy_sampled_<when>."""
    out = {f"accuracy_{when}": metrics["eval/accuracy"]}
    if "eval/accuracy_sampled" in metrics:
        out[f"accuracy_sampled_{when}"] = metrics["eval/accuracy_sampled"]
    return out


def export_and_evaluate(run: Run, out: Path) -> dict:
    """Merge the final checkpoint into a HuggingFace directory and load it in a fresh vLLM engine:
    the model a user takes away must be the one that was trained. merged_hf_logprob_gap: the
    largest |log-prob| difference on the parity probe between that engine and the run's (which
    holds the last weights pushed); accuracy_merged_hf: its held-out accuracy."""
    from checkpoints_tools.merge import DTYPE_NAMES, merge
    from mrl.sync.parity import logprob_gap

    cfg = run.cfg
    merge(cfg.checkpoint.dir, out, dtype=DTYPE_NAMES[getattr(torch, cfg.model.dtype)], force=True, progress=False)
    probe = run.cluster.sync.probe
    pushed = run.cluster.engines.score(probe)
    run.cluster.stop_engines()  # the merged model's engine takes their place (their nodes, their GPUs)
    with one_off_engine(cfg, str(out), run.cluster.engine_parts) as engine:
        gap = logprob_gap(engine.score(probe), pushed)["rollout/logprob_abs_diff_max"]
        summary = {"hf_model": str(out), "merged_hf_logprob_gap": gap}
        if run.heldout:
            merged = evaluation.evaluate(engine.generate, run.reward.score_batch, run.heldout, greedy_settings(cfg))
            summary["accuracy_merged_hf"] = merged["greedy"]["accuracy"]
    return summary
