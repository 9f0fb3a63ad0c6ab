"""rollout.engine_restarts with fake engines and a fake Ray (mrl.launch.restarts): a dead or hung
engine is replaced, counted and logged; its prompts go to the engines that hold the weights, with
their own seeds (the same samples); the new engine joins the next push at its peers' weight
version, parity-gated; a lone engine takes the trainer's weights at once; when the restarts are
used up, or none are allowed, the engine's error stops the call as before."""

from __future__ import annotations

import concurrent.futures
import logging
from types import SimpleNamespace

import pytest
import ray

from mrl.config.schema import SyncConfig
from mrl.launch import fleet as fleet_module
from mrl.launch import proxies, restarts as restarts_module
from mrl.launch.fleet import EngineFleet
from mrl.launch.proxies import EngineError, EngineHandle
from mrl.launch.restarts import EngineRestarts
from mrl.rollout.engine import Generation, SamplingSettings, seeded_per_prompt
from mrl.sync.channel import SyncEndpoint
from mrl.sync.driver import WeightSync
from mrl.sync.parity import ParityError
from mrl.sync.wire import WeightUpdateReport

PROMPTS = [[3, 1], [4, 1, 5], [9], [2, 6, 5, 3], [5, 8]]
SAMPLING = seeded_per_prompt(SamplingSettings(n=2, max_tokens=3, seed=7), range(len(PROMPTS)))


class Ref:
    """A Ray reference: answered, failed, or never answered (a hung engine)."""

    def __init__(self, value=None, error: Exception | None = None, hung: bool = False):
        self.done = concurrent.futures.Future()
        if error is not None:
            self.done.set_exception(error)
        elif not hung:
            self.done.set_result(value)

    def future(self):
        return self.done


class FakeRay:
    """ray.wait returns what is answered at once; nothing answered stands for the deadline."""

    exceptions = ray.exceptions

    def __init__(self):
        self.killed = []

    def wait(self, refs, num_returns=1, timeout=None):
        ready = [r for r in refs if r.done.done()][:num_returns]
        return ready, [r for r in refs if r not in ready]

    def get(self, ref, timeout=None):
        if not ref.done.done():
            raise ray.exceptions.GetTimeoutError()
        return ref.done.result()

    def kill(self, actor):
        self.killed.append(actor)

    def cancel(self, ref):
        pass


class FakeEngine:
    """An engine and its handle: generates a fixed function of prompt, seed and weight version."""

    started = 0

    def __init__(self, log: list, logprob: float = -1.0):
        FakeEngine.started += 1
        self.number, self.log, self.logprob = FakeEngine.started, log, logprob
        self.state, self.version, self.timeout_s, self.name = "alive", 0, 5.0, "?"
        self.actor, self.node_actors, self.watchers, self.placement = self, [], [], None

    kill = EngineHandle.kill

    def submit(self, method, *args):
        self.log.append((self.number, method.__name__))
        if self.state == "dead":
            return Ref(error=ray.exceptions.RayActorError())
        if self.state == "hung" and method.__name__ != "shutdown":
            return Ref(hung=True)
        return Ref(getattr(self, method.__name__)(*args))

    def generate(self, prompts, sampling):
        return [[Generation(p, [(sum(p) * 31 + s.seed + k) % 997 for k in range(3)], "", [-1.0] * 3, "stop",
                            self.version) for k in range(s.n)] for p, s in zip(prompts, sampling)]

    def node_ip(self):
        return f"10.0.0.{self.number}"

    def shutdown(self):
        return None

    def set_weight_version(self, version):
        self.version = version

    # the weight sync's calls (mrl.sync.driver.WeightSync)
    def endpoint(self):
        return SyncEndpoint("10.0.0.1", 5000 + self.number, "torch.float32")

    def receive_weights(self, sync_id, channels, engines, index, hub):
        self.log.append((self.number, "receive"))
        self.version += 1
        return SimpleNamespace(result=lambda: WeightUpdateReport(tensors=3), failure=lambda within_s: None)

    def score(self, probe):
        self.log.append((self.number, "score"))
        return [[self.logprob, self.logprob]]


class FakeActor:
    def __init__(self):
        self.opened = []

    def open_sender(self, endpoints, settings):
        self.opened.append([e.port - 5000 for e in endpoints])

    def push_weights(self, sync_id):
        return {"bytes": 10}

    def probe_logprobs(self, probe):
        return [[-1.0, -1.0]]


@pytest.fixture
def fake_ray(monkeypatch):
    fake = FakeRay()
    for module in (fleet_module, proxies, restarts_module):
        monkeypatch.setattr(module, "ray", fake)
    return fake


