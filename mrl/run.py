"""Run state, apart from the loop: what a run opens before its first step (model, data, reward,
workers), where it starts from (a fresh model, an SFT checkpoint, or a resumed RL step) and what it
writes at each checkpoint, so that a resume reproduces the run.

`open_run(cfg)` does the set-up that `mrl train` and `mrl sft` share; the trainer and SFT loops
(mrl/trainer.py, mrl/sft.py) take the Run it returns. What a checkpoint records is at `Run.save`,
where RL starts from at `resume` and `start_from_policy`; the directory layout (the actor under
checkpoint.dir, a PPO critic under checkpoint.dir/critic, the SFT result under checkpoint.dir/sft)
and the Megatron-LM checkpoints `checkpoint.resume` also accepts: docs/checkpoint-format.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mrl.checkpoint_dir import (CheckpointDirError, list_iterations, locate, read_latest, read_manifest, resolve,
                                verify_checksums)
from mrl.config import ConfigError, RunConfig, config_to_dict, save_config
from mrl.config.derived import optim_for
from mrl.data import EpochSampler, load_splits
from mrl.inputs import prepare_model, tokenize_samples
from mrl.launch.cluster import Cluster, start_cluster
from mrl.models.registry import model_spec_from_hf
from mrl.rewards import RewardErrorWatch, build_reward
from mrl.rewards.ahead import ScoresAhead
from mrl.run_owner import claim, identity, ownership_problem

if TYPE_CHECKING:
    from mrl.modes import GeneratedBatch
    from mrl.routes import RouteShape


@dataclass
class Run:
    """An open run: its data, reward, workers, and where RL starts."""

    cfg: RunConfig
    tokenizer: object
    train_set: list[dict]
    heldout: list[dict]
    sampler: EpochSampler
    reward: ScoresAhead | None  # None for SFT only
    cluster: Cluster
    start: int = 0  # the RL step resumed from (0: none)
    rl_start: str | None = None  # the policy checkpoint RL starts from (None: the HF model)
    in_flight: dict | list | None = None  # a resumed checkpoint's generated, untrained batches (GeneratedBatch states)
    reward_watch: RewardErrorWatch | None = None  # RL: counts failed reward calls, stops a run whose every call fails
    route_shape: RouteShape | None = None  # a MoE model's routes per token (mrl.routes); None: dense

    @property
    def out(self) -> Path:
        return Path(self.cfg.trainer.output_dir)

    @property
    def fresh(self) -> bool:
        """Nothing trained yet: no RL step, no SFT checkpoint."""
        return self.start == 0 and self.rl_start is None

    def save(self, step: int, in_flight: list[GeneratedBatch] = ()) -> None:
        """Checkpoint RL step `step`: the actor, and a PPO critic beside it (checkpoint.dir/critic, at the
        same steps). Each records the sampler, the RL step, `rl_start` (the policy checkpoint RL
        started from; None: the HF model, see start_from_policy) and `in_flight`: batches
        generated for steps step + 1, step + 2, … and not trained yet (one_step_off, fully_async):
        their samples came from weights a resume cannot recreate, so they are saved with the
        sampler that already counted their prompts, in the same atomic directory."""
        c = self.cfg.checkpoint
        data = {"sampler": self.sampler.state_dict(), "rl_step": step,
                "rl_start": portable_rl_start(self.rl_start, c.dir)}
        if in_flight:
            data["in_flight"] = [batch.to_state() for batch in in_flight]
        with self.cluster.trainers_on_device():  # trainer.offload_actor_during_rollout: the state is in host memory
            for group, root in zip(self.cluster.trainers(), (c.dir, critic_checkpoint(c.dir))):
                group.save(str(root), step, data, config_to_dict(self.cfg), c.keep_last, c.async_save)

    def save_sft(self) -> None:
        """The SFT result as a checkpoint (RL step 0) under checkpoint.dir/sft: RL starts from it."""
        root = sft_checkpoint_root(self.cfg)
        self.cluster.actor.save(str(root), self.cfg.trainer.sft_steps, {"rl_step": 0}, config_to_dict(self.cfg), 1,
                                False)
        self.rl_start = str(root)

    def start_from_policy(self) -> None:
        """RL starts from the policy checkpoint `rl_start` (an SFT result), not the HF model: the KL
        reference is that policy, and so is a fresh critic's transformer unless model.critic_path names one.
        Also after a resume, as every RL checkpoint records `rl_start`."""
        if self.rl_start is None:
            return
        self.cluster.actor.load_policy(self.rl_start, True)
        if self.start == 0 and self.cluster.critic is not None and not self.cfg.model.critic_path:
            self.cluster.critic.load_policy(self.rl_start)

    def close(self) -> None:
        try:
            self.cluster.close()
        finally:
            if self.reward is not None:
                self.reward.close()


def open_run(cfg: RunConfig, sft_only: bool = False) -> Run:
    """Everything before the first step: refuse to overwrite an earlier run or to use another's
    checkpoints, check the checkpoint to resume, prepare the model and the data, start the workers
    (no engine for `sft_only`) and, for RL, load what to resume from."""
    ours = identity(config_to_dict(cfg))
    check_owner(cfg, ours)
    if sft_only:
        refuse_to_overwrite_sft(cfg)
    else:
        refuse_to_overwrite(cfg)
        check_resume_files(cfg)
    hf_dir, tokenizer = prepare_model(cfg.model, cfg.trainer.seed)
    if not sft_only:
        check_start_checkpoint(cfg, hf_dir)
    claim(cfg.checkpoint.dir, ours)  # every check passed: this run's checkpoints go there
    train_set, heldout = (tokenize_samples(s, tokenizer) for s in load_splits(cfg.data, cfg.trainer.seed, tokenizer))
    sampler = EpochSampler(len(train_set), cfg.data.batch_size, seed=cfg.trainer.seed)
    save_config(cfg)  # also creates the output directory
    reward = None if sft_only else ScoresAhead(build_reward(cfg.reward))  # async.score_ahead: the next batch's, early
    try:
        cluster = start_cluster(cfg, hf_dir, len(tokenizer), with_engine=not sft_only)
    except BaseException:
        if reward is not None:
            reward.close()
        raise
    run = Run(cfg, tokenizer, train_set, heldout, sampler, reward, cluster,
              route_shape=model_spec_from_hf(hf_dir).route_shape)
    if not sft_only:
        run.reward_watch = RewardErrorWatch(cfg.reward.max_failing_steps, run.out / "reward_errors.jsonl")
        try:
            run.start, run.rl_start = resume(run)
        except BaseException:
            run.close()
            raise
    return run


def resume(run: Run) -> tuple[int, str | None]:
    """Load the checkpoint `checkpoint.resume` points at. Returns the RL step it ended (0: fresh) and
    the policy checkpoint RL started from (None: the HF model). An SFT checkpoint (RL step 0, from
    `mrl sft`) is where RL starts: the RL learning-rate schedule begins, Adam's moments stay."""
    cfg, cluster = run.cfg, run.cluster
    if starts_fresh(cfg):
        return 0, None
    mode = cfg.checkpoint.resume
    path = cfg.checkpoint.dir if mode == "auto" else mode
    located = locate(path)
    if located.megatron_lm is not None:
        # A checkpoint of Megatron-LM's training loop (a pretraining or SFT run of Megatron-LM, slime
        # or verl's Megatron backend; torch_dist, checked by check_start_checkpoint): RL starts from
        # its weights, as from an SFT checkpoint, with a fresh optimizer (its Adam state belongs to
        # another optimizer set-up, learning rate and data; mrl does not carry it over). model.path
        # still gives the config, the tokenizer and the engine's initial weights, which the first
        # sync replaces.
        cluster.actor.load_policy(str(located.directory))
        print(f"RL starts from the weights of the Megatron-LM checkpoint {located.directory} (fresh optimizer)",
              flush=True)
        return 0, str(located.directory)
    data = cluster.actor.load(path)["data"]
    if data["rl_step"] == 0:
        cluster.actor.restart_lr_schedule(optim_for(cfg))
        print(f"RL starts from the SFT checkpoint {path}", flush=True)
        return 0, path
    if cluster.critic is not None:
        cluster.critic.load(str(critic_checkpoint(path)))
    run.sampler.load_state_dict(data["sampler"])
    run.in_flight = data.get("in_flight")
    print(f"resumed from {path} at RL step {data['rl_step']}", flush=True)
    return int(data["rl_step"]), located_rl_start(data.get("rl_start"), path)


