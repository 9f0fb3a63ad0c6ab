"""The weight sync without vLLM: what the engine receives, and how failures surface.

The engine side runs in its own process around a recording fake engine, so these tests need
neither vLLM nor Ray; the trainer side is the real Megatron export (tiny Qwen3, TP1 or PP2).
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import re
import time

import pytest
import torch

from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import WorkerError, process_context, run_local
from mrl.sync.wire import WeightUpdateReport
from mrl.sync.parity import ParityError, check_parity, logprob_gap
from mrl.sync import SyncEndpoint, WeightReceiver
from mrl.sync.wire import WeightLoadError, tensor_checksum

# An error heard "at once": well under the waits' 60 s timeout, generous for a slow, loaded machine.
AT_ONCE_S = 30


class RecordingEngine:
    """Holds what it is sent. `holds` optionally alters what it keeps; `die_at` exits mid-sync;
    `fail_on` raises (as VLLMEngine does: WeightLoadError naming the tensor) when that tensor arrives."""

    dtype = torch.float32

    def __init__(self, holds: str = "same", die_at: int | None = None, fail_on: str | None = None,
                 quantization: str | None = None, fail_in_update: int | None = None):
        self.holds, self.die_at, self.fail_on, self.buckets = holds, die_at, fail_on, 0
        self.fail_in_update, self.updates = fail_in_update, 0  # fail_on in that update only (1: the first)
        self.quantization = quantization  # declared to the sender: "fp8" asks for DeepSeek's block FP8
        self.digests: dict[str, str] = {}  # every byte received, per tensor

    def begin_weight_update(self):
        self.report = WeightUpdateReport()
        self.updates += 1

    def load_weights(self, bucket):
        if self.buckets == self.die_at:
            os._exit(3)
        self.buckets += 1
        for name, tensor in bucket:
            if name == self.fail_on and self.fail_in_update in (None, self.updates):
                raise WeightLoadError(name, "RuntimeError: The size of tensor a (64) must match the size of tensor b (32)")
            kept = tensor.to(torch.bfloat16).float() if self.holds == "bf16" and name.endswith("o_proj.weight") else tensor
            self.report.checksums[name] = tensor_checksum(kept)
            self.digests[name] = hashlib.sha256(kept.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            self.report.tensors += 1

    def finish_weight_update(self):
        return self.report


class MappingEngine(RecordingEngine):
    """Loads as vLLM's workers do (VLLMEngine.load_shared): each bucket mapped anew from its header
    by path or handle, as another process would, not from the receiver's view. `calls`: a file
    that gets a line per bucket loaded this way (the update's number and the bucket's path)."""

    def __init__(self, calls: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.calls = calls

    def load_shared(self, header, flat):
        from mrl.sync.wire import shared_bytes, unpack

        if self.calls:
            with open(self.calls, "a") as f:
                f.write(f"{self.updates} {header['shm']}\n")
        self.load_weights(unpack(header, shared_bytes(header)))


class RoutedEngine(RecordingEngine):
    """Takes routed buckets (sync.transport routed) as a TP2 vLLM engine does (VLLMEngine.load_routed):
    two workers (threads here, each with its own groups), worker w wanting the w-th half of the
    rows of every tensor with an even number of them, and all of the others. Each tensor is put
    together again from the halves; `received` counts the bytes each worker received."""

    def __init__(self, hf_dir: str, never_join: bool = False, **kwargs):
        from mrl.sync.plan import hf_metadata
        from mrl.sync.routing import WorkerGroups

        super().__init__(**kwargs)
        self.never_join = never_join  # as if the workers could not reach the hub: they never receive
        self.shapes = {name: meta["shape"] for name, meta in hf_metadata(hf_dir).items()}
        self.workers = [WorkerGroups(), WorkerGroups()]
        self.received = [0, 0]

    def begin_weight_update(self):
        super().begin_weight_update()
        self.received = [0, 0]

    def routes(self):
        def box(shape, w):
            rows = shape[0] // 2 if shape[0] % 2 == 0 else None
            return [[w * rows, (w + 1) * rows] if rows else [0, shape[0]]] + [[0, n] for n in shape[1:]]

        return [{name: [box(shape, w)] for name, shape in self.shapes.items()} for w in range(2)]

    def load_routed(self, header):
        import threading

        from mrl.sync.wire import payload_bytes

        if self.buckets == self.die_at:
            os._exit(3)
        if any(e["name"] == self.fail_on for e in header["tensors"]) and self.fail_in_update in (None, self.updates):
            raise WeightLoadError(self.fail_on, "RuntimeError: The size of tensor a (64) must match the size of tensor b (32)")
        if self.never_join:
            return
        got: list = [None, None]

        def worker(w):
            got[w] = self.workers[w].receive(header, header["workers"][w], 60, f"worker {w}")

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        whole = {e["name"]: torch.zeros(e["shape"]) for e in header["tensors"]}
        for w, (slices, mismatched) in enumerate(got):
            assert not mismatched, mismatched
            self.received[w] += payload_bytes(header["workers"][w])
            for name, box, tensor, _ in slices:
                whole[name][tuple(slice(a, b) for a, b in box)] = tensor
        self.load_weights(list(whole.items()))


def _engine_process(endpoints, results, engine_kwargs, channels, delay_s, fanout=(1, 0, None), sync_id="sync0"):
    if engine_kwargs.pop("shm_full", False):  # as if /dev/shm had no room for a bucket (Docker's 64 MB)
        import mrl.sync.receiver

        mrl.sync.receiver._shm_has_room = lambda nbytes: False
    kind = RoutedEngine if "hf_dir" in engine_kwargs else MappingEngine if engine_kwargs.pop("maps", False) else RecordingEngine
    engine = kind(**engine_kwargs)
    receiver = WeightReceiver(engine, timeout_s=60)
    endpoints.put(receiver.endpoint)
    time.sleep(delay_s)
    for one in sync_id if isinstance(sync_id, tuple) else (sync_id,):  # a tuple: one update after the other
        try:
            report = receiver.receive(one, channels, *fanout)
            kept = (sorted(channel.prefix for channel in receiver._kept.values()),) if isinstance(sync_id, tuple) else ()
            routed = (list(engine.received),) if isinstance(engine, RoutedEngine) else ()
            results.put(("ok", report.tensors, report.mismatched, report.checksums, engine.digests) + kept + routed)
        except Exception as err:  # noqa: BLE001
            results.put(("error", str(err)))


def _start_engine(channels=1, delay_s=0.0, fanout=(1, 0, None), sync_id="sync0", **engine_kwargs):
    ctx = process_context()  # forked from the ranks' server, which imported torch once (not a fresh interpreter)
    endpoints, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_engine_process, args=(endpoints, results, engine_kwargs, channels, delay_s, fanout,
                                                     sync_id))
    proc.start()
    return proc, endpoints.get(timeout=60), results


def _start_engines(count, channels, sync_id, **engine_kwargs_by_index):
    """Engine 0 (the hub) and engines 1.. joining it, each in its own process; kwargs per index ("e1": {...})."""
    engines = [_start_engine(channels, fanout=(count, 0, None), sync_id=sync_id, **engine_kwargs_by_index.get("e0", {}))]
    hub = engines[0][1]
    engines += [_start_engine(channels, fanout=(count, i, hub), sync_id=sync_id, **engine_kwargs_by_index.get(f"e{i}", {}))
                for i in range(1, count)]
    return engines


def _sender(hf_dir, layout, endpoint, transport, timeout_s, **kwargs):
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import initialize_layout
    from mrl.models.registry import model_spec_from_hf
    from mrl.sync.sender import WeightSender

    coords = initialize_layout(layout)
    built = build_model(model_spec_from_hf(hf_dir), layout)
    load_hf_weights(built, coords, hf_dir)
    return WeightSender(endpoint, built, coords, transport=transport, bucket_bytes=256 << 10, timeout_s=timeout_s,
                        **kwargs)


def _push(rank, world, hf_dir, layout, endpoint, transport, timeout_s, sync_id="sync0"):
    sent = _sender(hf_dir, layout, endpoint, transport, timeout_s).push(sync_id)
    return None if sent is None else sent.checksums


@pytest.mark.parametrize("transport,layout", [("colocated", ParallelLayout()), ("broadcast", ParallelLayout(pp=2))])
def test_engine_receives_every_tensor_intact(tiny_model_dir, transport, layout):
    from mrl.bridge.hf_checkpoint import HFCheckpoint

    hf_dir = tiny_model_dir("qwen3")
    proc, endpoint, results = _start_engine(channels=layout.pp)
    sent = run_local(_push, layout.min_world_size(), str(hf_dir), layout, endpoint, transport, 60)
    status, tensors, mismatched, held, _ = results.get(timeout=60)
    proc.join(timeout=10)
    assert status == "ok" and not mismatched
    sent_all = {k: v for s in sent if s for k, v in s.items()}
    ckpt = HFCheckpoint(hf_dir)
    assert set(held) == set(sent_all) == set(ckpt.names())  # tied/padded rows never travel twice
    for name in ckpt.names():  # what arrived is the checkpoint, bit for bit
        assert held[name] == tensor_checksum(ckpt.read(name).float()), name


def _push_colocated(rank, world, hf_dir, layout, endpoint):
    sender = _sender(hf_dir, layout, endpoint, "colocated", 60)
    sender.push("sync0")
    return sender.writes_shared


@pytest.mark.parametrize("arch,layout", [("qwen3", ParallelLayout(tp=2)), ("qwen3", ParallelLayout(pp=2)),
                                         ("deepseek_v3", ParallelLayout(tp=2, ep=2))],
                         ids=["TP2", "PP2", "TP2xEP2 MLA"])
def test_colocated_every_rank_writes_its_shards_into_the_shared_bucket(tiny_model_dir, arch, layout):
    """Colocated with a CPU engine, every rank writes its own shards into the leader's /dev/shm
    bucket (no gather): the engine, mapping each bucket by path, holds the checkpoint bit for bit,
    and no bucket file is left. (The gathered, packed path: the FP8 test below, colocated TP2.)"""
    from mrl.bridge.hf_checkpoint import HFCheckpoint

    hf_dir = tiny_model_dir(arch)
    proc, endpoint, results = _start_engine(maps=True)
    shared = run_local(_push_colocated, layout.min_world_size(), str(hf_dir), layout, endpoint)
    status, tensors, mismatched, held, digests = results.get(timeout=60)
    proc.join(timeout=10)
    assert status == "ok" and not mismatched
    assert shared == [True] * layout.min_world_size()  # every rank took the shared path
    ckpt = HFCheckpoint(hf_dir)
    assert set(digests) == set(ckpt.names())
    for name in ckpt.names():
        assert digests[name] == hashlib.sha256(ckpt.read(name).float().contiguous().view(torch.uint8).numpy()
                                               .tobytes()).hexdigest(), name
    assert not glob.glob(f"/dev/shm/mrl-sync-{endpoint.port}-*")


@pytest.mark.parametrize("shm_full", [False, True], ids=["room in /dev/shm", "no room"])
def test_off_the_wire_an_engine_that_maps_gets_a_file_of_its_own_when_there_is_room(tiny_model_dir, tmp_path,
                                                                                   shm_full):
    """Broadcast, to an engine whose loading processes map buckets themselves: each bucket is
    received into a /dev/shm file of the engine's own (unlinked once loaded) when /dev/shm has
    room, else into the engine's memory and loaded as it is; intact either way."""
    from mrl.bridge.hf_checkpoint import HFCheckpoint

    hf_dir, calls = tiny_model_dir("qwen3"), tmp_path / "calls"
    proc, endpoint, results = _start_engine(maps=True, calls=str(calls), shm_full=shm_full)
    run_local(_push, 1, str(hf_dir), ParallelLayout(), endpoint, "broadcast", 60)
    status, tensors, mismatched, held, _ = results.get(timeout=60)
    proc.join(timeout=10)
    assert status == "ok" and not mismatched
    ckpt = HFCheckpoint(hf_dir)
    assert {n: held[n] for n in ckpt.names()} == {n: tensor_checksum(ckpt.read(n).float()) for n in ckpt.names()}
    files = [line.split()[1] for line in calls.read_text().splitlines()] if calls.exists() else []
    assert (not files) if shm_full else len(set(files)) == len(files) > 0  # a file a bucket, or none
    assert all("/mrl-recv-" in f for f in files)
    assert not any(os.path.exists(f) for f in files)