def _fleet(count: int, allowed: int, log: list, logprob: float = -1.0) -> EngineFleet:
    engines = [FakeEngine(log) for _ in range(count)]
    restarts = EngineRestarts(allowed, lambda i: FakeEngine(log, logprob)) if allowed else None
    return EngineFleet(engines, [e.node_ip() for e in engines], restarts=restarts)


def _tokens(groups):
    return [[g.token_ids for g in group] for group in groups]


def _healthy_groups():
    return _tokens(FakeEngine([]).generate(PROMPTS, SAMPLING))


def test_a_dead_engine_is_replaced_and_its_prompts_go_to_the_engine_that_holds_the_weights(fake_ray, caplog):
    log: list = []
    fleet = _fleet(2, 2, log)
    old = fleet.handles[1]
    old.state = "dead"
    with caplog.at_level(logging.WARNING):
        groups, metrics = fleet.generate(PROMPTS, SAMPLING)
    assert _tokens(groups) == _healthy_groups()  # the same prompts with the same seeds: the same samples
    assert fleet.restarts.used == 1 and fleet.restarts.fresh == {1} and fleet.live() == [0]
    assert fleet.handles[1] is not old and old in fake_ray.killed
    assert [name for n, name in log if n == fleet.handles[1].number] == []  # no weights: it generated nothing
    assert [name for n, name in log if n == fleet.handles[0].number].count("generate") == 2
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == [f"generate: rollout engine 1 of 2 (node 10.0.0.{old.number}) died (its process exited: killed, "
                     "out of memory or crashed; Ray's worker log of that actor may say which); restarting it "
                     "(restart 1 of 2, rollout.engine_restarts)"]
    assert set(metrics) == {"rollout/engine0/tokens_per_s", "rollout/engine0/gen_s"}
    assert fleet.in_flight == [0.0, 0.0]
    assert fleet.name(1) == "rollout engine 1 of 2 (node not known: restarting)"


def test_a_hung_engine_is_replaced_at_the_deadline(fake_ray, caplog):
    log: list = []
    fleet = _fleet(2, 1, log)
    fleet.handles[0].state = "hung"
    with caplog.at_level(logging.WARNING):
        groups, _ = fleet.generate(PROMPTS, SAMPLING)
    assert _tokens(groups) == _healthy_groups() and fleet.live() == [1]
    assert "generate: rollout engine 0 of 2 (node 10.0.0." in caplog.text
    assert "did not answer within 20s (hung or overloaded; raise sync.timeout_s if it is only slow); restarting it" \
        in caplog.text


def test_the_restarted_engine_joins_the_next_push_at_its_peers_version_parity_gated(fake_ray, caplog):
    log: list = []
    fleet = _fleet(2, 1, log)
    actor = FakeActor()
    sync = WeightSync(actor, list(fleet.handles), SyncConfig(), channels=1, probe=[[1, 2]])
    for _ in range(2):  # versions 1 and 2; the first is parity-gated on both
        metrics = fleet.restarts.push(fleet, sync)
    assert metrics["rollout/engine_restarts"] == 0.0 and "rollout/logprob_abs_diff_max" not in metrics
    old = fleet.handles[1]
    old.state = "dead"
    fleet.generate(PROMPTS, SAMPLING)
    new = fleet.handles[1]
    assert new.version == 0
    with caplog.at_level(logging.WARNING):
        metrics = fleet.restarts.push(fleet, sync)
    assert new.version == fleet.handles[0].version == 3  # its generations carry its peers' version
    assert metrics["rollout/engine_restarts"] == 1.0 and metrics["rollout/engine1/logprob_abs_diff_max"] == 0.0
    assert metrics["sync/engines"] == 2.0 and metrics["sync/bytes"] == 20.0  # engine 0's push, then the new one's
    assert (new.number, "score") in log  # the parity gate ran on it, though parity was not due
    assert f"rollout engine 1 of 2 (node 10.0.0.{new.number}), restarted, took the weights (version 3)" in caplog.text
    assert fleet.restarts.fresh == set() and fleet.live() == [0, 1]
    assert sync.engines == fleet.handles and len(sync.endpoints) == 2
    a, b = fleet.handles[0].number, new.number
    assert actor.opened == [[a, old.number], [a], [b]]  # the push to engine 0, then the new engine's own
    groups, metrics = fleet.generate(PROMPTS, SAMPLING)  # both engines generate again
    assert {"rollout/engine0/gen_s", "rollout/engine1/gen_s"} <= set(metrics)
    assert {g.weight_version for group in groups for g in group} == {3}
    fleet.restarts.push(fleet, sync)
    assert actor.opened[-1] == [a, b]  # the sender is opened again for the whole fleet


