"""Supervised fine-tuning on the actor's workers: next-token loss on the answer tokens only.

An SFT step sees as many sequences as an RL step (data.batch_size × rollout.n_samples_per_prompt),
sampled from the train split's prompts with their ground-truth answers; the same optimizer and
checkpoints as RL, so `mrl train` with trainer.sft_steps > 0 warm-starts and then goes on to RL.
"""

from __future__ import annotations

import time
from pathlib import Path

from mrl.config import RunConfig
from mrl.data import EpochSampler
from mrl.experience import packed_sft_batch, sft_batch
from mrl.launch.cluster import Cluster, data_parallel_size, optim_settings
from mrl.metrics import MetricsLogger, timer


def run_sft(cfg: RunConfig, cluster: Cluster, train_set: list[dict], tokenizer) -> dict:
    """trainer.sft_steps optimizer steps; returns the first and last loss and the time taken."""
    samples = [s for s in train_set if "target_ids" in s]
    if not samples:
        raise ValueError("SFT needs answers: the train split has no ground truth (data.answer_key).")
    batch_size = min(len(samples), cfg.data.batch_size * cfg.rollout.n_samples_per_prompt)
    sampler = EpochSampler(len(samples), batch_size, seed=cfg.trainer.seed + 1)
    losses, start = [], time.perf_counter()
    cluster.actor.call("restart_lr_schedule", optim_settings(cfg, sft=True))
    with MetricsLogger(Path(cfg.trainer.output_dir) / "sft", cfg.trainer.sft_steps, jsonl=cfg.logging.jsonl,
                       tensorboard=cfg.logging.tensorboard, run_name=f"{cfg.trainer.name}-sft") as logger:
        for step in range(1, cfg.trainer.sft_steps + 1):
            metrics: dict[str, float] = {}
            with timer("step", metrics):
                chosen = [samples[i] for i in sampler.next_batch()]
                batch = sft_rows(cfg, chosen)
                results = cluster.actor.by_dp("sft_step", batch)
            real = sum(len(s["prompt_ids"]) + len(s["target_ids"]) for s in chosen)
            metrics["sft/padding_fraction"] = 1 - real / batch["tokens"].numel()
            metrics.update({k: sum(float(r[k]) for r in results) / len(results) for k in results[0] if k != "dp"})
            losses.append(metrics.get("sft/loss"))
            logger.log(step, metrics)
    cluster.actor.call("restart_lr_schedule", optim_settings(cfg))  # RL starts its own schedule
    return {"steps": cfg.trainer.sft_steps, "loss_first": losses[0], "loss_last": losses[-1],
            "seconds": round(time.perf_counter() - start, 1)}


def sft_rows(cfg: RunConfig, chosen: list[dict]) -> dict:
    """The batch of `chosen` samples: one sequence per row, or packed rows (trainer.sft_pack_tokens)."""
    prompts, targets = [s["prompt_ids"] for s in chosen], [s["target_ids"] for s in chosen]
    if cfg.trainer.sft_pack_tokens:
        return packed_sft_batch(prompts, targets, cfg.trainer.sft_pack_tokens, data_parallel_size(cfg))
    return sft_batch(prompts, targets)


def sft_only(cfg: RunConfig) -> dict:
    """`mrl sft`: SFT on the actor's workers (no rollout engine), then a checkpoint in
    CHECKPOINT_DIR/sft that `mrl train ... checkpoint.resume=CHECKPOINT_DIR/sft trainer.sft_steps=0`
    starts RL from."""
    from mrl.data import load_splits
    from mrl.inputs import prepare_model, tokenize_samples
    from mrl.launch.cluster import start_cluster

    refuse_to_overwrite_sft(cfg)
    hf_dir, tokenizer = prepare_model(cfg.model, cfg.trainer.seed)
    train_set = tokenize_samples(load_splits(cfg.data, cfg.trainer.seed, tokenizer)[0], tokenizer)
    cluster = start_cluster(cfg, hf_dir, len(tokenizer), with_engine=False)
    try:
        summary = run_sft(cfg, cluster, train_set, tokenizer)
        summary["checkpoint"] = save_sft_checkpoint(cfg, cluster)
    finally:
        cluster.close()
    return summary


def sft_checkpoint_root(cfg: RunConfig) -> Path:
    return Path(cfg.checkpoint.dir) / "sft"


def refuse_to_overwrite_sft(cfg: RunConfig) -> None:
    """An SFT that would save where an earlier SFT checkpoint lies stops before the work, not after."""
    from mrl.checkpoint_dir import list_iterations

    root = sft_checkpoint_root(cfg)
    if list_iterations(root):
        raise FileExistsError(
            f"{root} already holds an SFT checkpoint: start RL from it (checkpoint.resume={root} "
            "trainer.sft_steps=0), or choose another checkpoint.dir, or remove it"
        )


def save_sft_checkpoint(cfg: RunConfig, cluster: Cluster) -> str:
    """The SFT result as a checkpoint (RL step 0) under checkpoint.dir/sft: the policy RL starts
    from, which its reference copy and critic load, also after a resume."""
    from mrl.config import config_to_dict

    root = sft_checkpoint_root(cfg)
    cluster.actor.call("save", str(root), cfg.trainer.sft_steps, {"rl_step": 0}, config_to_dict(cfg), 1, False)
    return str(root)
