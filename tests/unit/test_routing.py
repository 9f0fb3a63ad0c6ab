"""sync.transport routed, its pieces in one process: routes from a plan, packing a worker's slices,
and a worker receiving them from a leader over a real gloo group (two threads)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from mrl.sync.plan import Copy
from mrl.sync.routing import LeaderGroup, WorkerGroups, pack_routed, routes_from_plan


def test_a_route_is_the_distinct_boxes_of_the_plans_copies():
    copies = [Copy("q", ((0, 4), (0, 8)), "qkv", ((0, 4), (0, 8))),
              Copy("q", ((0, 4), (0, 8)), "qkv_again", ((0, 4), (0, 8))),  # the same slice twice: sent once
              Copy("k", ((2, 4), (0, 8)), "qkv", ((4, 6), (0, 8))),
              Copy(None, ((0, 0),), "padding", ((6, 8), (0, 8)))]
    assert routes_from_plan(copies) == {"q": [[[0, 4], [0, 8]]], "k": [[[2, 4], [0, 8]]]}


def _leader_and_worker(bucket, route, corrupt: bool = False):
    """Send `route`'s slices of `bucket` from a leader thread to a worker (this thread)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    header, flat = pack_routed(bucket, route, torch.float32)
    if corrupt:  # what the leader claims it sent differs from what travels
        header["tensors"][0]["checksum"] = [header["tensors"][0]["checksum"][0] + 1.0, 0.0]
    mine = {**header, "member": 1}
    errors = []

    def leader():
        try:
            group = LeaderGroup.make(store, ("127.0.0.1", store.port), "s/channel0/engine0", 2, "s", "leader", 30)
            for work in group.send([(1, flat)]):
                work.wait(timedelta(seconds=30))
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=leader)
    thread.start()
    routed = {"stage": 0, "index": 0, "group": "s/channel0/engine0", "members": 2, "hub": ["127.0.0.1", store.port]}
    slices, bad = WorkerGroups().receive(routed, mine, 30, "worker 0")
    thread.join(30)
    assert not errors, errors
    return slices, bad


def test_a_worker_receives_exactly_its_slices_cast_and_checked():
    w = torch.arange(48, dtype=torch.float64).view(6, 8)
    norm = torch.arange(5, dtype=torch.float64)
    bucket = [("w", w), ("norm", norm), ("other", torch.ones(3))]
    route = {"w": [[[2, 4], [0, 8]], [[0, 6], [6, 8]]], "norm": [[[0, 5]]]}  # "other" is not this worker's
    slices, bad = _leader_and_worker(bucket, route)
    assert not bad
    got = {(name, box): tensor for name, box, tensor, _ in slices}
    assert set(got) == {("w", ((2, 4), (0, 8))), ("w", ((0, 6), (6, 8))), ("norm", ((0, 5),))}
    assert torch.equal(got[("w", ((2, 4), (0, 8)))], w[2:4].float())  # cast to the engine's dtype
    assert torch.equal(got[("w", ((0, 6), (6, 8)))], w[:, 6:].float())  # a strided column block
    assert torch.equal(got[("norm", ((0, 5),))], norm.float())


def test_a_slice_that_arrives_different_is_named():
    _, bad = _leader_and_worker([("w", torch.randn(4, 4))], {"w": [[[0, 2], [0, 4]]]}, corrupt=True)
    assert bad == ["w"]


def test_a_box_that_does_not_fit_the_tensor_is_left_out():
    """A model other than the engine's: the worker names the tensor by its shape, not the sender
    by an index error."""
    header, _ = pack_routed([("w", torch.zeros(3))], {"w": [[[0, 4]]]}, torch.float32)
    assert header["tensors"] == [] and header["nbytes"] == 0


def test_a_leader_that_never_comes_times_out_naming_the_group():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    routed = {"stage": 0, "index": 3, "group": "s/channel0/engine0", "members": 2, "hub": ["127.0.0.1", store.port]}
    with pytest.raises(Exception, match="worker 0: could not join the routed group 's/channel0/engine0'"):
        WorkerGroups().receive(routed, {"member": 1, "nbytes": 4, "tensors": []}, 2, "worker 0")
