"""mrl.sync without Megatron: BucketSender → WeightReceiver in one process (the receiver on a
thread), the engine's declared device in its endpoint, the checksums read back in one transfer, and
the CUDA IPC handle's error when the engine cannot see the GPU. The CUDA paths themselves (CUDA IPC,
pinned staging) run in benchmarks/gpu_checks.py on a GPU (docs/benchmarks.md)."""

from __future__ import annotations

import base64
import pickle
import threading

import pytest
import torch

from mrl.sync import SyncEndpoint, WeightReceiver
from mrl.sync.pipeline import BucketSender
from mrl.sync import wire
from mrl.sync.wire import WeightUpdateReport, checksums, checksums_match, tensor_checksum


class HoldingEngine:
    """Copies each received tensor into its own parameter, as sync.apply in_place does."""

    dtype = torch.float32

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: str | None = None):
        self.params = {name: torch.zeros(shape) for name, shape in shapes.items()}
        if device is not None:
            self.device = device

    def begin_weight_update(self):
        self.report = WeightUpdateReport()

    def load_weights(self, bucket):
        for name, tensor in bucket:
            self.params[name].copy_(tensor)
            self.report.checksums[name] = tensor_checksum(self.params[name])
            self.report.tensors += 1

    def finish_weight_update(self):
        return self.report


def _handle(name: str) -> str:
    """A CUDA IPC handle as mrl.sync.cuda_ipc writes it (rebuild_cuda_tensor's arguments), whose
    reference counter is called `name`."""
    args = [None] * 15
    args[11], args[12] = name.encode(), 0
    return base64.b64encode(pickle.dumps(args)).decode()


def _released(monkeypatch) -> list[str]:
    """The reference counters given back through torch (in the order given back), without a GPU."""
    released: list[str] = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter",
                        staticmethod(lambda handle, offset, device=None: released.append(handle.decode())))
    return released


def _model() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(64, 32 + i, generator=generator) for i in range(6)}


@pytest.mark.parametrize("transport", ["colocated", "broadcast"])
def test_buckets_of_any_origin_arrive_bitwise(transport):
    model = _model()
    engine = HoldingEngine({n: t.shape for n, t in model.items()})
    receiver = WeightReceiver(engine, timeout_s=30)
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(report=receiver.receive("s1", channels=1)))
    thread.start()
    names = list(model)
    buckets = [[(n, model[n]) for n in names[i : i + 2]] for i in range(0, len(names), 2)]  # three buckets
    sent = BucketSender(receiver.endpoint, transport=transport, timeout_s=30).send("s1", buckets)
    thread.join(30)
    report = outcome["report"]
    assert report.tensors == len(model) and report.mismatched == []
    assert sent.bytes == sum(t.nbytes for t in model.values()) and list(sent.checksums) == names
    assert all(torch.equal(engine.params[n], model[n]) for n in names)


def test_the_engine_declares_its_device_and_one_sync_feeds_one_kind_of_engine():
    assert WeightReceiver(HoldingEngine({}), timeout_s=5).endpoint.device == "cpu"  # no attribute: host memory
    assert WeightReceiver(HoldingEngine({}, device="cuda:0"), timeout_s=5).endpoint.device == "cuda"
    host = SyncEndpoint("127.0.0.1", 1, "torch.float32")
    gpu = SyncEndpoint("127.0.0.1", 2, "torch.float32", device="cuda")
    with pytest.raises(ValueError, match="one dtype, device and quantization"):
        BucketSender([host, gpu], transport="broadcast")
    with pytest.raises(ValueError, match="unknown weight-sync transport 'nccl'"):
        BucketSender(host, transport="nccl")
    fp8 = SyncEndpoint("127.0.0.1", 3, "torch.bfloat16", quantization="fp8")
    with pytest.raises(ValueError, match="one dtype, device and quantization"):
        BucketSender([fp8, SyncEndpoint("127.0.0.1", 4, "torch.bfloat16")], transport="broadcast")
    with pytest.raises(ValueError, match="sync.transport routed sends unquantised slices"):
        BucketSender(fp8, transport="routed")
    with pytest.raises(ValueError, match="'awq'-quantised weights; the weight sync produces unquantised or block-FP8"):
        BucketSender(SyncEndpoint("127.0.0.1", 5, "torch.bfloat16", quantization="awq"), transport="broadcast")