def test_an_fp8_engine_receives_block_fp8_of_the_weights(tiny_model_dir):
    """An engine that holds DeepSeek's FP8 format gets each bucket quantised on the way (TP2: the
    export assembles whole tensors first): FP8 weights and float32 block scales, bit for bit those
    of quantising the checkpoint, and every other tensor as before."""
    from mrl.bridge.hf_checkpoint import HFCheckpoint
    from mrl.quant.fp8 import FP8, SCALE_SUFFIX, quantize_pairs

    hf_dir = tiny_model_dir("deepseek_v3")
    proc, endpoint, results = _start_engine(quantization="fp8")
    assert endpoint.quantization == "fp8"
    run_local(_push, 2, str(hf_dir), ParallelLayout(tp=2), endpoint, "colocated", 60)
    status, tensors, mismatched, held, digests = results.get(timeout=60)
    proc.join(timeout=10)
    assert status == "ok" and not mismatched
    ckpt = HFCheckpoint(hf_dir)
    expected = dict(quantize_pairs((n, ckpt.read(n).float()) for n in ckpt.names()))
    fp8 = [n for n, t in expected.items() if t.dtype == FP8]
    assert fp8 and all(n + SCALE_SUFFIX in digests for n in fp8)  # the linear projections, with their scales
    assert set(digests) == set(expected)
    for name, tensor in expected.items():
        assert digests[name] == hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest(), name


