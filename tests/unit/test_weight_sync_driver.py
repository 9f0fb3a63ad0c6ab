"""WeightSync (the driver's side) with fake engines and a fake actor: the sender opened once with
the settings, one push for every engine, each engine's receipt started first, each engine's report
and parity checked, naming the engine."""

from __future__ import annotations

import functools

import pytest
import torch

from mrl.config.schema import SyncConfig
from mrl.sync.channel import SyncEndpoint
from mrl.sync.driver import WeightSync
from mrl.launch.route_probe import RouteProbe, probe_routing
from mrl.sync.parity import ParityError
from mrl.routes import RouteShape
from mrl.sync.wire import WeightUpdateReport


class Receipt:
    def __init__(self, report, died: Exception | None = None):
        self.report, self.died = report, died

    def result(self):
        if self.died is not None:
            raise self.died
        return self.report

    def failure(self, within_s):
        return self.died


class FakeEngine:
    def __init__(self, port: int, log: list, logprob: float = -1.0, report: WeightUpdateReport | None = None):
        self.port, self.log, self.logprob = port, log, logprob
        self.report = report or WeightUpdateReport(tensors=3)

    def endpoint(self):
        return SyncEndpoint("10.0.0.1", self.port, "torch.float32")

    def receive_weights(self, sync_id, channels, engines, index, hub):
        self.log.append(("receive", self.port, sync_id, channels, engines, index, hub and hub.port))
        return Receipt(self.report)

    def score(self, probe):
        self.log.append(("score", self.port))
        return [[self.logprob, self.logprob]]


class FakeActor:
    def __init__(self, log: list):
        self.log = log

    def open_sender(self, endpoints, settings):
        self.log.append(("open", [e.port for e in endpoints], settings.transport))

    def push_weights(self, sync_id):
        self.log.append(("push", sync_id))
        return {"bytes": 10}

    def probe_logprobs(self, probe):
        return [[-1.0, -1.0]]


def test_one_push_feeds_every_engine_and_parity_runs_on_each():
    log: list = []
    engines = [FakeEngine(5000, log), FakeEngine(5001, log)]
    sync = WeightSync(FakeActor(log), engines, SyncConfig(transport="broadcast"), channels=2, probe=[[1, 2]])
    metrics = sync()
    sync_id = log[1][2]
    assert log == [("open", [5000, 5001], "broadcast"),
                   ("receive", 5000, sync_id, 2, 2, 0, None), ("receive", 5001, sync_id, 2, 2, 1, 5000),
                   ("push", sync_id), ("score", 5000), ("score", 5001)]
    assert metrics["sync/engines"] == 2 and metrics["rollout/logprob_abs_diff_max"] == 0.0


def test_the_sender_is_opened_once_and_again_when_the_engines_change():
    log: list = []
    sync = WeightSync(FakeActor(log), [FakeEngine(5000, log)], SyncConfig(transport="broadcast"), channels=1,
                      probe=[[1, 2]])
    sync()
    sync()
    sync.endpoints = [SyncEndpoint("10.0.0.2", 6000, "torch.float32")]  # a fleet re-assignment
    sync()
    calls = [entry if entry[0] == "open" else entry[0] for entry in log if entry[0] in ("open", "push")]
    assert calls == [("open", [5000], "broadcast"), "push", "push", ("open", [6000], "broadcast"), "push"]
    assert [entry[1] for entry in log if entry[0] == "push"] == [entry[2] for entry in log if entry[0] == "receive"]


def test_parity_failure_names_the_engine():
    log: list = []
    engines = [FakeEngine(5000, log), FakeEngine(5001, log, logprob=-3.0,
                                                 report=WeightUpdateReport(tensors=3, not_updated=["lm_head.weight"]))]
    sync = WeightSync(FakeActor(log), engines, SyncConfig(transport="broadcast"), channels=1, probe=[[1, 2]])
    with pytest.raises(ParityError, match=r"engine 1 of 2 at 10\.0\.0\.1:5001: step 0: .*'lm_head\.weight'"):
        sync()


class RoutingEngine(FakeEngine):
    """Routes the probe's tokens to expert (token % 4), which the fake trainer below agrees with
    except at one token of one layer."""

    def generate(self, rows, sampling):
        import numpy as np

        from mrl.rollout.engine import Generation

        assert sampling.max_tokens == 1 and sampling.temperature == 0.0
        routes = lambda row: np.array([[[t % 4]] * 2 for t in row], dtype=np.uint8)  # noqa: E731
        return [[Generation(list(row), [7], "", [-1.0], "length", routed_experts=routes(row))] for row in rows]