@pytest.mark.parametrize("batch", [1 << 30, 500], ids=["one batch", "batches of 500 elements"])
def test_batched_checksums_equal_one_by_one(batch, monkeypatch):
    """Every dtype the wire carries, sizes without a second sample (< 31 elements) or none, a
    non-contiguous tensor: each batched pair equals tensor_checksum's (fp64 sums of the same values)."""
    tensors = [torch.randn(7, 300), torch.arange(10.0), torch.randn(1).to(torch.bfloat16), torch.zeros(0),
               torch.randn(40, 9).t(), (torch.randn(500) * 100).to(torch.float8_e4m3fn), torch.randn(61 * 3 + 31),
               torch.randn(1000, dtype=torch.float64)]
    monkeypatch.setattr(wire, "CHECKSUM_BATCH", batch)
    batched = checksums(tensors)
    assert [checksums_match(a, b) for a, b in zip(batched, map(tensor_checksum, tensors))] == [True] * len(tensors)
    assert batched[3] == (0.0, 0.0) and batched[1][1] == 0.0  # no samples: zero sums
    assert checksums([]) == []


@pytest.mark.parametrize("alone", [1 << 40, 500], ids=["none large", "from 500 elements alone"])
@pytest.mark.parametrize("gather_min", [2, wire.GATHER_MIN], ids=["gathered", "concatenated"])
@pytest.mark.parametrize("batch", [1 << 30, 700], ids=["one batch", "batches of 700 elements"])
def test_views_of_one_storage_are_checksummed_as_each_alone(batch, gather_min, alone, monkeypatch):
    """Views that share a storage (a bucket's tensors; the regions of one parameter) are sampled by
    one gather at computed offsets (from GATHER_MIN of them on; fewer are concatenated, as other
    tensors are; from ALONE_NUMEL elements on, each is summed alone): each pair equals
    tensor_checksum's, whatever the view's offset
    and size (none or one sample, exact multiples of 61), the dtypes one byte buffer is viewed as,
    and a region that is not contiguous (copied, so checksummed alone)."""
    flat = torch.randn(4000, generator=torch.Generator().manual_seed(0))
    param = torch.randn(8, 16, 32)
    one = torch.ones(1)
    tensors = [flat[3:3 + 61 * 5], flat[400:400 + 30], flat[500:531], flat[600:600], flat[700:1900].view(40, 30),
               flat[61:62], param[2], param[5, 3:9], param[:, :, 4:7], flat[1900:4000],
               flat[::2], flat[1::3], param[:, 3, 7], one.expand(100), one.expand(70)]  # strided views: not gathered
    raw = torch.zeros(4000, dtype=torch.uint8)  # one buffer, two views of each of three dtypes
    raw[0:2400] = torch.randn(600).view(torch.uint8)
    raw[2400:3400] = torch.randn(500).to(torch.bfloat16).view(torch.uint8)
    raw[3400:4000] = torch.randint(0, 120, (600,), dtype=torch.uint8)  # e4m3 bytes of finite values
    tensors += [raw[8:1208].view(torch.float32), raw[1208:2400].view(torch.float32),
                raw[2400:2800].view(torch.bfloat16), raw[2800:3400].view(torch.bfloat16),
                raw[3400:3700].view(torch.float8_e4m3fn), raw[3700:4000].view(torch.float8_e4m3fn)]
    monkeypatch.setattr(wire, "CHECKSUM_BATCH", batch)
    monkeypatch.setattr(wire, "GATHER_MIN", gather_min)
    monkeypatch.setattr(wire, "ALONE_NUMEL", alone)
    batched = checksums(tensors)
    assert [checksums_match(a, b) for a, b in zip(batched, map(tensor_checksum, tensors))] == [True] * len(tensors)
    assert batched[3] == (0.0, 0.0) and batched[1][1] == 0.0 and batched[2][1] != 0.0


