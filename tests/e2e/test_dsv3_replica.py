"""The DeepSeek-V3 recipe's launch path in miniature: configs/dsv3_replica_cpu.yaml launched through
scripts/train_dsv3.sh --address, as a user launches the 671B recipe, on a simulated two-node Ray
cluster (ray.cluster_utils.Cluster, 2 nodes × 3 CPUs on this machine). Megatron TP2 × PP2 × EP2: a
TP group on each node, the pipeline across them; one vLLM engine of TP2 spanning both nodes (a
worker on each), synced over the routed transport every step with the parity gate after each push.

The cluster runs in a child process (this file run as a script) under a private RAY_TMPDIR, so a
test session's own Ray stays connected and no other cluster's address file is touched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_replica_runs_through_the_launch_script_with_a_sync_each_step():
    """2 steps: placement (TP groups within nodes, the pipeline across them, the engine on both) and
    the parity gate after every push. (The HF export at the end: the matrix case below.)"""
    report = _replica(2, kill_at_step=None, timeout_s=600, extra=["checkpoint.export_hf=false"])
    run = Path(report["run_dir"])
    _assert_placement(json.loads((run / "ranks.json").read_text()))
    _assert_parity_each_step(run, steps=2)


@pytest.mark.matrix  # ~3.5 min: the replica for 4 steps, one engine node killed and the engine restarted
def test_the_replica_replaces_an_engine_whose_node_died_and_finishes():
    """The engine's second node is SIGKILLed after step 1: the engine is replaced (new placement group,
    both nodes), parity-gated, and the run finishes; its merged HF export is scored on an engine laid out alike."""
    report = _replica(4, kill_at_step=1, timeout_s=900, extra=["rollout.engine_restarts=1"])
    run = Path(report["run_dir"])
    rows = _assert_parity_each_step(run, steps=4)
    assert report["killed"] and rows[-1]["rollout/engine_restarts"] == 1, (rows[-1], report["tail"])
    assert "node 1 of rollout engine 0" in report["tail"] or "one of its nodes" in report["tail"], report["tail"]
    assert "restarting it (restart 1 of 1" in report["tail"]
    assert json.loads((run / "summary.json").read_text())["merged_hf_logprob_gap"] < 1e-5


def _assert_parity_each_step(run: Path, steps: int) -> list[dict]:
    """Every push (step 0's and each update's) passed the parity gate, and every update moved the weights."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps + 1))
    for row in rows:
        assert row["rollout/logprob_abs_diff_max"] < 1e-5 and row["sync/engines"] == 1, row
    assert all(r["actor/grad_norm"] > 0 for r in rows[1:])  # lr 1e-3: each push carries new weights
    return rows


@pytest.mark.matrix  # ~1.5 min: the replica colocated on 2 logical GPUs a node (Ray hands them out, all runs on CPU)
def test_the_replica_on_gpus_gives_each_rank_a_gpu_and_the_engine_its_ranks_gpus():
    """Colocated on GPUs: each rank its own GPU (not two half-GPU ranks on one), the TP2 engine
    (within a node here) at a share of ranks 0-1's bundles, its workers seeing both their GPUs."""
    report = _replica(2, kill_at_step=None, timeout_s=600, extra=["launch.gpus_per_node=2",
                                                                  "rollout.nodes_per_engine=1"])
    run = Path(report["run_dir"])
    layout = json.loads((run / "ranks.json").read_text())
    _assert_placement(layout, engine_nodes=1)
    assert [p["devices"] for p in layout["actor"]] == ["0", "1", "0", "1"], layout
    assert [p["devices"] for p in layout["engines"][0]] == ["0,1"], layout
    _assert_parity_each_step(run, steps=2)
    assert json.loads((run / "summary.json").read_text())["merged_hf_logprob_gap"] < 1e-5


