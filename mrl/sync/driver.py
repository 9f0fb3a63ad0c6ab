"""The driver's side of a sync: start the engine's receipt, have every trainer rank push, then
check parity when due. Works through the typed proxies (mrl.launch.proxies); knows no Ray."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from mrl.config.schema import SyncConfig
from mrl.profiling import stage
from mrl.sync.parity import check_parity, logprob_gap


@dataclass
class WeightSync:
    """Pushes the actor's weights into the engine; every sync is checksummed, the first one and
    every `settings.parity_every`-th (and any with a stale or mismatched tensor) also parity-checked."""

    actor: Any  # mrl.launch.proxies.ActorGroup
    engine: Any  # mrl.launch.proxies.EngineHandle
    settings: SyncConfig
    channels: int  # one per pipeline stage (broadcast) or one (colocated)
    probe: list[list[int]] = field(default_factory=list)
    syncs: int = 0

    def __post_init__(self) -> None:
        self.endpoint = self.engine.endpoint()

    @stage("sync_weights")  # a profiler/NVTX range, as the trainer's timed phases are
    def __call__(self) -> dict[str, float]:
        s = self.settings
        sync_id = f"sync{self.syncs}-{uuid.uuid4().hex[:6]}"
        start = time.perf_counter()
        receipt = self.engine.receive_weights(sync_id, self.channels)
        sent = self.actor.push_weights(self.endpoint, sync_id, s.transport, s.bucket_mb << 20, s.timeout_s)
        report = receipt.result()
        metrics = {"sync/bytes": float(sent["bytes"]), "sync/engine_load_s": report.load_seconds,
                   "timing_s/sync_weights": time.perf_counter() - start}
        due = self.syncs == 0 or (s.parity_every and self.syncs % s.parity_every == 0)
        if due or report.mismatched or report.not_updated:
            gap = logprob_gap(self.engine.score(self.probe), self.actor.probe_logprobs(self.probe))
            metrics.update(gap)
            check_parity(gap, s.parity_threshold, report, self.syncs)
        self.syncs += 1
        return metrics