def _push_until_error(rank, world, hf_dir, layout, endpoint, transport, timeout_s, sync_id="sync0"):
    """Push, expecting the engine to fail: (seconds the push took, its SyncError) on each leader."""
    from mrl.sync.wire import SyncError

    sender = _sender(hf_dir, layout, endpoint, transport, timeout_s)
    start = time.monotonic()
    try:
        sent = sender.push(sync_id)
    except SyncError as err:
        return time.monotonic() - start, str(err)
    return None if sent is None else (0.0, "no error")


@pytest.mark.parametrize("transport,layout", [("colocated", ParallelLayout()), ("colocated", ParallelLayout(tp=2)),
                                              ("broadcast", ParallelLayout(pp=2))])
def test_engine_load_error_reaches_every_sender_at_once(tiny_model_dir, transport, layout):
    """The engine fails on a stage-0 tensor: every leader hears its message and the tensor within
    seconds (the waits' own timeout is 60 s), and the engine's receive raises the same."""
    bad = "model.layers.1.mlp.down_proj.weight"
    proc, endpoint, results = _start_engine(channels=layout.pp, fail_on=bad)
    outcomes = [r for r in run_local(_push_until_error, layout.min_world_size(), str(tiny_model_dir("qwen3")),
                                     layout, endpoint, transport, 60) if r is not None]
    status, message = results.get(timeout=60)
    proc.join(timeout=10)
    assert len(outcomes) == layout.pp  # one leader per channel
    expected = rf"failed while loading '{re.escape(bad)}': RuntimeError: The size of tensor a \(64\) must match"
    for seconds, error in outcomes:
        assert re.search(rf"rank \d \(PP stage \d\): the weight update failed: the engine at .+ {expected}", error), error
        assert seconds < AT_ONCE_S, (seconds, error)
    assert status == "error" and re.search(expected, message), message
    assert not glob.glob(f"/dev/shm/mrl-sync-{endpoint.port}-*")  # the failed sync's buckets are gone


