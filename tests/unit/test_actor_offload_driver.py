"""trainer.offload_actor_during_rollout on the driver: when the trainers' state leaves and comes
back (around the weight push, after the engines sleep, around a checkpoint save), the metrics it
reports, the sync mode's step carrying the onload metrics, the config check, and the offloader's
storage round trip on plain tensors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mrl.config.schema import RunConfig, TrainerConfig
from mrl.launch.cluster import Cluster
from mrl.megatron.offload import StateOffloader


class FakeGroup:
    def __init__(self, name: str, events: list, per_rank: list[int]):
        self.name, self.events, self.per_rank = name, events, per_rank

    def offload_state(self, parts: list[str], move_host_tensors: bool = False) -> list[dict]:
        self.events.append(f"{self.name} off {'+'.join(parts)}")
        return [{"rank": r, "bytes": b * len(parts)} for r, b in enumerate(self.per_rank)]

    def onload_state(self) -> list[dict]:
        self.events.append(f"{self.name} on")
        return [{"rank": r, "bytes": b} for r, b in enumerate(self.per_rank)]


class FakeEngines:
    def __init__(self, events: list):
        self.events = events

    def sleep(self) -> None:
        self.events.append("sleep")


def _cluster(offload: bool, critic: bool = False) -> tuple[Cluster, list]:
    events: list = []
    cfg = replace(RunConfig(), trainer=TrainerConfig(offload_actor_during_rollout=offload))

    def sync() -> dict:
        events.append("push")
        return {"timing_s/sync": 1.0}

    cluster = Cluster(cfg, FakeGroup("actor", events, [10, 20]), FakeEngines(events), False,
                      critic=FakeGroup("critic", events, [5, 5]) if critic else None, sync=sync)
    return cluster, events


def test_state_leaves_around_the_push_and_returns_after_the_engines_sleep():
    cluster, events = _cluster(True, critic=True)
    metrics = cluster.sync_weights()
    assert events == ["actor off grads+optimizer+reference", "critic off weights+grads+optimizer+reference", "push",
                      "actor off weights"]
    assert metrics["perf/actor_offload_bytes"] == 3 * 30 + 30  # summed over ranks and both moves
    assert metrics["perf/critic_offload_bytes"] == 4 * 10
    assert metrics["timing_s/sync"] == 1.0 and metrics["timing_s/actor_offload"] >= 0
    events.clear()
    back = cluster.release_engines()
    assert events == ["sleep", "actor on", "critic on"]
    assert back["perf/actor_onload_bytes"] == 30 and back["perf/critic_onload_bytes"] == 10
    assert "timing_s/actor_onload" in back
    events.clear()
    assert cluster.release_engines() == {} and events == ["sleep"]  # nothing away: nothing to bring back


def test_a_save_between_steps_brings_the_state_back_with_the_engines_asleep():
    cluster, events = _cluster(True)
    with cluster.trainers_on_device():  # nothing offloaded yet: nothing happens
        events.append("save")
    assert events == ["save"]
    cluster.sync_weights()
    events.clear()
    with cluster.trainers_on_device():
        events.append("save")
    assert events == ["sleep", "actor on", "save", "actor off weights+grads+optimizer+reference"]


def test_a_generation_without_a_push_before_it_sends_the_state_away_first():
    """A generation with no push before it (an evaluation before the first sync) offloads first."""
    cluster, events = _cluster(True)
    cluster.engines.generate_async = lambda prompts, sampling: events.append("generate")
    cluster.generate_async([[1]], None)
    assert events == ["actor off weights+grads+optimizer+reference", "generate"]
    cluster.generate_async([[1]], None)  # away already
    assert events[2:] == ["generate"]
    back = cluster.release_engines()  # the unreported offload comes with the onload's metrics
    assert back["perf/actor_offload_bytes"] == 4 * 30 and back["perf/actor_onload_bytes"] == 30


def test_without_the_setting_nothing_moves():
    cluster, events = _cluster(False)
    assert cluster.sync_weights() == {"timing_s/sync": 1.0}
    assert cluster.release_engines() == {} and events == ["push", "sleep"]


def test_the_sync_step_reports_the_onload():
    from mrl.modes import GeneratedBatch, PendingBatch, SyncSource

    class Done:
        seconds, metrics = 0.0, {}

        def result(self):
            return [[]]

    def launch(step: int) -> PendingBatch:
        return PendingBatch(step, [0], Done(), 0)

    source = SyncSource(launch, dict, lambda: {"perf/actor_onload_bytes": 7.0})
    metrics: dict = {}
    assert isinstance(source.next(1, metrics), GeneratedBatch)
    assert metrics["perf/actor_onload_bytes"] == 7.0


@pytest.mark.parametrize("overrides, message", [
    (dict(placement="separate"), "trainer.offload_actor_during_rollout frees the actor's GPU memory for a colocated "
                                 "engine, but launch.placement is 'separate'"),
    (dict(mode="one_step_off"), "trainer.offload_actor_during_rollout needs trainer.mode sync"),
])
def test_refused_where_it_cannot_work(overrides, message):
    from mrl.config.validation import _check_actor_offload

    cfg = RunConfig()
    cfg = replace(cfg, trainer=replace(cfg.trainer, offload_actor_during_rollout=True,
                                       mode=overrides.get("mode", "sync")),
                  launch=replace(cfg.launch, placement=overrides.get("placement", "colocated")))
    (error,) = _check_actor_offload(cfg)
    assert error.startswith(message), error
    assert _check_actor_offload(replace(cfg, trainer=replace(cfg.trainer, offload_actor_during_rollout=False))) == []


def test_storages_round_trip_and_views_survive():
    base = torch.arange(12, dtype=torch.float32)
    view, other, grad = base[4:], torch.ones(3, dtype=torch.bfloat16), torch.full((5,), 2.0)
    parts = {"weights": [base, view, other], "grads": [grad, view], "optimizer": [], "reference": []}
    in_place = StateOffloader(lambda part: parts[part])
    report = in_place.offload(["grads", "weights"])
    assert report["by_part"] == {"grads": 20, "weights": 48 + 6} and not report["moved"]
    assert base.untyped_storage().nbytes() == 48  # without CUDA: nothing freed
    assert in_place.onload()["by_part"] == {"grads": 20, "weights": 54}

    moving = StateOffloader(lambda part: parts[part], move_host_tensors=True)
    assert moving.offload(["weights"])["by_part"] == {"weights": 54}
    assert base.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    assert grad.untyped_storage().nbytes() == 20  # grads were not asked for
    assert moving.offload(["weights"])["bytes"] == 0  # away already
    assert moving.onload()["moved"]
    assert torch.equal(base, torch.arange(12, dtype=torch.float32)) and torch.equal(view, torch.arange(4, 12.0))
    view.add_(1)  # still a view of base's storage
    assert base[4] == 5.0 and torch.equal(other, torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="unknown offload parts"):
        moving.offload(["activations"])
