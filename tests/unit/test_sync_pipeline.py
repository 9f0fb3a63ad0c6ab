"""The sender's pipeline (mrl.sync.pipeline.pipelined): the export of bucket k + 1 overlaps sending
bucket k, never more than two buckets are alive, and the sender thread's errors surface on the
calling thread once the export has run to its end."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mrl.sync.pipeline import pipelined
from mrl.sync.wire import SyncError


def _export(count: int, started: list[int]):
    for index in range(count):
        started.append(index)  # the export begins assembling this bucket
        yield [(f"t{index}", torch.zeros(1))]


def test_export_of_the_next_bucket_overlaps_sending_and_two_buckets_at_most():
    started: list[int] = []
    sent: list[int] = []
    seen_during_send: list[list[int]] = []

    def send(index, bucket):
        if index == 0:
            deadline = time.monotonic() + 5
            while 1 not in started and time.monotonic() < deadline:  # the export of bucket 1 runs meanwhile
                time.sleep(0.01)
            time.sleep(0.2)  # room for the export to (wrongly) start bucket 2
            seen_during_send.append(list(started))
        sent.append(index)
        return 1  # this bucket's memory went with the send (the wire)

    pipelined(_export(4, started), send, "rank 0", timeout_s=10)
    assert seen_during_send == [[0, 1]]  # bucket 1 exported while 0 was sent; bucket 2 waited
    assert sent == [0, 1, 2, 3] and started == [0, 1, 2, 3]


def test_a_sender_thread_error_surfaces_with_its_message_after_the_export_ends():
    started: list[int] = []

    def send(index, bucket):
        if index == 1:
            raise SyncError("rank 0: sending bucket 1 failed: the engine is gone")
        return 1

    with pytest.raises(SyncError, match="sending bucket 1 failed: the engine is gone"):
        pipelined(_export(5, started), send, "rank 0", timeout_s=10)
    assert started == [0, 1, 2, 3, 4]  # the export ran to its end: its other ranks are not left waiting


def test_a_stuck_sender_thread_is_an_error_naming_who_waited():
    release = threading.Event()

    def send(index, bucket):
        release.wait(10)
        return 1

    try:
        with pytest.raises(SyncError, match=r"rank 0: bucket 0 was not sent \(or, in shared memory, loaded by the "
                                            r"engines\) within 1s \(the export waited to assemble bucket 2\)"):
            pipelined(_export(3, []), send, "rank 0", timeout_s=1)
    finally:
        release.set()


def test_a_shared_memory_bucket_holds_its_slot_until_the_engines_loaded_it():
    """Shared memory (colocated): bucket k goes when the engines have loaded it, which the sender
    hears while sending bucket k + 1 (send returns 0 for the first bucket, then 1). Bucket 2's
    export waits for bucket 0 to go: two buckets at most, one packed while the other loads."""
    started: list[int] = []
    seen: list[list[int]] = []

    def send(index, bucket):
        time.sleep(0.1)  # room for the export to (wrongly) run ahead
        seen.append(list(started))
        return 0 if index == 0 else 1

    pipelined(_export(4, started), send, "rank 0", timeout_s=10)
    assert seen == [[0, 1], [0, 1], [0, 1, 2], [0, 1, 2, 3]]  # the wire would show [0, 1, 2] in the second