class RoutingActor(FakeActor):
    def logprobs(self, batch):
        from mrl.launch.proxies import Scored
        from mrl.routes import agreement

        own = batch["routes"].long().clone()
        own[0, 0, 1] = 3 - own[0, 0, 1]  # one flipped choice (token 0's in MoE layer 1)
        mask = torch.arange(own.shape[1]).unsqueeze(0) < batch["routes_len"].unsqueeze(1)
        self.log.append(("logprobs", batch["tokens"].shape[0]))
        return Scored(torch.zeros(1), agreement(own, batch["routes"].long(), mask))


def test_the_gate_compares_routing_and_names_it_when_it_fails():
    log: list = []
    probe = RouteProbe.of([[1, 2, 3]], data_parallel=2, shape=RouteShape(layers=2, top_k=1, n_experts=4))
    assert probe.rows == [[1, 2, 3], [1, 2, 3]]  # a multiple of DP: every rank scores a share
    actor = RoutingActor(log)
    check = functools.partial(probe_routing, actor=actor, probe=probe)
    sync = WeightSync(actor, [RoutingEngine(5000, log)], SyncConfig(transport="broadcast"), channels=1,
                      probe=[[1, 2]], route_check=check)
    metrics = sync()
    assert ("logprobs", 2) in log
    assert metrics["rollout/probe_routing_agreement"] == 11 / 12  # 2 rows x 3 tokens x 2 layers, one differs
    assert metrics["rollout/probe_routing_agreement_min_layer"] == 5 / 6
    assert metrics["rollout/probe_routing_tokens_any_diff"] == 1 / 6
    worse = WeightSync(actor, [RoutingEngine(5000, log, logprob=-3.0)], SyncConfig(transport="broadcast"),
                       channels=1, probe=[[1, 2]], route_check=check)
    with pytest.raises(ParityError, match=r"Routing on the probe: 0\.9167 of the expert choices agree "
                                          r"\(worst MoE layer 0\.8333\)"):
        worse()


def test_a_stale_engine_is_checked_even_when_parity_is_not_due():
    log: list = []
    engines = [FakeEngine(5000, log), FakeEngine(5001, log, report=WeightUpdateReport(tensors=3, mismatched=["x"]))]
    sync = WeightSync(FakeActor(log), engines, SyncConfig(transport="broadcast"), channels=1, probe=[[1, 2]], syncs=1)
    sync()
    assert [entry for entry in log if entry[0] == "score"] == [("score", 5001)]


class FailingActor(FakeActor):
    def push_weights(self, sync_id):
        raise RuntimeError("rank 0 failed in push_weights: connection reset by peer")


@pytest.mark.parametrize("dead", [None, 1])
def test_a_push_that_fails_because_an_engine_died_names_that_engine(dead):
    """The trainer's push fails when an engine dies under it; the dead engine's receipt says which
    (raised from the trainer's error). With every engine alive the trainer's own error stands."""
    log: list = []
    engines = [FakeEngine(5000, log), FakeEngine(5001, log)]
    if dead is not None:
        died = RuntimeError("weight update: rollout engine 1 of 2 (node 10.0.0.2) died")
        engines[dead].receive_weights = lambda *args: Receipt(None, died)
    sync = WeightSync(FailingActor(log), engines, SyncConfig(transport="broadcast"), channels=1, probe=[[1, 2]])
    expected = "rollout engine 1 of 2 .* died" if dead is not None else "rank 0 failed in push_weights"
    with pytest.raises(RuntimeError, match=expected) as failure:
        sync()
    if dead is not None:
        assert "connection reset" in str(failure.value.__cause__)


class StuckActor(FakeActor):
    """Its ranks' push waits for an engine that will never join (until released)."""

    def __init__(self, log: list):
        super().__init__(log)
        import threading

        self.released = threading.Event()

    def push_weights(self, sync_id):
        self.released.wait(30)
        raise RuntimeError("rank 0: no engine joined the rendezvous within 30s")


def test_an_engine_that_dies_during_the_push_fails_the_sync_at_once():
    """The senders would wait out their rendezvous for a dead engine that is not the hub; the
    driver sees the death in that engine's receipt and raises it without waiting for them."""
    import time

    class Waiting(Receipt):  # engine 0, alive, still in its receipt: a look for a death waits it out
        def failure(self, within_s):
            time.sleep(within_s)
            return None

    log: list = []
    engines = [FakeEngine(5000, log), FakeEngine(5001, log)]
    died = RuntimeError("weight update: rollout engine 1 of 2 (node 10.0.0.2) died")
    engines[0].receive_weights = lambda *args: Waiting(None)
    engines[1].receive_weights = lambda *args: Receipt(None, died)
    actor = StuckActor(log)
    sync = WeightSync(actor, engines, SyncConfig(transport="broadcast"), channels=1, probe=[[1, 2]])
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="rollout engine 1 of 2 .* died"):
            sync()
        # a look every 0.5 s: not the push's 30 s, nor DEATH_REPORT_S (5 s) on the live engine 0
        assert time.monotonic() - start < 4
    finally:
        actor.released.set()