@pytest.mark.parametrize("alone", [1 << 40, 300], ids=["none large", "from 300 elements alone"])
@pytest.mark.parametrize("batch", [1 << 30, 300], ids=["one batch", "batches of 300 elements"])
def test_a_buckets_checksums_read_from_its_bytes_equal_its_views(batch, alone, monkeypatch):
    """bucket_checksums (from a bucket's bytes and header, no view per tensor; its sample offsets
    kept per layout) equals checksums of the unpacked views, in every dtype the wire carries, for
    sizes with none, one or two samples, twice on one layout (the kept offsets) and on a bucket
    that starts inside a larger buffer. A float32 after an odd number of bfloat16s is placed at a
    multiple of 4: a dtype view needs it."""
    specs = [("a", [7, 300], torch.float32), ("b", [3], torch.bfloat16), ("c", [61 * 2 + 31], torch.float32),
             ("d", [0], torch.float32), ("e", [501], torch.float8_e4m3fn), ("f", [9, 5], torch.bfloat16),
             ("g", [40], torch.float32), ("h", [1], torch.float32)]
    entries, size = wire.layout(specs)
    assert [e["offset"] % torch.empty((), dtype=d).element_size() for e, (_, _, d) in zip(entries, specs)] == [0] * 8
    assert entries[2]["offset"] == 8400 + 8  # after b's 6 bytes, at a multiple of 4
    monkeypatch.setattr(wire, "CHECKSUM_BATCH", batch)
    monkeypatch.setattr(wire, "ALONE_NUMEL", alone)
    generator = torch.Generator().manual_seed(1)
    for start in (0, 16, 16):
        flat = torch.randint(0, 120, (start + size,), dtype=torch.uint8, generator=generator)[start:]  # finite values
        views = [t for _, t in wire.unpack({"tensors": entries}, flat)]
        assert wire.bucket_checksums(entries, flat) == checksums(views)
        assert [checksums_match(a, b) for a, b in zip(checksums(views), map(tensor_checksum, views))] == [True] * 8


def test_a_cuda_ipc_handle_for_a_gpu_the_engine_cannot_see_names_the_fix():
    from mrl.sync.cuda_ipc import open_shared

    handle = {"handles": [base64.b64encode(pickle.dumps([None] * 15)).decode()], "gpu": "GPU-0000-not-here"}
    with pytest.raises(RuntimeError, match="GPU-0000-not-here.*sync.transport: broadcast"):
        open_shared(handle)


def test_cuda_ipc_only_to_engines_that_see_the_leaders_gpu_and_unloaded_buckets_give_their_handles_back(monkeypatch):
    """An engine placed on other GPUs than the leader's (Ray narrows CUDA_VISIBLE_DEVICES) cannot map
    its buckets: the sender stages them in host memory then. A bucket an engine will not load (a
    failed update) gives back every handle but the receiver's own, once each."""
    from mrl.sync import cuda_ipc
    from mrl.sync.wire import give_back_unopened

    both = SyncEndpoint("127.0.0.1", 1, "torch.bfloat16", device="cuda", gpus=("GPU-a", "GPU-b"))
    other = SyncEndpoint("127.0.0.1", 2, "torch.bfloat16", device="cuda", gpus=("GPU-b",))
    assert cuda_ipc.reachable("GPU-b", [both, other]) and not cuda_ipc.reachable("GPU-a", [both, other])
    assert not cuda_ipc.reachable("GPU-a", [SyncEndpoint("127.0.0.1", 3, "torch.bfloat16")])
    released = _released(monkeypatch)
    give_back_unopened({"nbytes": 4, "cuda_ipc": {"handles": [_handle(n) for n in ("r", "w0", "w1")], "gpu": "GPU-a"}})
    give_back_unopened({"nbytes": 4, "shm": "/dev/shm/x"})
    assert released == ["w0", "w1"]


def test_an_engine_opening_a_cuda_ipc_bucket_more_often_than_it_declared_is_told_to_declare_it():
    """Each open of a CUDA IPC bucket needs a share of its own (torch gives one back per open);
    an engine whose processes open it more often than its ipc_opens gets an error naming the fix,
    and a fan-out's receiver keeps its own engine's handles."""
    from mrl.sync.cuda_ipc import open_shared
    from mrl.sync.wire import for_engine

    header = {"nbytes": 4, "cuda_ipc": {"handles": [["a0"], ["b0", "b1", "b2"]], "gpu": "GPU-x"}}
    assert for_engine(header, 1)["cuda_ipc"] == {"handles": ["b0", "b1", "b2"], "gpu": "GPU-x"}
    assert for_engine({"nbytes": 4, "shm": "/dev/shm/x"}, 1) == {"nbytes": 4, "shm": "/dev/shm/x"}
    with pytest.raises(RuntimeError, match="1 CUDA IPC handle.*open number 1.*ipc_opens"):
        open_shared(for_engine(header, 0)["cuda_ipc"], opener=1)