def _assert_placement(layout: dict, engine_nodes: int = 2) -> None:
    """Ranks 0-1 (TP group, pipeline stage 0) on one node, 2-3 (stage 1) on the other; the engine on
    both (or, within a node, on the first)."""
    nodes = [p["node_id"] for p in layout["actor"]]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3], layout
    assert [p["local_rank"] for p in layout["actor"]] == [0, 1, 0, 1]
    engine = [p["node_id"] for p in layout["engines"][0]]
    expected = [nodes[0]] if engine_nodes == 1 else [nodes[0], nodes[2]]
    assert len(layout["engines"]) == 1 and sorted(engine) == sorted(expected), layout


def _replica(steps: int, kill_at_step: int | None, timeout_s: float, extra: tuple = ()) -> dict:
    """Run the replica for `steps` steps in a child process (with `kill_at_step`: the engine's
    second node killed once that step is logged): its report."""
    pytest.importorskip("ray")
    pytest.importorskip("vllm")
    with tempfile.TemporaryDirectory(prefix="mrl-ray-", dir="/tmp") as temp:  # short: Ray's socket paths
        env = {**os.environ, "RAY_TMPDIR": temp, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
        args = [sys.executable, __file__, temp, str(steps), str(kill_at_step), *extra]
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout_s)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert report["rc"] == 0, report["tail"]
        saved = Path(tempfile.mkdtemp(prefix="mrl-replica-"))  # the run outlives the cluster's temp dir
        shutil.copytree(report["run_dir"], saved / "run", ignore=shutil.ignore_patterns("checkpoints", "hf"))
        return report | {"run_dir": str(saved / "run")}


def _launch(work: Path, steps: int, kill_at_step: int | None, extra: list[str]) -> dict:
    """Start the two-node cluster, write the tiny model and prompts, run the script, report. With
    launch.gpus_per_node=2 among `extra` each node declares 2 logical GPUs (Ray hands them out, the
    processes run on CPU): the colocated placement of ranks and engines on GPUs."""
    from ray.cluster_utils import Cluster

    from mrl.models.tiny import write_tiny_model

    model = write_tiny_model("deepseek_v3", work / "model")
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is {a} + {a + 3}?", "label": str(2 * a + 3)}) + "\n"
                            for a in range(16)))
    # a random tiny model never writes \boxed{}: the recipe's boxed_math would score every sample 0 and
    # dynamic sampling would skip every update; this reward varies within a group, so each step trains
    reward = work / "reward.py"
    reward.write_text("def odd_length(prompt, response, ground_truth, metadata=None):\n"
                      "    return float(len(response) % 2), {}\n")
    node = {"num_cpus": 4, "num_gpus": 2} if "launch.gpus_per_node=2" in extra else {"num_cpus": 3}
    cluster = Cluster(initialize_head=True, head_node_args=node | {"include_dashboard": False})
    try:
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        env = {**os.environ, "RECIPE": str(ROOT / "configs/dsv3_replica_cpu.yaml"), "MODEL_PATH": str(model),
               "DATA_PATH": str(data), "RUN_DIR": str(work / "run"),
               "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        command = ["bash", str(ROOT / "scripts/train_dsv3.sh"), "--address", cluster.address,
                   f"trainer.total_steps={steps}", f"reward.name={reward}:odd_length", *extra]
        with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as run:
            killed = kill_at_step is not None and _kill_engine_node_after(work / "run" / "metrics.jsonl", kill_at_step,
                                                                          run)
            output = run.communicate()[0]
        return {"rc": run.returncode, "tail": output[-6000:], "run_dir": str(work / "run"), "killed": killed}
    finally:
        cluster.shutdown()


def _kill_engine_node_after(metrics: Path, step: int, run: subprocess.Popen) -> bool:
    """Once `step` is logged, SIGKILL the process of the engine's second node (its EngineNode actor)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and run.poll() is None:
        logged = metrics.read_text().splitlines() if metrics.exists() else []
        if any(json.loads(line)["step"] == step for line in logged):
            return subprocess.run(["pkill", "-KILL", "-f", "ray::EngineNode"]).returncode == 0
        time.sleep(0.5)
    return False


if __name__ == "__main__":
    kill_at = None if sys.argv[3] == "None" else int(sys.argv[3])
    print(json.dumps(_launch(Path(sys.argv[1]), int(sys.argv[2]), kill_at, sys.argv[4:])))