def check_start_checkpoint(cfg: RunConfig, hf_dir: str) -> None:
    """A Megatron-LM checkpoint RL is to start from, checked against the HF config from metadata
    alone (architecture, every tensor's shape, the run's args): a mismatch is one error naming the
    tensor or setting, before any worker starts. mrl's own checkpoints are checked as they load."""
    mode = cfg.checkpoint.resume
    if mode in ("auto", "never") or (megatron_lm := locate(mode).megatron_lm) is None:
        return
    from checkpoints_tools.errors import CheckpointError
    from checkpoints_tools.merge import open_checkpoint, plan

    if megatron_lm.format != "torch_dist":
        raise ConfigError([f"checkpoint.resume {mode} is a legacy (torch format) Megatron-LM checkpoint, which only "
                           f"mrl-merge reads: merge it (mrl-merge {mode} --hf-config {hf_dir} --out DIR) and start "
                           "from the HF directory (model.path=DIR)."])
    try:
        plan(open_checkpoint(mode, hf_dir))
    except CheckpointError as err:
        raise ConfigError([f"checkpoint.resume: {err}"]) from None


def portable_rl_start(rl_start: str | None, checkpoint_dir: str) -> str | None:
    """`rl_start` as a checkpoint records it: the iteration directory of the SFT (or Megatron-LM)
    checkpoint RL started from (not a root, whose pointer could move), relative to the run's
    checkpoint root when inside it, so the checkpoint tree can be moved or copied whole; absolute
    otherwise."""
    if rl_start is None:
        return None
    iteration = locate(rl_start).directory.resolve()
    root = Path(checkpoint_dir).resolve()
    return str(iteration.relative_to(root)) if iteration.is_relative_to(root) else str(iteration)