def test_engine_holding_other_values_is_named(tiny_model_dir):
    proc, endpoint, results = _start_engine(holds="bf16")
    run_local(_push, 1, str(tiny_model_dir("qwen3")), ParallelLayout(), endpoint, "broadcast", 60)
    status, _, mismatched, _, _ = results.get(timeout=60)
    proc.join(timeout=10)
    assert status == "ok"
    assert mismatched and mismatched[0] == "model.layers.0.self_attn.o_proj.weight"
    report = WeightUpdateReport(tensors=10, mismatched=mismatched)
    with pytest.raises(ParityError, match=r"first tensor that arrived different .* 'model\.layers\.0\.self_attn\.o_proj\.weight'"):
        check_parity({"rollout/logprob_abs_diff_mean": 0.1, "rollout/logprob_abs_diff_max": 0.5}, 1e-3, report, step=7)


def test_dead_engine_is_an_error_not_a_hang(tiny_model_dir):
    proc, endpoint, _ = _start_engine(die_at=1)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 0 \(PP stage 0\) .*(bucket \d+|end marker|finish loading)"):
        run_local(_push, 1, str(tiny_model_dir("qwen3")), ParallelLayout(), endpoint, "broadcast", 30)
    assert time.monotonic() - start < 60
    proc.join(timeout=10)
    assert proc.exitcode == 3


def test_engine_that_never_listens_times_out_naming_the_channel(tiny_model_dir):
    proc, endpoint, results = _start_engine(delay_s=40)  # receives only after the sender's timeout
    try:
        with pytest.raises(WorkerError, match=r"rank 0 \(PP stage 0\).* did not join channel 'sync0/channel0' within 5s"):
            run_local(_push, 1, str(tiny_model_dir("qwen3")), ParallelLayout(), endpoint, "broadcast", 5)
    finally:
        proc.kill()


def test_unreachable_engine(tiny_model_dir):
    endpoint = SyncEndpoint("127.0.0.1", 1, "torch.float32")  # nothing listens on port 1
    with pytest.raises(WorkerError, match="cannot reach the engine's weight-sync store"):
        run_local(_push, 1, str(tiny_model_dir("qwen3")), ParallelLayout(), endpoint, "broadcast", 3)


def test_parity_gate():
    gap = logprob_gap([[-1.0, -2.0]], [[-1.0, -2.5]])
    assert gap == {"rollout/logprob_abs_diff_mean": 0.25, "rollout/logprob_abs_diff_max": 0.5}
    check_parity(gap, 0.5, WeightUpdateReport(tensors=3), step=1)  # at the threshold: passes
    with pytest.raises(ParityError, match="never reached engine parameter 'lm_head.weight'"):
        check_parity(gap, 0.1, WeightUpdateReport(tensors=3, not_updated=["lm_head.weight"]), step=1)
    with pytest.raises(ParityError, match="All 3 tensors arrived intact"):
        check_parity(gap, 0.1, WeightUpdateReport(tensors=3), step=1)
    with pytest.raises(ValueError, match="probe batches differ"):
        logprob_gap([[-1.0]], [[-1.0, -2.0]])


def test_port_that_accepts_but_never_answers_times_out(tiny_model_dir):
    """An engine died and its port was reused by something that is no weight-sync store: TCPStore's
    connect would wait for its reply forever; the handshake gives up after its timeout."""
    import socket

    with socket.socket() as listener:  # the kernel completes connections into the backlog: no reply ever
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        endpoint = SyncEndpoint("127.0.0.1", listener.getsockname()[1], "torch.float32", token="x")
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"rank 0 \(PP stage 0\).* the port accepted a connection but no "
                                              r"weight-sync store answered within 13s: .*restart the engine"):
            run_local(_push, 1, str(tiny_model_dir("qwen3")), ParallelLayout(), endpoint, "broadcast", 4)
        assert time.monotonic() - start < 60


