"""The driver's typed proxies: each call names its worker method by reference and is checked
against that method's signature before anything is sent."""

import pytest
import torch

from mrl.launch.proxies import ActorGroup
from mrl.workers.actor import MegatronActor


class RecordingGroup:
    """Stands in for a WorkerGroup: records what would be sent to the ranks."""

    def __init__(self):
        self.sent = []

    def call(self, method, *args, timeout_s=None):
        self.sent.append((method, args))
        return [None]

    def first(self, method, *args, timeout_s=None):
        self.sent.append((method, args))
        return {"bytes": 0}

    def by_dp(self, method, *args, timeout_s=None):
        self.sent.append((method, args))
        return [{"dp": 0, "logprobs": torch.zeros(1, 2)}]


def test_a_call_reaches_the_worker_method_of_the_same_name():
    group = RecordingGroup()
    actor = ActorGroup(group)
    actor.save("/ckpt", 3, {}, {}, 2, False)
    actor.logprobs({"tokens": None}, reference=True)
    assert group.sent == [("save", ("/ckpt", 3, {}, {}, 2, False)), ("logprobs", ({"tokens": None}, True))]
    assert all(hasattr(MegatronActor, name) for name, _ in group.sent)


def test_a_wrong_call_fails_on_the_driver_before_anything_is_sent():
    group = RecordingGroup()
    with pytest.raises(TypeError):
        ActorGroup(group)._all(MegatronActor.save, "/ckpt", 3)  # four arguments missing
    assert group.sent == []


def test_the_settings_go_once_and_a_sender_is_opened_again_only_for_other_engines(monkeypatch):
    """open_sender takes the engines and the typed sync settings; push_weights only the sync id.
    The same engines and settings keep the open sender; other engines close it and open anew."""
    from types import SimpleNamespace

    from mrl.config.schema import SyncConfig

    made: list = []

    class Sender:
        def __init__(self, endpoints, built, coords, **settings):
            made.append((endpoints, settings))

        def push(self, sync_id):
            return None

        def close(self):
            made.append("closed")

    monkeypatch.setattr("mrl.sync.sender.WeightSender", Sender)
    worker = MegatronActor(0, 1)
    worker.trainable = SimpleNamespace(built=None)
    with pytest.raises(RuntimeError, match="rank 0: push_weights before open_sender"):
        worker.push_weights("s0")
    settings = SyncConfig(transport="broadcast", bucket_mb=1, timeout_s=60.0)
    worker.open_sender(["endpoint"], settings)
    worker.open_sender(["endpoint"], settings)
    assert worker.push_weights("s1") is None
    worker.open_sender(["other endpoint"], settings)
    opened = {"transport": "broadcast", "bucket_bytes": 1 << 20, "timeout_s": 60.0}
    assert made == [(["endpoint"], opened), "closed", (["other endpoint"], opened)]

    group = RecordingGroup()
    ActorGroup(group).open_sender(["endpoint"], settings)
    ActorGroup(group).push_weights("s1")
    with pytest.raises(TypeError):  # the settings went with open_sender: a push takes the sync id alone
        ActorGroup(group)._first(MegatronActor.push_weights, ["endpoint"], "s2", "broadcast", 1 << 20, 60.0)
    assert group.sent == [("open_sender", (["endpoint"], settings)), ("push_weights", ("s1",))]


def test_a_fleet_generation_takes_each_engines_time_when_it_finishes():
    import concurrent.futures

    from mrl.launch.fleet import FleetGeneration
    from mrl.rollout.engine import Generation

    class Ref:
        def __init__(self):
            self.done = concurrent.futures.Future()

        def future(self):
            return self.done

    class Fleet:  # the part of EngineFleet a FleetGeneration uses
        timeout_s = 7.0

        def __init__(self, answers):
            self.answers = answers
            self.in_flight = [0.0, 0.0]  # each engine's work in flight (async.streaming spreads by it)

        def _gather(self, refs, what, timeout_s):
            return self.answers

        def name(self, i):
            return f"engine {i}"

    one = Generation([1], [1, 2], "x", [-0.5, -0.25], "stop", 1)
    refs = {0: Ref(), 1: Ref()}
    fleet = Fleet({0: [[one]], 1: [[one], [one]]})
    pending = FleetGeneration(fleet, [[1], [0, 2]], refs, 3, [5.0, 9.0])
    assert pending.seconds is None and fleet.in_flight == [5.0, 9.0]  # still generating
    refs[0].done.set_result(None)
    assert pending.seconds is None and fleet.in_flight == [0.0, 9.0]  # engine 1 still generating
    refs[1].done.set_result(None)
    seconds = pending.seconds
    assert seconds is not None and seconds >= 0
    groups = pending.result()
    assert [len(g) for g in groups] == [1, 1, 1] and pending.seconds == seconds  # batch order; time taken at finish
    assert fleet.in_flight == [0.0, 0.0]  # counted off once, though result() and the callbacks both saw it
    assert set(pending.metrics) == {f"rollout/engine{i}/{k}" for i in (0, 1) for k in ("tokens_per_s", "gen_s")}


def test_a_log_prob_pass_sums_routing_counts_over_dp_and_joins_r2_routes_in_dp_order():
    from mrl.launch.proxies import Scored
    from mrl.routes import agreement_counts

    own = torch.tensor([[[[0, 1]], [[2, 3]]], [[[1, 0]], [[3, 4]]]])  # [B=2, T=2, M=1, K=2]
    given = torch.tensor([[[[1, 0]], [[2, 5]]], [[[1, 0]], [[3, 4]]]])
    ranks = [{"dp": dp, "logprobs": torch.full((1, 2), float(dp)), "routes_len": torch.tensor([2]),
              "routes": own[dp : dp + 1].to(torch.uint8),
              "routing_counts": agreement_counts(own[dp : dp + 1], given[dp : dp + 1], torch.ones(1, 2, dtype=bool))}
             for dp in (0, 1)]
    scored = Scored.of(ranks)
    assert torch.equal(scored.logprobs, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert scored.routing == {"rollout/routing_agreement": 0.75, "rollout/routing_agreement_min_layer": 0.75,
                              "rollout/routing_tokens_any_diff": 0.25}
    assert torch.equal(scored.replay["routes"], own.to(torch.uint8)) and scored.replay["routes_len"].tolist() == [2, 2]
    plain = Scored.of([{"dp": 0, "logprobs": torch.zeros(1, 2)}])
    assert plain.routing == {} and plain.replay == {}
