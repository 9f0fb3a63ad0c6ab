"""Supervised fine-tuning on the actor's workers: next-token loss on the answer tokens only.

An SFT step sees as many sequences as an RL step (data.batch_size × rollout.n_samples_per_prompt),
sampled from the train split's prompts with their ground-truth answers; the same optimizer and
checkpoints as RL, so `mrl train` with trainer.sft_steps > 0 warm-starts and then goes on to RL.
A demonstrated conversation (assistant turns and tool answers) trains on the assistant's tokens
only, laid out token for token as an agent's episode lays them out (mrl/agent/demonstrations.py).
"""

from __future__ import annotations

import time

from mrl.config import RunConfig
from mrl.config.derived import data_parallel_size, optim_for
from mrl.data import EpochSampler
from mrl.experience import packed_sft_batch, sft_batch
from mrl.metrics import MetricsLogger, timer
from mrl.run import Run, open_run
from mrl.stopping import StopRequest


def run_sft(run: Run) -> dict:
    """trainer.sft_steps optimizer steps; returns the first and last loss and the time taken."""
    cfg, actor = run.cfg, run.cluster.actor
    # one example a demonstration: a prompt with several (data.sft_key naming a list) is shown each in turn
    samples = [{"prompt_ids": s["prompt_ids"], "target_ids": t, "target_mask": m} for s in run.train_set
               for t, m in zip(s["sft_targets"], s.get("sft_masks") or [None] * len(s["sft_targets"]))]
    if not samples:
        raise ValueError("SFT needs answers: the train split has no ground truth (data.answer_key) or demonstration "
                         "(data.sft_key).")
    batch_size = min(len(samples), cfg.data.batch_size * cfg.rollout.n_samples_per_prompt)
    sampler = EpochSampler(len(samples), batch_size, seed=cfg.trainer.seed + 1)
    losses, start = [], time.perf_counter()
    actor.restart_lr_schedule(optim_for(cfg, "sft"))
    with MetricsLogger(run.out / "sft", cfg.trainer.sft_steps, jsonl=cfg.logging.jsonl,
                       tensorboard=cfg.logging.tensorboard, run_name=f"{cfg.trainer.name}-sft") as logger:
        for step in range(1, cfg.trainer.sft_steps + 1):
            metrics: dict[str, float] = {}
            with timer("step", metrics):
                chosen = [samples[i] for i in sampler.next_batch()]
                batch = sft_rows(cfg, chosen)
                results = actor.sft_step(batch)
            real = sum(len(s["prompt_ids"]) + len(s["target_ids"]) for s in chosen)
            metrics["sft/padding_fraction"] = 1 - real / batch["tokens"].numel()
            metrics.update({k: sum(float(r[k]) for r in results) / len(results) for k in results[0] if k != "dp"})
            losses.append(metrics.get("sft/loss"))
            logger.log(step, metrics)
    actor.restart_lr_schedule(optim_for(cfg))  # RL starts its own schedule
    return {"steps": cfg.trainer.sft_steps, "loss_first": losses[0], "loss_last": losses[-1],
            "seconds": round(time.perf_counter() - start, 1)}


def sft_rows(cfg: RunConfig, chosen: list[dict]) -> dict:
    """The batch of `chosen` samples: one sequence per row, or packed rows (trainer.sft_pack_tokens)."""
    prompts, targets = [s["prompt_ids"] for s in chosen], [s["target_ids"] for s in chosen]
    masks = [s.get("target_mask") for s in chosen]
    masks = masks if any(m is not None for m in masks) else None
    if cfg.trainer.sft_pack_tokens:
        return packed_sft_batch(prompts, targets, cfg.trainer.sft_pack_tokens, data_parallel_size(cfg), masks)
    return sft_batch(prompts, targets, masks)


def sft_only(cfg: RunConfig) -> dict:
    """`mrl sft`: SFT on the actor's workers (no rollout engine), then a checkpoint in
    CHECKPOINT_DIR/sft that `mrl train ... checkpoint.resume=CHECKPOINT_DIR/sft trainer.sft_steps=0`
    starts RL from. SIGTERM or Ctrl-C stops it at once, every process closed (mrl/stopping.py)."""
    with StopRequest():
        run = open_run(cfg, sft_only=True)
        try:
            summary = run_sft(run)
            run.save_sft()
            summary["checkpoint"] = run.rl_start
        finally:
            run.close()
    return summary