def test_store_of_another_engine_is_refused(tiny_model_dir):
    """A restarted engine got the old one's port: its token differs, and the sender says so."""
    proc, endpoint, _ = _start_engine()
    try:
        stale = SyncEndpoint(endpoint.host, endpoint.port, endpoint.dtype, token="an-earlier-engine")
        with pytest.raises(WorkerError, match=r"belongs to another engine .*ask it for its endpoint again"):
            run_local(_push, 1, str(tiny_model_dir("qwen3")), ParallelLayout(), stale, "broadcast", 10)
    finally:
        proc.kill()


# --- fan-out: one export, two engines ----------------------------------------------------------

FANOUT_CASES = [(t, layout, False) for t in ("colocated", "broadcast") for layout in (ParallelLayout(tp=2), ParallelLayout(pp=2))]
# Engines whose loading processes map each bucket themselves (vLLM's workers): the sender's file
# must outlive their mapping (colocated), and bytes off the wire go into a file of the engine's own.
FANOUT_CASES += [("colocated", ParallelLayout(tp=2), True), ("broadcast", ParallelLayout(pp=2), True)]


@pytest.mark.parametrize("transport,layout,maps", FANOUT_CASES,
                         ids=lambda c: getattr(c, "describe", lambda: {True: "maps", False: "views"}.get(c, c))())
def test_two_engines_receive_identical_bytes_from_one_export(tiny_model_dir, transport, layout, maps):
    """One push, two engines: each holds the checkpoint bit for bit (the same SHA-256 per tensor on
    both), and no shared-memory file is left behind."""
    from mrl.bridge.hf_checkpoint import HFCheckpoint
    from mrl.sync.channel import channel_count

    hf_dir = tiny_model_dir("qwen3")
    sync_id = f"fanout-{transport}-{layout.describe()}-{maps}-{os.getpid()}"
    before = set(glob.glob("/dev/shm/mrl-recv-*"))
    each = {"maps": maps}
    engines = _start_engines(2, channel_count(transport, layout.pp), sync_id, e0=each, e1=each)
    endpoints = [e[1] for e in engines]
    sent = run_local(_push, layout.min_world_size(), str(hf_dir), layout, endpoints, transport, 60, sync_id)
    outcomes = [results.get(timeout=60) for _, _, results in engines]
    for proc, _, _ in engines:
        proc.join(timeout=10)
    ckpt = HFCheckpoint(hf_dir)
    sent_all = {k: v for s in sent if s for k, v in s.items()}
    for status, tensors, mismatched, held, _ in outcomes:
        assert status == "ok" and not mismatched and tensors == len(sent_all)
        assert set(held) == set(sent_all) == set(ckpt.names())
        for name in ckpt.names():
            assert held[name] == tensor_checksum(ckpt.read(name).float()), name
    assert outcomes[0][4] == outcomes[1][4]  # identical bytes in both engines
    assert not glob.glob(f"/dev/shm/mrl-sync-{sync_id}-*")  # every bucket's file unlinked
    assert set(glob.glob("/dev/shm/mrl-recv-*")) <= before  # and every engine's own


def test_error_in_engine_1_reaches_every_sender_naming_it(tiny_model_dir):
    """Engine 1 of 2 fails on a stage-0 tensor: both PP leaders hear engine 1's message within
    seconds, and engine 0 (which loaded everything) reports the update failed with the same error."""
    bad = "model.layers.1.mlp.down_proj.weight"
    layout = ParallelLayout(pp=2)
    engines = _start_engines(2, 2, "fanout-error", e1={"fail_on": bad})
    endpoints = [e[1] for e in engines]
    outcomes = [r for r in run_local(_push_until_error, 2, str(tiny_model_dir("qwen3")), layout, endpoints,
                                     "broadcast", 60, "fanout-error") if r is not None]
    answers = [results.get(timeout=60) for _, _, results in engines]
    for proc, _, _ in engines:
        proc.join(timeout=10)
    engine1 = f"{endpoints[1].host}:{endpoints[1].port}"
    expected = (rf"engine 1 of 2 at {re.escape(engine1)} failed while loading '{re.escape(bad)}': "
                r"RuntimeError: The size of tensor a \(64\)")
    assert len(outcomes) == 2
    for seconds, error in outcomes:
        assert re.search(rf"rank \d \(PP stage \d\): the weight update failed: {expected}", error), error
        assert seconds < AT_ONCE_S, (seconds, error)
    for status, message in answers:
        assert status == "error" and re.search(expected, message), message


def test_dead_engine_1_fails_the_push_naming_it(tiny_model_dir):
    """Engine 1 of 2 dies mid-sync: the sender fails within its timeout naming engine 1's address,
    and engine 0 does not wait forever either."""
    engines = _start_engines(2, 1, "fanout-dead", e1={"die_at": 1})
    endpoints = [e[1] for e in engines]
    engine1 = f"{endpoints[1].host}:{endpoints[1].port}"
    start = time.monotonic()
    with pytest.raises(WorkerError, match=rf"rank 0 \(PP stage 0\) .*engine 1 at {re.escape(engine1)}: gone"):
        run_local(_push, 1, str(tiny_model_dir("qwen3")), ParallelLayout(), endpoints, "broadcast", 30, "fanout-dead")
    assert time.monotonic() - start < 60
    status, message = engines[0][2].get(timeout=90)
    assert status == "error", message
    for proc, _, _ in engines:
        proc.join(timeout=10)
    assert engines[1][0].exitcode == 3


