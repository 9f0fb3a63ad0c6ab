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

    worker.senders, worker.sender_settings = {"endpoint": Sender()}, ("broadcast", 1 << 20, 60.0)
    assert worker.push_weights("endpoint", "s1", "broadcast", 1 << 20, 60.0) is None
    with pytest.raises(ValueError, match="one sender setting per run"):
        worker.push_weights("endpoint", "s2", "colocated", 1 << 20, 60.0)
