"""Per-worker routing (sync.transport "routed"): each worker of an engine receives only the slices
of each HF tensor that its sync plan copies (a TP2 engine's rank 1 never receives rank 0's half),
point to point from its pipeline stage's leader.

The one idea: the engine publishes its workers' *routes* once (publish_routes); per bucket the
leader packs each distinct route's slices into one buffer (pack_routed) and sends it over a gloo
group of its own with that engine's workers (LeaderGroup), while the header still goes over the
channel; each worker checks and copies what it receives (WorkerGroups.receive). Routing works
where the engine's workers reach the leader over TCP, on this node or another: what an engine
spanning nodes needs, since its workers cannot map one node's /dev/shm. Step by step, the
failures and the tests: docs/sync-routing.md.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from mrl.sync.wire import Bucket, SyncError, bucket_checksums, checksums_match, error_key, pack, packed_layout, unpack

Route = dict[str, list[list[list[int]]]]  # per HF name, the boxes ([[start, stop] per dim]) one worker needs


def routes_key(token: str) -> str:
    """Where an engine's routes (or its refusal) wait in the hub's store."""
    return f"mrl/routes/{token}"


def routes_from_plan(copies: Iterable[Any]) -> Route:
    """One worker's route: the distinct HF boxes of its plan's copies (mrl.sync.plan.Copy), by name."""
    route: Route = {}
    for c in copies:
        if c.hf_name is None:  # padding: nothing travels
            continue
        boxes = route.setdefault(c.hf_name, [])
        box = [list(b) for b in c.hf_box]
        if box not in boxes:
            boxes.append(box)
    return route


def publish_routes(store: Any, token: str, engine: Any) -> None:
    """The engine's routes, per worker, or why it takes no routed buckets, under routes_key(token) in
    the hub's store, once per hub: per worker (TP rank), per HF name, the distinct boxes of that
    tensor its plan copies (routes_from_plan)."""
    routes = getattr(engine, "routes", None)
    try:
        value = {"workers": routes()} if routes is not None else {
            "refused": f"{type(engine).__name__} takes no routed buckets (its workers do not receive slices)"}
    except Exception as err:  # noqa: BLE001 - e.g. an engine applying by load_weights: the sender says why
        value = {"refused": f"{type(err).__name__}: {err}"}
    store.set(routes_key(token), json.dumps(value))


def read_routes(store: Any, token: str, sync_id: str, who: str, timeout_s: float) -> list[Route] | None:
    """An engine's routes, waiting as long as `timeout_s` for it to publish them; None when an
    engine of the sync posted its error meanwhile (the sender stops sending). A refusal is raised."""
    key, deadline = routes_key(token), time.monotonic() + timeout_s
    while not look(store, key, who):
        if look(store, error_key(sync_id), who):
            return None
        if time.monotonic() > deadline:
            raise SyncError(f"{who}: the engine did not publish its routes (sync.transport routed) within "
                            f"{timeout_s:.0f}s")
        time.sleep(0.05)
    value = json.loads(store.get(key))
    if "refused" in value:
        raise SyncError(f"{who}: sync.transport routed needs every engine to apply in place "
                        f"(sync.apply: in_place on a vLLM engine); this engine refused: {value['refused']}")
    return value["workers"]


def _fits(box: list[list[int]], shape: torch.Size) -> bool:
    return len(box) == len(shape) and all(0 <= a <= b <= n for (a, b), n in zip(box, shape))


def pack_routed(bucket: Bucket, route: Route, dtype: torch.dtype,
                out: Callable[[int], torch.Tensor] | None = None) -> tuple[dict, torch.Tensor]:
    """One worker's slices of a bucket, packed (mrl.sync.wire.pack: cast, with a checksum each)
    into `out(size)` if given, else a fresh buffer; each entry gains its HF `box`. A box that does
    not fit the tensor that came (a model other than the engine's) is left out: the worker names
    the tensor by its shape. The leader packs once per distinct route, and announces the bucket
    on the channel as ever: the header carries each worker's slice entries, no bytes follow there."""
    slices, boxes = [], []
    for name, tensor in bucket:
        for box in route.get(name, ()):
            if _fits(box, tensor.shape):
                slices.append((name, tensor[tuple(slice(a, b) for a, b in box)]))
                boxes.append(box)
    header, flat = pack(slices, dtype, out=out(packed_layout(slices, dtype)[1]) if out else None)
    for entry, box in zip(header["tensors"], boxes):
        entry["box"] = box
    return header, flat


class LeaderGroup:
    """A leader's routed group with one engine's workers (the leader member 0, worker r member
    1 + r), made when the first routed bucket of its channel is sent and kept with the channel (its
    prefix is the channel's: a new channel means a new group). One group per engine: a group
    spanning engines deadlocked a fan-out of PP stages (each engine joins the stages' groups in the
    order their buckets reach it)."""

    def __init__(self, group: Any, prefix: str):
        self.group, self.prefix = group, prefix

    @staticmethod
    def make(store: Any, hub: tuple[str, int], prefix: str, size: int, sync_id: str, who: str,
             timeout_s: float) -> LeaderGroup | None:
        """Meet the engine's workers, who join as they load the bucket just announced; None when
        an engine posted its error meanwhile (its workers may never come). The rendezvous goes
        over a connection of its own to the hub's store: a TCPStore client runs one operation at a
        time, and `store`'s looks for the error would wait behind the rendezvous's wait."""
        def rendezvous() -> LeaderGroup:
            try:
                own = dist.TCPStore(hub[0], hub[1], is_master=False, timeout=timedelta(seconds=timeout_s))
                group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, own), 0, size, timedelta(seconds=timeout_s))
            except RuntimeError as err:
                raise SyncError(f"{who}: the engine's workers did not join the routed group {prefix!r} within "
                                f"{timeout_s:.0f}s: {err}") from err
            return LeaderGroup(group, prefix)

        return watching(rendezvous, store, sync_id, f"{who}: meeting the workers of {prefix!r}", timeout_s)

    def send(self, buffers: list[tuple[int, torch.Tensor]]) -> list[Any]:
        """Post every (member, buffer) send at once; the caller waits on them (wait_sends)."""
        return [self.group.send([flat], member, 0) for member, flat in buffers if flat.numel()]