def test_each_channel_rendezvouses_without_waiting_for_the_others():
    """Stage 1's sender joins its channel while stage 0's has not come yet: the engine's channel 1
    meets it at once. (With one store connection for both channels, channel 0's wait for its
    sender blocked channel 1's rendezvous; two engines of a fan-out could then block each other.)"""
    import torch.distributed as dist
    from datetime import timedelta

    from mrl.sync.channel import Channel, offer_kept

    proc, endpoint, results = _start_engine(channels=2, sync_id="rendezvous")
    time.sleep(2.0)  # the engine's channel 0 is waiting for its sender by now
    senders = []
    for stage in (1, 0):  # stage 0 comes last
        store = dist.TCPStore(endpoint.host, endpoint.port, is_master=False, timeout=timedelta(seconds=30))
        start = time.monotonic()
        assert not offer_kept(store, "rendezvous", stage, "", 1, "test", 10)  # nothing kept: a new rendezvous
        senders.append(Channel(store, f"rendezvous/channel{stage}", 0, 10, f"sender of stage {stage}"))
        assert time.monotonic() - start < 10
    for channel in senders:
        channel.send_json({"end": True, "tensors": 0}, "sending the end marker")
    for channel in senders:  # the engine answers once every channel has ended
        assert channel.answers(None, "waiting for the answer") == [{"ok": True}]
    status, tensors, *_ = results.get(timeout=60)
    proc.join(timeout=10)
    assert status == "ok" and tensors == 0


def _push_twice(rank, world, hf_dir, layout, endpoint, transport, timeout_s, sync_ids):
    sender = _sender(hf_dir, layout, endpoint, transport, timeout_s)
    return [None if sent is None else sent.checksums for sent in map(sender.push, sync_ids)]


@pytest.mark.parametrize("transport,layout", [("colocated", ParallelLayout()), ("broadcast", ParallelLayout(pp=2))])
def test_next_push_reuses_the_channel_and_a_new_sender_makes_its_own(tiny_model_dir, transport, layout):
    """A sender's second push goes over the channel of its first (no rendezvous, no group torn
    down: ~20 ms each side); a new sender (another process) meets the engine anew. Every update
    arrives whole."""
    hf_dir = str(tiny_model_dir("qwen3"))
    proc, endpoint, results = _start_engine(channels=layout.pp, sync_id=("s1", "s2", "s3"))
    first = run_local(_push_twice, layout.min_world_size(), hf_dir, layout, endpoint, transport, 60, ["s1", "s2"])
    second = run_local(_push_twice, layout.min_world_size(), hf_dir, layout, endpoint, transport, 60, ["s3"])
    received = [results.get(timeout=60) for _ in range(3)]
    proc.join(timeout=10)
    assert [r[0] for r in received] == ["ok"] * 3 and not any(r[2] for r in received)
    sent = [{k: v for rank in pushes for k, v in (rank[i] or {}).items()} for pushes, i in
            [(first, 0), (first, 1), (second, 0)]]
    assert all(s == received[0][3] for s in sent)  # what each update sent is what the engine held
    stages = range(layout.pp if transport == "broadcast" else 1)
    kept = [r[5] for r in received]  # the channels the engine held after each update
    assert kept == [[f"{sync}/channel{stage}" for stage in stages] for sync in ("s1", "s1", "s3")]


def _push_negated_between(rank, world, hf_dir, layout, endpoint, sync_ids, transport="colocated"):
    """Push once, then every later push with this rank's weights negated (new bytes to send);
    each push's outcome: "ok", or its error."""
    from mrl.sync.wire import SyncError

    sender, out = _sender(hf_dir, layout, endpoint, transport, 60), []
    for i, sync_id in enumerate(sync_ids):
        if i == 1:
            with torch.no_grad():
                for chunk in sender.built.chunks:
                    for param in chunk.parameters():
                        param.neg_()
        try:
            sender.push(sync_id)
            out.append("ok")
        except SyncError as err:
            out.append(str(err))
        if sender.gathered is not None:  # the leader's wire buffers, as each push left them
            out.append([buffer.data_ptr() for buffer in sender.gathered.buffers])
    return sender.writes_shared, out


