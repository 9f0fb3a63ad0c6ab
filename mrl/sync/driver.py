"""The driver's side of a sync: start every engine's receipt, have every trainer rank push once
(one export reaches every engine), then check each engine's report and parity when due. Works
through the typed proxies (mrl.launch.proxies); knows no Ray."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from mrl.config.schema import SyncConfig
from mrl.profiling import stage
from mrl.sync.channel import SyncEndpoint
from mrl.sync.parity import ParityError, check_parity, logprob_gap


# After a failed push: how long a dead engine's receipt may take to report the death.
DEATH_REPORT_S = 5.0
WATCH_S = 0.5  # during a push: how often the engines' receipts are looked at for a death


@dataclass
class WeightSync:
    """Pushes the actor's weights into every engine at once; every sync is checksummed, the first
    one and every `settings.parity_every`-th (and any with a stale or mismatched tensor on some
    engine) also parity-checked on every engine. The actor's sender is opened with the settings
    at the first sync, and again at the next one after `endpoints` change (a fleet re-assignment)."""

    actor: Any  # mrl.launch.proxies.ActorGroup
    engines: list[Any]  # mrl.launch.proxies.EngineHandle; engines[0] hosts the rendezvous (the hub)
    settings: SyncConfig
    channels: int  # one per pipeline stage (broadcast) or one (colocated)
    probe: list[list[int]] = field(default_factory=list)
    # an MoE model whose engines return routes: the gate's routing check of an engine (mrl.launch.route_probe)
    route_check: Callable[[Any], dict[str, float]] | None = None
    syncs: int = 0

    def __post_init__(self) -> None:
        if not self.engines:
            raise ValueError("WeightSync needs at least one engine")
        self.endpoints = [engine.endpoint() for engine in self.engines]
        self.opened: list[SyncEndpoint] | None = None  # the endpoints the actor's sender was opened for

    @staticmethod
    def _raise_if_an_engine_died(receipts: list[Any], push_error: Exception) -> None:
        """A push that failed because an engine died is that engine's failure: its receipt's error
        (naming it and its node) is raised, from the trainer's. An engine that is alive is still
        waiting in its receipt (it times out by itself): only a receipt that ends in
        `DEATH_REPORT_S` is asked."""
        for receipt in receipts:
            died = receipt.failure(DEATH_REPORT_S)
            if died is not None:
                raise died from push_error

    def _push_watching(self, sync_id: str, receipts: list[Any]) -> tuple[dict | None, Exception | None]:
        """The ranks' push (its report, or its own error raised), while looking every WATCH_S for
        an engine whose receipt ended in its death: (None, that death) at once. The senders would
        wait out their rendezvous for a dead engine that is not the hub; the push's thread is a
        daemon, and the run's close stops the ranks still in it."""
        outcome: dict[str, Any] = {}

        def push() -> None:
            try:
                outcome["sent"] = self.actor.push_weights(sync_id)
            except Exception as err:  # noqa: BLE001 - raised on the driver's thread below
                outcome["error"] = err

        thread = threading.Thread(target=push, name=f"push {sync_id}", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(WATCH_S)
            for receipt in receipts if thread.is_alive() else ():
                died = receipt.failure(0.0)
                if died is not None:
                    return None, died
        if "error" in outcome:
            raise outcome["error"]
        return outcome["sent"], None

    @stage("sync_weights")  # a profiler/NVTX range, as the trainer's timed phases are
    def __call__(self) -> dict[str, float]:
        s = self.settings
        sync_id = f"sync{self.syncs}-{uuid.uuid4().hex[:6]}"
        start = time.perf_counter()
        if self.opened != self.endpoints:  # the settings go once; the engines again if they change
            self.actor.open_sender(self.endpoints, s)
            self.opened = list(self.endpoints)
        count, hub = len(self.engines), self.endpoints[0]
        receipts = [engine.receive_weights(sync_id, self.channels, count, i, None if i == 0 else hub)
                    for i, engine in enumerate(self.engines)]
        try:
            sent, died = self._push_watching(sync_id, receipts)
        except Exception as push_error:
            self._raise_if_an_engine_died(receipts, push_error)
            raise
        if died is not None:
            raise died
        reports = [receipt.result() for receipt in receipts]
        metrics = {"sync/bytes": float(sent["bytes"]), "sync/engines": float(count),
                   "sync/engine_load_s": max(r.load_seconds for r in reports),
                   "timing_s/sync_weights": time.perf_counter() - start}
        due = self.syncs == 0 or (s.parity_every and self.syncs % s.parity_every == 0)
        trainer = None
        for i, (engine, report) in enumerate(zip(self.engines, reports)):
            if not (due or report.mismatched or report.not_updated or report.misapplied):
                continue
            trainer = trainer or self.actor.probe_logprobs(self.probe)
            gap = logprob_gap(engine.score(self.probe), trainer)
            if self.route_check is not None:
                gap.update(self.route_check(engine))
            if gap["rollout/logprob_abs_diff_max"] >= metrics.get("rollout/logprob_abs_diff_max", -1.0):
                metrics.update(gap)  # the worst engine's gap is the one logged
            if count > 1:
                metrics[f"rollout/engine{i}/logprob_abs_diff_max"] = gap["rollout/logprob_abs_diff_max"]
            try:
                check_parity(gap, s.parity_threshold, report, self.syncs)
            except ParityError as err:
                if count == 1:
                    raise
                where = f"engine {i} of {count} at {self.endpoints[i].host}:{self.endpoints[i].port}"
                raise ParityError(f"{where}: {err}") from err
        self.syncs += 1
        return metrics
