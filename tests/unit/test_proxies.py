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


def test_push_weights_refuses_settings_other_than_the_first_calls():
    worker = MegatronActor(0, 1)

    class Sender:
        def push(self, sync_id):
            return None

    worker.sender, worker.sender_settings = Sender(), (["endpoint"], "broadcast", 1 << 20, 60.0)
    assert worker.push_weights(["endpoint"], "s1", "broadcast", 1 << 20, 60.0) is None
    with pytest.raises(ValueError, match="one sender per run"):
        worker.push_weights(["endpoint"], "s2", "colocated", 1 << 20, 60.0)


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