def test_colocated_pushes_reuse_their_bucket_files_and_a_failed_push_makes_new_ones(tiny_model_dir, tmp_path):
    """Every rank writes into the same two /dev/shm files push after push (mapped once: their
    names are gone after the first push, so nothing is left behind), and the engine, mapping each
    bucket as vLLM's workers do, holds each push's new bytes, not the last's. After a push that
    failed (the engine refused a tensor) the next makes new files, which arrive intact too."""
    from mrl.bridge.hf_checkpoint import HFCheckpoint

    hf_dir, calls, layout = tiny_model_dir("qwen3"), tmp_path / "calls", ParallelLayout(tp=2)
    ckpt = HFCheckpoint(hf_dir)
    victim = next(n for n in ckpt.names() if n.endswith("o_proj.weight"))
    proc, endpoint, results = _start_engine(maps=True, calls=str(calls), sync_id=("s1", "s2", "s3", "s4"),
                                            fail_on=victim, fail_in_update=3)
    ranks = run_local(_push_negated_between, 2, str(hf_dir), layout, endpoint, ["s1", "s2", "s3", "s4"])
    received = [results.get(timeout=60) for _ in range(4)]
    proc.join(timeout=10)
    assert [shared for shared, _ in ranks] == [True, True]
    assert ranks[0][1][:2] == ["ok", "ok"] and victim in ranks[0][1][2] and ranks[0][1][3] == "ok", ranks[0][1]
    assert [r[0] for r in received] == ["ok", "ok", "error", "ok"], received
    negated = {n: hashlib.sha256((-ckpt.read(n).float()).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
               for n in ckpt.names()}
    assert received[1][4] == negated and received[3][4] == negated  # the new bytes, each time
    paths = [[p for u, p in map(str.split, calls.read_text().splitlines()) if u == str(update)] for update in "1234"]
    assert len(paths[0]) > 2 and len(set(paths[0])) == 2  # more buckets than files: two slots
    assert paths[1] == paths[0] and set(paths[2]) <= set(paths[0])  # the same files push after push
    assert len(paths[3]) == len(paths[0]) and not set(paths[3]) & set(paths[0])  # after the failure: new ones
    assert not glob.glob(f"/dev/shm/mrl-sync-{endpoint.port}-*")


def test_a_broadcast_leader_assembles_every_push_in_the_same_two_buffers(tiny_model_dir):
    """Broadcast from CPU ranks: the leader assembles each bucket's HF tensors straight into one of
    two wire buffers (GatheredExport), the same two push after push, and the engine receives each
    push's new bytes (the weights negated after the first push), not the last push's."""
    from mrl.bridge.hf_checkpoint import HFCheckpoint

    hf_dir, layout = tiny_model_dir("qwen3"), ParallelLayout(tp=2)
    ckpt = HFCheckpoint(hf_dir)
    proc, endpoint, results = _start_engine(sync_id=("s1", "s2", "s3"))
    ranks = run_local(_push_negated_between, 2, str(hf_dir), layout, endpoint, ["s1", "s2", "s3"], "broadcast")
    received = [results.get(timeout=60) for _ in range(3)]
    proc.join(timeout=10)
    leader = ranks[0][1]
    assert [leader[i] for i in (0, 2, 4)] == ["ok"] * 3 and leader[1] == leader[3] == leader[5], leader
    assert ranks[1][1] == ["ok"] * 3  # the other rank only sends its shards: no buffers
    assert [r[0] for r in received] == ["ok"] * 3 and received[0][3] != received[1][3]
    digest = {n: hashlib.sha256(ckpt.read(n).float().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
              for n in ckpt.names()}
    negated = {n: hashlib.sha256((-ckpt.read(n).float()).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
               for n in ckpt.names()}
    assert received[0][4] == digest and received[1][4] == negated and received[2][4] == negated


def _barrier_at(rank, world, indices):
    import torch.distributed as dist

    from mrl.sync.shared_export import _Barrier
    from mrl.sync.wire import SyncError

    barrier = _Barrier(dist.group.WORLD, torch.device("cpu"), 30, f"rank {rank}")
    try:
        return barrier.wait("the test's barrier", indices[rank], word=7 if rank == 0 else 0)
    except SyncError as err:
        return str(err)


@pytest.mark.parametrize("indices", [(2, 2), (0, 3)], ids=["in step", "out of step"])
def test_the_shared_exports_barrier_passes_the_leaders_word_and_fails_ranks_out_of_step(indices):
    """Ranks at the same bucket hear the leader's word (the generation); ranks at different buckets
    (left behind by a push abandoned half-way) fail, rather than write one bucket into another's file."""
    out = run_local(_barrier_at, 2, list(indices))
    if indices[0] == indices[1]:
        assert out == [7, 7]
    else:
        assert all("different buckets" in o for o in out), out


# --- sync.transport routed: each engine worker receives only its own slices -------------------

def test_routed_workers_each_receive_only_their_own_slices(tiny_model_dir):
    """Every tensor arrives intact, put together from two workers' halves, and each worker received
    about half of the bytes (the replicated odd-row tensors go to both), not all of them. The
    second push (the weights negated) reuses the channels and both sides' buffers, and arrives
    with its new bytes. PP2: two leaders, two channels, two groups per worker. (The trainer's
    layout changes only the export, which every transport shares: TP2 costs 4× the time here.)"""
    from mrl.bridge.hf_checkpoint import HFCheckpoint

    hf_dir, layout = tiny_model_dir("qwen3"), ParallelLayout(pp=2)
    proc, endpoint, results = _start_engine(channels=layout.pp, hf_dir=str(hf_dir), sync_id=("r1", "r2"))
    ranks = run_local(_push_negated_between, layout.min_world_size(), str(hf_dir), layout, endpoint, ["r1", "r2"],
                      "routed")
    received = [results.get(timeout=60) for _ in range(2)]
    proc.join(timeout=10)
    assert all(out == ["ok", "ok"] for _, out in ranks), ranks
    ckpt = HFCheckpoint(hf_dir)
    total = sum(math.prod(ckpt.shape(name)) * 4 for name in ckpt.names())
    for sign, (status, tensors, mismatched, held, digests, kept, per_worker) in zip((1, -1), received):
        assert status == "ok" and not mismatched and set(held) == set(ckpt.names())
        for name in ckpt.names():
            tensor = sign * ckpt.read(name).float()
            assert held[name] == tensor_checksum(tensor), name
            assert digests[name] == hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        assert kept == [f"r1/channel{stage}" for stage in range(layout.pp)]  # the second push reused them
        assert all(0.4 * total < n < 0.6 * total for n in per_worker), (per_worker, total)  # bytes each received


def test_routed_fanout_two_engines_hold_identical_bytes(tiny_model_dir):
    """One routed export, two engines: one group of the leader and both engines' four workers."""
    from mrl.bridge.hf_checkpoint import HFCheckpoint

    hf_dir = tiny_model_dir("qwen3")
    each = {"hf_dir": str(hf_dir)}
    engines = _start_engines(2, 2, "fanout-routed", e0=each, e1=each)
    run_local(_push, 2, str(hf_dir), ParallelLayout(pp=2), [e[1] for e in engines], "routed", 60, "fanout-routed")
    outcomes = [results.get(timeout=60) for _, _, results in engines]
    for proc, _, _ in engines:
        proc.join(timeout=10)
    ckpt = HFCheckpoint(hf_dir)
    for status, tensors, mismatched, held, _, _ in outcomes:
        assert status == "ok" and not mismatched and set(held) == set(ckpt.names())
        for name in ckpt.names():
            assert held[name] == tensor_checksum(ckpt.read(name).float()), name
    assert outcomes[0][4] == outcomes[1][4]


@pytest.mark.parametrize("layout, bad", [(ParallelLayout(), "model.layers.1.mlp.down_proj.weight"),
                                         (ParallelLayout(pp=2), "model.embed_tokens.weight")],
                         ids=["TP1 later bucket", "PP2 first bucket"])
def test_routed_engine_error_reaches_every_sender_at_once(tiny_model_dir, layout, bad):
    """The engine fails before its workers receive a bucket: the leaders waiting for those workers
    (to receive, or in the first bucket to join their group at all) stop within seconds, not the
    60 s timeout, with the engine's message and tensor."""
    hf_dir = tiny_model_dir("qwen3")
    proc, endpoint, results = _start_engine(channels=layout.pp, hf_dir=str(hf_dir), fail_on=bad)
    outcomes = [r for r in run_local(_push_until_error, layout.min_world_size(), str(hf_dir), layout, endpoint,
                                     "routed", 60) if r is not None]
    status, message = results.get(timeout=60)
    proc.join(timeout=10)
    assert len(outcomes) == layout.pp
    for seconds, error in outcomes:
        assert f"failed while loading '{bad}'" in error and seconds < AT_ONCE_S, (seconds, error)
    assert status == "error" and bad in message


def test_routed_workers_that_never_join_fail_the_sync_naming_the_group(tiny_model_dir):
    """The engine's workers never join their group (as if they could not reach the hub): the
    leader's own wait for them ends after its timeout with that cause (not the export's wait for
    a slot, which it outlasts), and the engine hears it at once in the end marker."""
    hf_dir = tiny_model_dir("qwen3")
    proc, endpoint, results = _start_engine(hf_dir=str(hf_dir), never_join=True)
    (seconds, error), = [r for r in run_local(_push_until_error, 1, str(hf_dir), ParallelLayout(), endpoint,
                                              "routed", 8) if r is not None]
    status, message = results.get(timeout=60)
    proc.join(timeout=10)
    assert "the engine's workers did not join the routed group 'sync0/channel0/engine0' within 8s" in error, error
    assert seconds < 30, seconds
    assert status == "error" and "the sender rank 0 (PP stage 0) failed" in message and "did not join" in message


def test_routed_to_an_engine_without_routes_is_refused_naming_the_fix(tiny_model_dir):
    """The sender raises the engine's reason and the fix; the engine hears it in the end marker at
    once rather than waiting out its timeout (60 s)."""
    proc, endpoint, results = _start_engine()
    start = time.monotonic()
    outcomes = [r for r in run_local(_push_until_error, 1, str(tiny_model_dir("qwen3")), ParallelLayout(), endpoint,
                                     "routed", 60) if r is not None]
    status, message = results.get(timeout=60)
    proc.join(timeout=10)
    assert time.monotonic() - start < 30
    for error in (outcomes[0][1], message):
        assert "sync.transport routed needs every engine to apply in place" in error, error
        assert "RecordingEngine takes no routed buckets" in error, error
    assert status == "error" and "the weight update failed: the sender rank 0 (PP stage 0)" in message, message