def test_the_cuda_ipc_handles_of_a_bucket_no_engine_process_opens_are_given_back(monkeypatch):
    """Each CUDA IPC handle is released exactly once, or given back (else the trainer holds the
    bucket until it exits): an engine that loads in its own process gives back its workers' share;
    one with load_shared leaves them to its workers, unless its receipt fails before they run; a
    bucket skipped after a failed one (or another engine's) is given back whole but the receiver's.
    An open that fails takes no reference: a worker gives back its own handle, the receiver's
    process every handle of the bucket (none of them will be opened now)."""
    import queue

    from mrl.rollout.vllm_engine import VLLMEngine
    from mrl.sync import cuda_ipc
    from mrl.sync.receiver import _Fanout

    released = _released(monkeypatch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # no GPU copies to wait for here

    class SharingEngine(HoldingEngine):
        def __init__(self, fail: bool):
            super().__init__({"w": (4,)})
            self.fail = fail

        def load_shared(self, header, flat):
            if self.fail:
                raise RuntimeError("a worker's copy failed")

    def header(name: str) -> dict:
        return {"nbytes": 16, "tensors": [{"name": "w", "shape": [4], "dtype": "torch.float32", "offset": 0,
                                           "checksum": [0.0, 0.0]}],
                "cuda_ipc": {"handles": [_handle(f"{name}.{i}") for i in range(3)], "gpu": "GPU-a"}}

    def drain(engine, outcome: dict, names: list[str]) -> list[str]:
        receiver = WeightReceiver(engine, timeout_s=5)
        engine.begin_weight_update()
        arrivals: queue.Queue = queue.Queue()
        for name in names:
            arrivals.put((0, header(name), torch.zeros(16, dtype=torch.uint8), threading.Event()))
        arrivals.put((0, {"end": True}, None, None))
        released.clear()
        receiver._drain("s", 1, arrivals, outcome, _Fanout(receiver.store, 0, 1, receiver.endpoint))
        return list(released)

    assert drain(HoldingEngine({"w": (4,)}), {}, ["a"]) == ["a.1", "a.2"]
    assert drain(SharingEngine(fail=False), {}, ["a"]) == []
    assert drain(SharingEngine(fail=True), {}, ["a", "b"]) == ["b.1", "b.2"]  # a's went to its workers
    assert drain(SharingEngine(fail=False), {"error": "engine 1 of 2 failed"}, ["a"]) == ["a.1", "a.2"]

    engine = VLLMEngine.__new__(VLLMEngine)
    engine._start_bookkeeping()
    monkeypatch.setattr("mrl.rollout.vllm_engine.bucket_checksums", lambda *_: 1 / 0)
    released.clear()
    with pytest.raises(ZeroDivisionError):
        engine.load_shared(header("c"), torch.zeros(16, dtype=torch.uint8))
    assert released == ["c.1", "c.2"]  # the receipt failed before any worker saw the bucket

    from types import SimpleNamespace

    from mrl.rollout.vllm_weights import _load_shared

    monkeypatch.setattr(cuda_ipc, "rebuild_cuda_tensor", lambda *args: 1 / 0)  # e.g. cudaIpcOpenMemHandle failed
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda index: "GPU-a")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    released.clear()
    with pytest.raises(ZeroDivisionError):
        _load_shared(SimpleNamespace(rank=1), header("d"), "in_place")
    assert released == ["d.2"]
    receiver = WeightReceiver(HoldingEngine({"w": (4,)}), timeout_s=5)
    released.clear()
    with pytest.raises(ZeroDivisionError):
        receiver._data(None, header("e"), "receiving bucket 0")
    assert released == ["e.0", "e.1", "e.2"]


def test_the_channel_threads_of_a_receiver_drop_another_fan_outs_kept_channels_at_once():
    """Each channel's thread drops the channels kept from another fan-out (PP2 broadcast to one
    engine, then to two): both list the same leftovers, and the second must not fail on the
    first's drop (it raised KeyError and failed the sync)."""
    receiver = WeightReceiver(HoldingEngine({"w": (4,)}), timeout_s=5)
    listed = threading.Barrier(2, timeout=5)

    class Kept(dict):
        def __iter__(self):  # both threads have listed the leftovers before either drops one
            keys = list(super().__iter__())
            listed.wait()
            return iter(keys)

    receiver._kept = Kept({("h", 1, 1, 0, 0): "stage 0, one engine", ("h", 1, 1, 0, 1): "stage 1, one engine"})
    errors: list[BaseException] = []

    def forget(channel: int) -> None:
        try:
            receiver._forget_other_fanouts(("h", 1, 2, 0, channel))
        except BaseException as err:  # noqa: BLE001 - asserted below
            errors.append(err)

    threads = [threading.Thread(target=forget, args=(c,)) for c in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and not receiver._kept