def wait_sends(works: list[Any], store: Any, sync_id: str, what: str, timeout_s: float) -> bool:
    """Wait for posted sends, all within one `timeout_s`; False once an engine posted its error."""
    deadline = time.monotonic() + timeout_s

    def wait() -> bool:
        try:
            for work in works:
                work.wait(timedelta(seconds=max(0.1, deadline - time.monotonic())))
        except RuntimeError as err:
            raise SyncError(f"{what} failed or timed out after {timeout_s:.0f}s: {err}") from err
        return True

    return watching(wait, store, sync_id, what, timeout_s) is not None


def watching(step: Callable[[], Any], store: Any, sync_id: str, what: str, timeout_s: float) -> Any:
    """`step`'s result, or None once an engine posted its error in the hub's store (looked at every
    0.1 s): the leader then stops waiting for workers that will never come, and tells every engine
    (the end marker's abort). `step` runs on a thread of its own, left behind if abandoned (it ends
    within its own timeout): a gloo send cannot be polled (is_completed stays False until wait), nor
    waited on again after a wait that timed out, and a rendezvous cannot be interrupted."""
    done, out = threading.Event(), {}

    def run() -> None:
        try:
            out["value"] = step()
        except BaseException as err:  # noqa: BLE001 - raised below
            out["error"] = err
        finally:
            done.set()

    threading.Thread(target=run, name="mrl-routed-wait", daemon=True).start()
    deadline = time.monotonic() + timeout_s + 5.0
    while not done.wait(0.1):
        if look(store, error_key(sync_id), what):
            return None
        if time.monotonic() > deadline:
            raise SyncError(f"{what}: did not end within {timeout_s + 5.0:.0f}s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def look(store: Any, key: str, who: str) -> bool:
    """Whether `key` is in the hub's store (a look, not a wait), e.g. an engine's posted error."""
    try:
        return store.check([key])
    except (RuntimeError, OSError) as err:  # the hub's process is gone
        raise SyncError(f"{who}: the hub's weight-sync store stopped answering: {err}") from err


class WorkerGroups:
    """A worker's routed groups, one per channel (pipeline stage), kept while the channel is: a
    header naming another hub or prefix for a stage means the leader made a new channel. A failure
    drops the stage's group and the hub's store connection: the next sync makes both anew. Each
    worker receives inside the engine's call for that bucket (receive, called by
    mrl.rollout.vllm_weights._recv_routed), checks every slice's checksum against the sender's, and
    copies the slices into its parameters."""

    def __init__(self):
        self.lock = threading.Lock()
        self.stores: dict[tuple[str, int], Any] = {}
        self.groups: dict[int, tuple[tuple, Any]] = {}
        # Every bucket is received here (grown as needed). One receive at a time: the engine calls
        # its workers for one bucket after the other (collective_rpc from one thread).
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def _group(self, header: dict, member: int, timeout_s: float, who: str) -> Any:
        host, port = header["hub"]
        stage, key = header["stage"], (host, port, header["group"])
        kept = self.groups.pop(stage, None)
        if kept is not None and kept[0] == key:
            self.groups[stage] = kept
            return kept[1]
        try:
            if (host, port) not in self.stores:
                self.stores[(host, port)] = dist.TCPStore(host, port, is_master=False,
                                                          timeout=timedelta(seconds=timeout_s))
            group = dist.ProcessGroupGloo(dist.PrefixStore(header["group"], self.stores[(host, port)]), member,
                                          header["members"], timedelta(seconds=timeout_s))
        except RuntimeError as err:
            self.stores.pop((host, port), None)
            raise SyncError(f"{who}: could not join the routed group {header['group']!r} at the hub {host}:{port} "
                            f"within {timeout_s:.0f}s: {err}") from err
        self.groups[stage] = key, group
        return group

    def receive(self, header: dict, mine: dict, timeout_s: float,
                who: str) -> tuple[list[tuple[str, tuple, torch.Tensor, tuple]], list[str]]:
        """This worker's slices of a routed bucket (`mine`: its entry of the header): per slice its
        HF name, its box, a view of the received buffer (valid until the next receive: copy what is
        kept) and the checksum of what arrived; and the names of the tensors with a slice that
        arrived different from what was sent."""
        with self.lock:
            group = self._group(header, mine["member"], timeout_s, who)
            if self.buffer.numel() < mine["nbytes"]:  # one buffer for every bucket: no fresh pages each time
                self.buffer = torch.empty(0, dtype=torch.uint8)
                self.buffer = torch.empty(mine["nbytes"], dtype=torch.uint8)
            flat = self.buffer[: mine["nbytes"]]
        if mine["nbytes"]:
            try:
                group.recv([flat], 0, 0).wait(timedelta(seconds=timeout_s))
            except RuntimeError as err:
                with self.lock:  # the leader is gone or gave up: rejoin next time, into a new buffer
                    self.groups.pop(header["stage"], None)
                    self.stores.pop(tuple(header["hub"]), None)
                    self.buffer = torch.empty(0, dtype=torch.uint8)
                raise SyncError(f"{who}: receiving its slices of bucket {header['index']} failed or timed out "
                                f"after {timeout_s:.0f}s: {err}") from err
        entries = mine["tensors"]
        sums = bucket_checksums(entries, flat)
        bad = sorted({e["name"] for e, held in zip(entries, sums) if not checksums_match(held, tuple(e["checksum"]))})
        return [(e["name"], tuple(tuple(b) for b in e["box"]), tensor, held)
                for e, (_, tensor), held in zip(entries, unpack(mine, flat), sums)], bad


WORKER_GROUPS = WorkerGroups()  # this process's (a vLLM worker's, or the engine's own with one worker)
