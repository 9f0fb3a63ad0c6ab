"""The driver's side of a sync: start the engine's receipt, have every trainer rank push, then
check parity when due. Works through the typed proxies (mrl.launch.proxies); knows no Ray."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from mrl.config.schema import SyncConfig
from mrl.profiling import stage
from mrl.sync.parity import ParityError, check_parity, logprob_gap


@dataclass
class WeightSync:
    """Pushes the actor's weights into the engines; every sync is checksummed, the first one and
    every `settings.parity_every`-th (and any with a stale or mismatched tensor) also parity-checked,
    on every engine."""

    actor: Any  # mrl.launch.proxies.ActorGroup
    engines: list  # [mrl.launch.proxies.EngineHandle]
    settings: SyncConfig
    channels: int  # one per pipeline stage (broadcast) or one (colocated)
    probe: list[list[int]] = field(default_factory=list)
    syncs: int = 0

    def __post_init__(self) -> None:
        self.endpoints = [engine.endpoint() for engine in self.engines]

    @stage("sync_weights")  # a profiler/NVTX range, as the trainer's timed phases are
    def __call__(self) -> dict[str, float]:
        # Interim, until the fan-out: one whole export per engine, one engine after another. The
        # fan-out (one export reaching every engine) replaces this loop.
        start = time.perf_counter()
        per_engine = [self._sync_one(i) for i in range(len(self.engines))]
        metrics = {"sync/bytes": sum(m["sync/bytes"] for m in per_engine),
                   "sync/engine_load_s": max(m["sync/engine_load_s"] for m in per_engine),
                   "timing_s/sync_weights": time.perf_counter() - start}
        gated = {i: m for i, m in enumerate(per_engine) if "rollout/logprob_abs_diff_max" in m}
        if gated:  # the parity gate ran: the worst engine's gap, and with several engines each one's
            for key in ("rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max"):
                metrics[key] = max(m[key] for m in gated.values())
            if len(self.engines) > 1:
                metrics.update({f"rollout/engine{i}/logprob_abs_diff_max": m["rollout/logprob_abs_diff_max"]
                                for i, m in gated.items()})
        self.syncs += 1
        return metrics

    def _sync_one(self, i: int) -> dict[str, float]:
        s, engine = self.settings, self.engines[i]
        sync_id = f"sync{self.syncs}-e{i}-{uuid.uuid4().hex[:6]}"
        receipt = engine.receive_weights(sync_id, self.channels)
        sent = self.actor.push_weights(self.endpoints[i], sync_id, s.transport, s.bucket_mb << 20, s.timeout_s)
        report = receipt.result()
        metrics = {"sync/bytes": float(sent["bytes"]), "sync/engine_load_s": report.load_seconds}
        due = self.syncs == 0 or (s.parity_every and self.syncs % s.parity_every == 0)
        if due or report.mismatched or report.not_updated:
            gap = logprob_gap(engine.score(self.probe), self.actor.probe_logprobs(self.probe))
            metrics.update(gap)
            try:
                check_parity(gap, s.parity_threshold, report, self.syncs)
            except ParityError as err:
                raise ParityError(f"rollout engine {i} of {len(self.engines)}: {err}") from None
        return metrics
