"""The leader's bucket pipeline: buckets, from whatever makes them, sent over one link per push.

BucketSender takes the buckets of one push (the bridge's export, or any list of (name, tensor)
lists), quantises them where the engines ask for FP8, and hands them to its transport's link
(mrl/sync/link.py, mrl/sync/transports.py). The one idea: `pipelined` exports bucket k + 1 on the
calling thread (its collectives stay there) while a thread sends bucket k, so at most two buckets
are alive at a time. The longer story: docs/sync.md.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterable

from mrl.sync.channel import SyncEndpoint
from mrl.sync.link import Link, SentReport
from mrl.sync.transports import checked
from mrl.sync.wire import Bucket, SyncError, dtype_named


class BucketSender:
    """A leader's half of a sync, whatever makes its buckets: sends them to every engine of the
    sync over one channel and hears each engine's answer. `endpoints[0]` is the hub whose store
    every channel rendezvouses on; `stage` names this leader's channel (one per pipeline stage).

    It keeps the link of the last send that succeeded, whose store connection and channel the
    next send reuses (mrl.sync.channel: if every engine kept the channel too)."""

    def __init__(self, endpoints: SyncEndpoint | list[SyncEndpoint], *, transport: str = "broadcast",
                 timeout_s: float = 300.0, pipeline: bool = True, who: str = "rank 0 (PP stage 0)", stage: int = 0):
        self.endpoints, kind = checked(endpoints, transport)
        self.endpoint = self.endpoints[0]
        self.timeout_s, self.pipeline = timeout_s, pipeline
        self.who, self.stage = who, stage
        self.engine_dtype = dtype_named(self.endpoint.dtype)
        self.transport = kind(self)
        self._kept: Link | None = None

    def send(self, sync_id: str, buckets: Iterable[Bucket]) -> SentReport:
        """Send every bucket (made while the previous one is sent, with `pipeline`), then the end marker."""
        start = time.perf_counter()
        report = SentReport(started_at=time.time())
        if self.endpoint.quantization == "fp8":  # each bucket quantised where it was made (a GPU's: on the GPU)
            from mrl.quant.fp8 import quantize_pairs

            buckets = (list(quantize_pairs(bucket)) for bucket in buckets)
        # The last push's link is taken here, on the calling thread: an opening still running after
        # a failed push must not take a later push's connection and channel.
        kept, self._kept = self._kept, None
        link = self.transport.open(sync_id, kept)
        try:
            if self.pipeline:
                pipelined(buckets, lambda index, bucket: link.send(index, bucket, report), link.who, self.timeout_s,
                          link.opening, link.drop)
            else:
                for index, bucket in enumerate(buckets):
                    link.send(index, bucket, report)
            link.finish(report)
            # Every message of this send went through: its connection and channel are reusable. A
            # failed send gives neither back (the engine may be gone): the next one connects anew.
            self._kept = link
        except SyncError as err:
            raise SyncError(link.diagnosed(str(err))) from err
        finally:
            link.close()
        report.seconds = time.perf_counter() - start
        return report


def pipelined(buckets: Iterable[Bucket], send: Callable[[int, Bucket], int], who: str, timeout_s: float,
              opening: Callable[[], bool] = lambda: False, drop: Callable[[Bucket], int] = lambda bucket: 1) -> None:
    """Export on the calling thread (its collectives stay there) while a thread sends the previous
    bucket. Two slots, each given back when a bucket's memory goes (`send` says how many went: a
    bucket in shared memory goes when the engines have loaded it, after the next one is sent); the
    wait for one does not count while the channel is `opening` (its own steps have timeouts). After
    an error the thread `drop`s the buckets it is handed. Its first error is raised here, once the
    export has run to its end (its other ranks take part in it), or when a slot's wait times out."""
    slots = threading.Semaphore(2)
    handoff: queue.Queue = queue.Queue(maxsize=1)
    errors: list[BaseException] = []

    def sending() -> None:
        index = 0
        while True:
            try:
                item = handoff.get(timeout=timeout_s * 2)
            except queue.Empty:
                errors.append(SyncError(f"{who}: the sender thread waited {timeout_s * 2:.0f}s for bucket {index} "
                                        "from the export"))
                return
            if item is None:
                return
            index, bucket = item
            del item
            freed = 1
            try:
                freed = drop(bucket) if errors else send(index, bucket)
            except BaseException as err:  # noqa: BLE001 - raised on the calling thread
                errors.append(err)
            finally:
                del bucket
                if freed:
                    slots.release(freed)
            index += 1

    thread = threading.Thread(target=sending, name="mrl-sync-sender", daemon=True)
    thread.start()
    iterator, index = iter(buckets), 0
    while True:
        while not slots.acquire(timeout=timeout_s):
            if opening():
                continue
            if errors:  # the sending thread's own error names the cause better (e.g. the channel's)
                raise errors[0]
            raise SyncError(f"{who}: bucket {index - 2} was not sent (or, in shared memory, loaded by the engines) "
                            f"within {timeout_s:.0f}s (the export waited to assemble bucket {index})")
        bucket = next(iterator, None)
        if bucket is None:
            break
        _put(handoff, (index, bucket), who, f"bucket {index}", timeout_s)
        del bucket
        index += 1
    _put(handoff, None, who, "the end of the export", timeout_s)
    thread.join(timeout_s)
    if thread.is_alive():
        raise SyncError(f"{who}: the sender thread did not finish sending within {timeout_s:.0f}s of the export's end")
    if errors:
        raise errors[0]


def _put(handoff: queue.Queue, item: Any, who: str, what: str, timeout_s: float) -> None:
    try:
        handoff.put(item, timeout=timeout_s)
    except queue.Full:
        raise SyncError(f"{who}: the sender thread did not take {what} within {timeout_s:.0f}s") from None