def located_rl_start(recorded: str | None, checkpoint_path: str) -> str | None:
    """The SFT checkpoint a resumed checkpoint's `rl_start` names, found from where that checkpoint
    is now (a relative one is under the checkpoint's root)."""
    if recorded is None or Path(recorded).is_absolute():
        return recorded
    return str(resolve(checkpoint_path).parent / recorded)


def critic_checkpoint(actor_path: str) -> Path:
    """Where the critic's checkpoint sits beside the actor's: a root's critic/ sub-root, or the
    same iteration under it (root/iter_N → root/critic/iter_N)."""
    path = Path(actor_path)
    return path / "critic" if not path.name.startswith("iter_") else path.parent / "critic" / path.name


def sft_checkpoint_root(cfg: RunConfig) -> Path:
    return Path(cfg.checkpoint.dir) / "sft"


def starts_fresh(cfg: RunConfig) -> bool:
    """No checkpoint to resume: checkpoint.resume is 'never', or 'auto' over an empty checkpoint.dir."""
    mode = cfg.checkpoint.resume
    return mode == "never" or (mode == "auto" and read_latest(cfg.checkpoint.dir) is None)


def check_owner(cfg: RunConfig, ours: dict) -> None:
    """checkpoint.dir must be this run's (mrl/run_owner.py) or hold no checkpoint. Raises
    ConfigError naming both runs and the fix."""
    problem = ownership_problem(cfg.checkpoint.dir, ours)
    if problem:
        raise ConfigError([problem])


def check_resume_files(cfg: RunConfig) -> None:
    """The mrl checkpoint a run resumes (and its critic's) whole: every file's checksum checked
    against its manifest before a worker starts, the damaged file named."""
    if starts_fresh(cfg):
        return
    path = cfg.checkpoint.dir if cfg.checkpoint.resume == "auto" else cfg.checkpoint.resume
    try:
        located = locate(path)
        if located.megatron_lm is not None:
            return  # Megatron-LM writes no checksums; its metadata is checked by check_start_checkpoint
        critic = critic_checkpoint(str(located.directory))
        for directory in [located.directory] + ([critic] if critic.is_dir() else []):
            note = verify_checksums(directory, read_manifest(directory))
            if note:
                print(note, flush=True)
    except CheckpointDirError as err:
        raise ConfigError([f"checkpoint.resume: {err}"]) from None


def refuse_to_overwrite(cfg: RunConfig) -> None:
    """A fresh run (resume: never), or one starting from another checkpoint, must not meet this run's
    checkpoints, nor a fresh run's SFT an earlier SFT checkpoint: it would fail at its save, after
    the work, or mix two starts in one `latest`."""
    mode, root = cfg.checkpoint.resume, cfg.checkpoint.dir
    if mode == "never" and list_iterations(root):
        raise ConfigError([f"checkpoint.dir {root} already holds checkpoints and checkpoint.resume is 'never': resume "
                           "them (checkpoint.resume=auto), or choose another trainer.output_dir, or remove them"])
    if mode not in ("auto", "never") and list_iterations(root) and \
            not Path(mode).resolve().is_relative_to(Path(root).resolve()):
        raise ConfigError([f"checkpoint.dir {root} already holds this run's checkpoints, and checkpoint.resume names "
                           f"another ({mode}): continue this run (checkpoint.resume=auto), or start from {mode} in a "
                           "new run (another trainer.output_dir)"])
    if starts_fresh(cfg) and cfg.trainer.sft_steps:
        refuse_to_overwrite_sft(cfg)


def refuse_to_overwrite_sft(cfg: RunConfig) -> None:
    """An SFT that would save where an earlier SFT checkpoint lies stops before the work, not after."""
    root = sft_checkpoint_root(cfg)
    if list_iterations(root):
        raise ConfigError([
            f"{root} already holds an SFT checkpoint: start RL from it (checkpoint.resume={root} "
            "trainer.sft_steps=0), or choose another trainer.output_dir, or remove it"])