def test_a_restarted_engine_that_fails_the_parity_gate_stops_the_run_naming_it(fake_ray):
    log: list = []
    fleet = _fleet(2, 1, log, logprob=-3.0)  # a new engine scores the probe 2 nats off
    sync = WeightSync(FakeActor(), list(fleet.handles), SyncConfig(), channels=1, probe=[[1, 2]])
    fleet.restarts.push(fleet, sync)
    fleet.handles[0].state = "dead"
    fleet.generate(PROMPTS, SAMPLING)
    with pytest.raises(ParityError, match=r"^rollout engine 0 of 2 \(node 10\.0\.0\.\d+\), restarted: step 0: vLLM "
                                          r"and Megatron disagree"):
        fleet.restarts.push(fleet, sync)


def test_a_lone_engine_restarted_takes_the_trainers_weights_before_it_generates(fake_ray):
    log: list = []
    fleet = _fleet(1, 1, log)
    sync = WeightSync(FakeActor(), list(fleet.handles), SyncConfig(), channels=1, probe=[[1, 2]])
    for _ in range(3):
        fleet.restarts.push(fleet, sync)
    restarts = fleet.restarts
    restarts.join_now = lambda: restarts.join(fleet, sync, sorted(restarts.fresh), restarts.version - 1)
    fleet.handles[0].state = "dead"
    groups, _ = fleet.generate(PROMPTS, SAMPLING)
    assert _tokens(groups) == _healthy_groups()
    assert {g.weight_version for group in groups for g in group} == {3}  # as the engine it replaced
    assert fleet.live() == [0] and restarts.used == 1


def test_before_the_first_push_a_restarted_engine_holds_its_peers_weights_already(fake_ray):
    fleet = _fleet(1, 1, [])
    fleet.handles[0].state = "dead"
    groups, _ = fleet.generate(PROMPTS, SAMPLING)  # no sync needed: every engine holds the checkpoint it loaded
    assert _tokens(groups) == _healthy_groups() and fleet.live() == [0]


def test_an_engine_found_dead_before_a_push_is_replaced_and_joins_that_push(fake_ray):
    log: list = []
    fleet = _fleet(2, 1, log)
    sync = WeightSync(FakeActor(), list(fleet.handles), SyncConfig(), channels=1, probe=[[1, 2]])
    fleet.restarts.push(fleet, sync)
    fleet.handles[0].state = "dead"  # died while idle (the trainer was training)
    metrics = fleet.restarts.push(fleet, sync)
    assert metrics["rollout/engine_restarts"] == 1.0 and "rollout/engine0/logprob_abs_diff_max" in metrics
    assert fleet.handles[0].version == fleet.handles[1].version == 2 and fleet.live() == [0, 1]


def test_when_the_restarts_are_used_up_the_engine_error_stops_the_call(fake_ray):
    fleet = _fleet(2, 1, [])
    fleet.handles[1].state = "dead"
    fleet.generate(PROMPTS, SAMPLING)
    fleet.handles[0].state = "dead"  # the second failure, the only engine with the weights
    with pytest.raises(EngineError, match=r"^generate: rollout engine 0 of 2 \(node 10\.0\.0\.\d+\) died .*; the "
                                          r"run's 1 engine restarts \(rollout\.engine_restarts\) are used up$"):
        fleet.generate(PROMPTS, SAMPLING)


def test_without_restarts_a_dead_engine_fails_the_call_as_before(fake_ray):
    fleet = _fleet(2, 0, [])
    fleet.handles[1].state = "dead"
    with pytest.raises(EngineError, match=r"^generate: rollout engine 1 of 2 \(node 10\.0\.0\.\d+\) died \(its "
                                          r"process exited"):
        fleet.generate(PROMPTS, SAMPLING)
    assert fleet.restarts is None and fake_ray.killed == []


def test_an_engine_that_raises_is_not_restarted(fake_ray):
    fleet = _fleet(2, 1, [])

    def broken(prompts, sampling):
        raise ValueError("prompt too long")

    fleet.handles[1].generate = broken
    fleet.handles[1].submit = lambda method, *args: Ref(error=ray.exceptions.RayTaskError("generate", "", ValueError()))
    with pytest.raises(EngineError, match=r"^generate: rollout engine 1 of 2 .* failed: "):
        fleet.generate(PROMPTS, SAMPLING)
    assert fleet.restarts.used == 0


def test_engine_restarts_must_not_be_negative():
    from mrl.config.ranges import out_of_range
    from mrl.config.schema import RunConfig

    cfg = RunConfig()
    cfg.rollout.engine_restarts = -1
    assert "rollout.engine_restarts must be >= 0 (0: a failed engine stops the run), got -1." in out_of_range(cfg)
    cfg.rollout.engine_restarts = 2
    assert not [e for e in out_of_range(cfg) if "engine_restarts" in e]
