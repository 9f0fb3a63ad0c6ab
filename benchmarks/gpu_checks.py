"""mrl's CUDA paths on one GPU: checked bitwise and measured against the same run's physical limits.

Sections (each one's function below says what it checks): bandwidth (the limits), sync (mrl.sync
from a trainer process to an engine process: CUDA IPC, /dev/shm, broadcast, FP8 on the way, a TP2
engine's workers, failures), checksums, offload, fp8, megatron, train, actor_offload, activations.
Run on a GPU machine (needs torch and nothing else of mrl's dependencies; megatron-core for the
Megatron sections); on CPU every section runs too, with the CUDA specifics skipped, to debug the
script itself. Runs and results: docs/benchmarks.md, "The CUDA paths on one GPU".

    python benchmarks/gpu_checks.py [--sections bandwidth,fp8,offload,sync,megatron,train,actor_offload,activations]
        [--size-gb 4] [--out DIR]

Prints one JSON line per result and appends each to OUT/gpu_checks.jsonl as it comes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GB = 1e9
MB = 1 << 20
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def emit(section: str, **row) -> None:
    """Print a result and append it to OUT/gpu_checks.jsonl at once (a run cut short keeps what it had)."""
    row = {"section": section, **row}
    print(json.dumps(row), flush=True)
    if OUT is not None:
        with open(OUT / "gpu_checks.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


OUT: Path | None = None


def sync_device() -> None:
    if CUDA:
        torch.cuda.synchronize()


def timed(fn, repeats: int = 5) -> float:
    """Best wall time of `repeats` calls (after one warm-up), the device synchronized."""
    fn()
    sync_device()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync_device()
        best = min(best, time.perf_counter() - start)
    return best


# --- bandwidth -------------------------------------------------------------------------------------

def bandwidth(nbytes: int = 1 << 30) -> dict:
    """Section `bandwidth`, the limits: device-to-device copy, pinned and pageable host↔device
    copies, in GB/s of bytes copied (each byte counted once, not read + write)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    rates = {"d2d_copy": nbytes / timed(lambda: dst.copy_(src)) / GB}
    if CUDA:
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        rates["h2d_pinned"] = nbytes / timed(lambda: src.copy_(pinned, non_blocking=True)) / GB
        rates["d2h_pinned"] = nbytes / timed(lambda: pinned.copy_(src, non_blocking=True)) / GB
        rates["h2d_pageable"] = nbytes / timed(lambda: src.copy_(pageable), repeats=2) / GB
        rates["d2h_pageable"] = nbytes / timed(lambda: pageable.copy_(src), repeats=2) / GB
    return {k: round(v, 2) for k, v in rates.items()}


# --- sync ------------------------------------------------------------------------------------------

def bf16_bytes(specs) -> int:
    return sum(2 * torch.Size(shape).numel() for _, shape in specs)


def model_specs(size_gb: float) -> list[tuple[str, tuple[int, ...]]]:
    """A transformer-like mix of tensor sizes (bf16), with HF names (FP8 quantises the projections):
    per layer four 4096² projections, eight 1536×4096 expert matrices and two norms (~224 MB)."""
    per_layer = [(f"self_attn.{w}_proj", (4096, 4096)) for w in "qkvo"]
    per_layer += [(f"mlp.experts.{e}.{w}_proj", (1536, 4096)) for e in range(4) for w in ("up", "down")]
    per_layer += [("input_layernorm", (4096,)), ("post_attention_layernorm", (4096,))]
    layer_bytes = bf16_bytes(per_layer)
    layers = max(1, round(size_gb * GB / layer_bytes))
    return [(f"model.layers.{i}.{n}.weight", s) for i in range(layers) for n, s in per_layer]


def values(specs, version: int, device) -> dict[str, torch.Tensor]:
    """The tensors of weight version `version`: the same bits wherever they are made on one device."""
    out = {}
    for index, (name, shape) in enumerate(specs):
        g = torch.Generator(device=device).manual_seed(1_000_003 * version + index)
        out[name] = torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    return out


def buckets(tensors: dict[str, torch.Tensor], bucket_bytes: int):
    bucket, size = [], 0
    for name, tensor in tensors.items():
        if bucket and size + tensor.nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.nbytes
    if bucket:
        yield bucket


class TensorEngine:
    """An engine holding the model's parameters on `device`; it copies each received tensor into its
    own parameter (what sync.apply in_place does inside vLLM) and checksums what it holds.
    `announce` is the device it declares to the sender ("cpu" sends host-staged buckets);
    `quantization` "fp8": it holds DeepSeek's block FP8 (weights and scales), as the sender makes them."""

    def __init__(self, specs, device: str, announce: str, dtype: torch.dtype = torch.bfloat16,
                 quantization: str | None = None, ipc_opens: int = 1):
        from mrl.quant.fp8 import FP8, QUANTIZED_WEIGHT, SCALE_SUFFIX, scale_grid

        self.dtype, self.device, self.quantization = dtype, announce, quantization
        self.ipc_opens = ipc_opens  # more than its one open: the receiver gives the others back
        self.params = {}
        for name, shape in specs:
            if quantization == "fp8" and QUANTIZED_WEIGHT.match(name):
                self.params[name] = torch.empty(shape, dtype=FP8, device=device)
                self.params[name + SCALE_SUFFIX] = torch.empty(scale_grid(shape), dtype=torch.float32, device=device)
            else:
                self.params[name] = torch.empty(shape, dtype=dtype, device=device)

    def begin_weight_update(self):
        from mrl.sync.wire import WeightUpdateReport

        self.report, self.held, self.load = WeightUpdateReport(), {}, 0.0

    def load_weights(self, bucket):
        start = time.perf_counter()
        for name, tensor in bucket:
            param = self.params[name]
            param.copy_(tensor, non_blocking=True)
            self.held[name] = param
            self.report.tensors += 1
            self.report.bytes += param.nbytes
        self.report.load_seconds += time.perf_counter() - start

    def finish_weight_update(self):
        from mrl.sync.wire import checksums

        start = time.perf_counter()
        sync_device()
        self.report.checksums = dict(zip(self.held, checksums(list(self.held.values()))))
        self.report.not_updated = [n for n in self.params if n not in self.held]
        self.report.finish_seconds = time.perf_counter() - start
        return self.report


def _engine(specs, announce: str, versions: list[int], endpoints, results, quantization=None, workers: int = 0,
            ipc_opens: int = 1, fail_open: str = "", done=None) -> None:
    """The engine's process: a TensorEngine, or with `workers` a VLLMEngine whose workers are
    processes of their own (_worker_engine). After a failure it waits for `done` (an event), so
    that its processes live until the trainer has measured what it still holds."""
    try:
        from mrl.sync import WeightReceiver

        engine = _worker_engine(specs, announce, workers, fail_open) if workers else TensorEngine(
            specs, str(DEVICE), announce, quantization=quantization, ipc_opens=ipc_opens)
        receiver = WeightReceiver(engine, timeout_s=60)
        endpoints.put(receiver.endpoint)
        held = 0 if workers else sum(p.nbytes for p in engine.params.values())
        for version in versions:
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            report = receiver.receive(f"{announce}-v{version}", channels=1)
            peak = torch.cuda.max_memory_allocated() if CUDA else 0  # before the check's own copy below
            wrong = engine.wrong(version) if workers else _wrong(engine.params, specs, version, quantization)
            results.put({"finished_at": report.finished_at, "load_s": round(report.load_seconds, 3),
                         "finish_s": round(report.finish_seconds, 3), "engine_tensors": report.tensors,
                         "mismatched": len(report.mismatched), "not_updated": len(report.not_updated),
                         "misapplied": len(report.misapplied), "bitwise_wrong": wrong[:3],
                         "bitwise_wrong_count": len(wrong), "engine_workers": workers or None,
                         "engine_extra_gpu_mb": round((peak - held) / MB) if CUDA else None})
        if workers:
            engine.stop()
    except BaseException:  # noqa: BLE001 - the trainer reports it
        results.put({"error": traceback.format_exc()})
        if done is not None:
            done.wait(120)


def _wrong(params: dict[str, torch.Tensor], specs, version: int, quantization: str | None,
           rows: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> list[str]:
    """The parameters that differ bitwise from weight version `version` (`rows`: the part of each
    full tensor the holder keeps)."""
    from mrl.quant.fp8 import quantize_pairs

    expected = values(specs, version, DEVICE)
    if quantization == "fp8":  # quantised here as the sender does (bitwise the CPU's on a GPU too)
        expected = dict(quantize_pairs(expected.items()))
    return [n for n, p in params.items() if not torch.equal(p.view(torch.uint8), rows(expected[n]).view(torch.uint8))]


# --- an engine whose workers are processes: VLLMEngine's own worker functions, without vLLM --------

def _tp_rows(shape, rank: int, tp: int) -> tuple[int, int]:
    """This TP rank's rows of a matrix (dim 0, as vLLM's column-parallel layers split); vectors whole."""
    if len(shape) < 2:
        return 0, shape[0]
    per = shape[0] // tp
    return rank * per, (rank + 1) * per


def _worker_process(rank: int, tp: int, specs, conn, fail_open: str = "") -> None:
    """One stand-in vLLM worker (rank `rank` of a TP `tp` engine): its rows of every tensor as live
    parameters, and the sync plan that mrl.rollout.vllm_weights._install_plan would keep for it.
    It answers collective_rpc's calls by running the mrl.rollout.vllm_weights worker function of that
    name on itself: _load_shared maps the bucket (CUDA IPC handle or /dev/shm file) in this process
    and copies this rank's slices; _finish_in_place reads them back. Only _begin_in_place, which
    reads vLLM's layer-wise reload metadata, is done here instead (the live parameters are already
    in checkpoint format). With `fail_open`, rank 1's every open of a CUDA IPC handle fails (as a
    failed cudaIpcOpenMemHandle would); "kept": and it does not give its handle back (the control)."""
    from types import SimpleNamespace

    from mrl.rollout import vllm_weights
    from mrl.sync import cuda_ipc
    from mrl.sync.plan import Copy

    if fail_open and rank == 1:
        def refused(*args):
            raise RuntimeError("injected by gpu_checks: this worker's CUDA IPC open failed")

        cuda_ipc.rebuild_cuda_tensor = refused
        if fail_open == "kept":
            vllm_weights.give_back_unopened = lambda *args: None

    model = torch.nn.Module()
    plan, params = {}, {}
    for index, (name, shape) in enumerate(specs):
        lo, hi = _tp_rows(shape, rank, tp)
        key = f"p{index}"  # module attribute names cannot hold dots
        model.register_parameter(key, torch.nn.Parameter(
            torch.empty((hi - lo, *shape[1:]), dtype=torch.bfloat16, device=DEVICE), requires_grad=False))
        params[key] = getattr(model, key)
        hf_box = ((lo, hi),) + tuple((0, n) for n in shape[1:])
        plan[name] = [Copy(name, hf_box, key, tuple((0, b - a) for a, b in hf_box))]
    worker = SimpleNamespace(rank=rank, model_runner=SimpleNamespace(get_model=lambda: model), mrl_sync_plan=plan,
                             mrl_sync_indices={}, mrl_sync_shapes={n: tuple(s) for n, s in specs})
    while True:
        name, args = conn.recv()
        try:
            if name == "stop":
                return
            if name == "_begin_in_place":
                worker.mrl_sync_targets, worker.mrl_sync_written = params, []
                answer = None
            elif name == "wrong":
                names = {f"p{i}": n for i, (n, _) in enumerate(specs)}
                held = {names[k]: p for k, p in params.items()}
                answer = _wrong(held, specs, args[0], None, lambda t: t[slice(*_tp_rows(t.shape, rank, tp))])
            else:
                answer = getattr(vllm_weights, name)(worker, *args)
        except BaseException:  # noqa: BLE001 - returned, as vLLM's executor returns a worker's failure
            answer = {"tensor": "?", "error": traceback.format_exc()[-2000:]}
        conn.send(answer)


class _Executor:
    """What VLLMEngine uses of vLLM's LLM with the multi-process executor: collective_rpc pickles a
    worker function (by name) and its arguments to every worker process and returns their answers."""

    def __init__(self, conns):
        from types import SimpleNamespace

        self.conns = conns
        self.llm_engine = SimpleNamespace(has_unfinished_requests=lambda: False)

    def collective_rpc(self, fn, args=()):
        for conn in self.conns:
            conn.send((fn if isinstance(fn, str) else fn.__name__, args))
        return [conn.recv() for conn in self.conns]

    def reset_prefix_cache(self):
        pass


def _worker_engine(specs, announce: str, tp: int, fail_open: str = ""):
    """mrl.rollout.vllm_engine.VLLMEngine (sync.apply in_place, declaring `announce`) over _Executor:
    its load_shared checksums the mapped bucket and hands the header to `tp` worker processes,
    which map it themselves and copy their TP rows straight into their parameters. Its `wrong`
    asks each worker for its rows that differ from a weight version; `stop` ends the workers."""
    from mrl.rollout.vllm_engine import VLLMEngine

    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(tp)]
    procs = [ctx.Process(target=_worker_process, args=(r, tp, specs, pipes[r][1], fail_open), daemon=True)
             for r in range(tp)]
    for proc in procs:
        proc.start()
    engine = VLLMEngine.__new__(VLLMEngine)
    engine._start_bookkeeping()
    engine.llm = _Executor([ours for ours, _ in pipes])
    engine.dtype, engine.device, engine.quantization = torch.bfloat16, announce, None
    engine.weight_apply, engine._hooks, engine.ipc_opens = "in_place", (), 1 + tp
    engine._param_sources = {f"p{i}": {name} for i, (name, _) in enumerate(specs)}
    engine.wrong = lambda version: [n for rank in engine.llm.collective_rpc("wrong", (version,)) for n in rank]

    def stop() -> None:
        for ours, _ in pipes:
            ours.send(("stop", ()))
        for proc in procs:
            proc.join(30)

    engine.stop = stop
    return engine


def sync_case(specs, transport: str, announce: str, repeats: int, bucket_bytes: int, d2d: float,
              quantization: str | None = None, workers: int = 0, case: str = "", ipc_opens: int = 1) -> None:
    from mrl.sync.pipeline import BucketSender

    ctx = mp.get_context("spawn")
    endpoints, results = ctx.Queue(), ctx.Queue()
    versions = list(range(1, repeats + 1))
    # not a daemon: an engine with workers starts their processes
    proc = ctx.Process(target=_engine, args=(specs, announce, versions, endpoints, results, quantization, workers,
                                             ipc_opens))
    proc.start()
    try:
        endpoint = endpoints.get(timeout=180)
        sender = BucketSender(endpoint, transport=transport, timeout_s=60, who=f"trainer ({transport}, {announce})")
        total = bf16_bytes(specs)
        for version in versions:
            tensors = values(specs, version, DEVICE)
            sync_device()
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if CUDA else 0
            sent = sender.send(f"{announce}-v{version}", buckets(tensors, bucket_bytes))
            trainer_extra = round((torch.cuda.max_memory_allocated() - base) / MB) if CUDA else None
            got = results.get(timeout=150)
            # what the trainer still holds once the engine has the weights: buckets torch keeps for
            # an IPC reference not given back (freed by ipc_collect only once it is)
            held = round((torch.cuda.memory_allocated() - base) / MB) if CUDA else None
            if CUDA:
                torch.cuda.ipc_collect()
            if "error" in got:
                raise RuntimeError(got["error"])
            seconds = got.pop("finished_at") - sent.started_at
            emit("sync", case=case, transport=transport, engine_declares=announce, quantization=quantization,
                 version=version, bytes=sent.bytes,
                 tensors=len(sent.checksums), seconds=round(seconds, 4), gbps=round(total / seconds / GB, 2),
                 ratio_to_d2d_copy=round(total / seconds / GB / d2d, 3), trainer_extra_gpu_mb=trainer_extra,
                 trainer_held_after_mb=held,
                 trainer_held_after_collect_mb=round((torch.cuda.memory_allocated() - base) / MB) if CUDA else None,
                 bucket_mb=bucket_bytes // MB, **got)
            del tensors
        if CUDA:
            torch.cuda.ipc_collect()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def open_fails_case(specs, bucket_bytes: int, case: str, fail_open: str) -> None:
    """A TP2 engine whose worker 1 cannot open the buckets: the sync must fail naming it, and the
    trainer must hold none of its buckets once ipc_collect ran. Measured while the engine's
    process still lives: a reference a dead process never gave back is never given back."""
    from mrl.sync.pipeline import BucketSender

    ctx = mp.get_context("spawn")
    endpoints, results, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_engine, args=(specs, "cuda", [1], endpoints, results, None, 2, 1, fail_open, done))
    proc.start()
    try:
        sender = BucketSender(endpoints.get(timeout=180), transport="colocated", timeout_s=60, who=f"trainer ({case})")
        tensors = values(specs, 1, DEVICE)
        sync_device()
        base = torch.cuda.memory_allocated()
        try:
            sender.send("cuda-v1", buckets(tensors, bucket_bytes))  # the engine's id for version 1 (_engine)
            error = None
        except Exception as err:  # noqa: BLE001 - the failure is the expected outcome
            error = str(err)
        got = results.get(timeout=150)
        held = round((torch.cuda.memory_allocated() - base) / MB)
        torch.cuda.ipc_collect()
        emit("sync_failure", case=case, sync_failed=error is not None, names_the_open="injected by gpu_checks" in (error or ""),
             engine_failed="error" in got, trainer_held_after_mb=held,
             trainer_held_after_collect_mb=round((torch.cuda.memory_allocated() - base) / MB),
             bucket_mb=bucket_bytes // MB, error=(error or "")[-400:])
        del tensors
    finally:
        done.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def sync(size_gb: float, repeats: int, bucket_mb: int, d2d: float, cases: list[str]) -> None:
    """Section `sync`: a synthetic bf16 model (--size-gb) from a trainer process to an engine process
    through mrl.sync (BucketSender → WeightReceiver, pipelined, --bucket-mb buckets), three ways:
    colocated over CUDA IPC (the engine maps the trainer's GPU buckets), colocated over /dev/shm
    (host staging: what an engine that declares no CUDA device gets), broadcast over gloo from a
    pinned host buffer; `_fp8` cases: the engine holds DeepSeek's block FP8 and the sender quantises
    each bucket on the way. The engine copies each tensor into its own parameter (sync.apply
    in_place's work, without vLLM) and checks every tensor bitwise against the values the trainer
    sent. `_tp2_workers` cases: mrl's VLLMEngine itself (no vLLM: its collective_rpc goes to two
    worker processes that run mrl's worker functions, as vLLM's multi-process executor would) as a
    TP2 engine: each worker maps the bucket itself and copies its half of each matrix in place;
    checked bitwise per worker. `cuda_ipc_unopened`: an engine that declares three opens of each
    bucket and makes one: the receiver gives the other two handles back (the trainer must hold
    nothing after). `cuda_ipc_tp2_open_fails`: the TP2 engine's worker 1 cannot open a bucket: the
    sync fails naming it and the trainer holds nothing after (`_kept`: the control, the worker does
    not give its handle back). Timed from the send's start to the engine holding the weights; the
    trainer's tensors exist beforehand (the export is not timed)."""
    specs = model_specs(size_gb)
    emit("sync_model", tensors=len(specs), gb=round(bf16_bytes(specs) / GB, 3))
    # case: (transport, the device the engine declares, its quantization, its worker processes)
    table = {"cuda_ipc": ("colocated", "cuda", None, 0), "shm": ("colocated", "cpu", None, 0),
             "broadcast": ("broadcast", "cpu", None, 0), "cuda_ipc_fp8": ("colocated", "cuda", "fp8", 0),
             "shm_fp8": ("colocated", "cpu", "fp8", 0), "cuda_ipc_tp2_workers": ("colocated", "cuda", None, 2),
             "shm_tp2_workers": ("colocated", "cpu", None, 2), "cuda_ipc_unopened": ("colocated", "cuda", None, 0)}
    # declares three opens and makes one (no load_shared): the receiver gives two handles a bucket back
    declared = {"cuda_ipc_unopened": 3}
    for case in cases:
        if case in ("cuda_ipc_tp2_open_fails", "cuda_ipc_tp2_open_fails_kept"):  # a failed sync, not a timed one
            if CUDA:
                open_fails_case(specs, bucket_mb * MB, case, "kept" if case.endswith("kept") else "give_back")
            continue
        transport, announce, quantization, workers = table[case]
        if announce == "cuda" and not CUDA:
            emit("sync", transport=transport, engine_declares=announce, skipped="no CUDA")
            continue
        free = shutil.disk_usage("/dev/shm").free
        if announce == "cpu" and transport == "colocated" and free < 3 * bucket_mb * MB:  # a full /dev/shm kills the writer with SIGBUS
            emit("sync", transport=transport, engine_declares=announce, skipped=f"/dev/shm has {free // MB} MB free")
            continue
        try:
            sync_case(specs, transport, announce, repeats, bucket_mb * MB, d2d, quantization, workers, case,
                      declared.get(case, 1))
        except Exception:  # noqa: BLE001 - the next case still runs
            emit("sync", transport=transport, engine_declares=announce, error=traceback.format_exc()[-3000:])


# --- checksums -------------------------------------------------------------------------------------

def checksum_rates(size_gb: float, bucket_mb: int) -> None:
    """Section `checksums`: mrl.sync.wire's checksums on this device: the sum of runs of samples
    three ways (a scatter-add, torch.segment_reduce, one sum a run), then the sync's own passes over
    the synthetic model (every parameter a storage of its own, as an engine's) and over one packed
    bucket."""
    from mrl.sync import wire

    for samples, runs in ((1 << 20, 2), (1 << 20, 16), (1 << 20, 256)):
        data = torch.randn(samples, dtype=torch.float64, device=DEVICE)
        lengths = torch.full((runs,), samples // runs, device=DEVICE)
        segment = torch.repeat_interleave(torch.arange(runs, device=DEVICE), lengths, output_size=samples)
        ways = {"index_add": lambda: torch.zeros(runs, dtype=torch.float64, device=DEVICE).index_add_(0, segment, data),
                "segment_reduce": lambda: torch.segment_reduce(data, "sum", lengths=lengths),
                "sum_each": lambda: torch.stack([r.sum() for r in data.split(samples // runs)])}
        emit("checksums", samples=samples, runs=runs, **{f"{k}_ms": round(timed(f) * 1e3, 3) for k, f in ways.items()})
    specs = model_specs(size_gb)
    tensors = values(specs, 1, DEVICE)
    params = list(tensors.values())
    bucket = next(buckets(tensors, bucket_mb * MB))
    header, flat = wire.pack(list(bucket), torch.bfloat16, out=torch.empty(
        wire.packed_layout(bucket, torch.bfloat16)[1], dtype=torch.uint8, device=DEVICE))
    views = [t for _, t in wire.unpack(header, flat)]
    emit("checksums", model_tensors=len(params), model_gb=round(sum(p.nbytes for p in params) / GB, 3),
         model_ms=round(timed(lambda: wire.checksums(params), repeats=3) * 1e3, 2),
         bucket_tensors=len(views), bucket_mb=round(flat.numel() / MB),
         bucket_from_bytes_ms=round(timed(lambda: wire.bucket_checksums(header["tensors"], flat)) * 1e3, 3),
         bucket_views_ms=round(timed(lambda: wire.checksums(views)) * 1e3, 3))


# --- offload ---------------------------------------------------------------------------------------

def _model(layers: int, width: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(DEVICE)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _step(model, optimizer, width: int, step: int) -> float:
    g = torch.Generator(device=DEVICE).manual_seed(step)
    x = torch.randn(64, width, generator=g, device=DEVICE)
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return loss.item()


def offload(layers: int = 16, width: int = 4096) -> None:
    """Section `offload`: mrl.megatron.offload.StateOffloader on a CUDA model with Adam state: GPU
    memory freed, a bitwise round trip, training after a round trip identical to training without."""
    from mrl.megatron.offload import StateOffloader

    a, opt_a = _model(layers, width)
    b, opt_b = _model(layers, width)
    _step(a, opt_a, width, 0), _step(b, opt_b, width, 0)

    def tensors(part):
        if part == "weights":
            return list(a.parameters())
        if part == "grads":
            return [p.grad for p in a.parameters()]
        if part == "optimizer":
            return [v for s in opt_a.state.values() for v in s.values() if torch.is_tensor(v)]
        return []

    offloader = StateOffloader(tensors, move_host_tensors=not CUDA)
    for round_ in (1, 2):  # the second reuses the pinned host buffers
        before = {n: t.clone() for n, t in enumerate(tensors("weights") + tensors("grads") + tensors("optimizer"))}
        sync_device()
        allocated = torch.cuda.memory_allocated() if CUDA else 0
        reserved = torch.cuda.memory_reserved() if CUDA else 0
        out = offloader.offload(["weights", "grads", "optimizer"])
        freed = (allocated - torch.cuda.memory_allocated()) if CUDA else 0
        released = (reserved - torch.cuda.memory_reserved()) if CUDA else 0
        back = offloader.onload()
        after = tensors("weights") + tensors("grads") + tensors("optimizer")
        same = all(torch.equal(before[n], t) for n, t in enumerate(after))
        del before
        emit("offload", round=round_, bytes=out["bytes"], moved=out["moved"], by_part=out["by_part"],
             offload_s=round(out["seconds"], 4), onload_s=round(back["seconds"], 4),
             offload_gbps=round(out["bytes"] / out["seconds"] / GB, 2),
             onload_gbps=round(back["bytes"] / back["seconds"] / GB, 2),
             gpu_allocated_freed=freed, gpu_reserved_released=released, bitwise_round_trip=same)
    losses_a = [_step(a, opt_a, width, s) for s in (1, 2)]
    losses_b = [_step(b, opt_b, width, s) for s in (1, 2)]
    same_weights = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    emit("offload_training", losses_after_round_trips=losses_a, losses_without=losses_b,
         identical=losses_a == losses_b and same_weights)


# --- fp8 -------------------------------------------------------------------------------------------

def fp8(rows: int = 7168, cols: int = 2048 + 100) -> None:
    """Section `fp8`: mrl.quant.fp8's block quantize/dequantize on the GPU bitwise equal to the
    CPU's, and the GPU's quantize rate."""
    from mrl.quant.fp8 import dequantize, quantize

    torch.manual_seed(0)
    w = (torch.randn(rows, cols) * torch.logspace(-3, 1, cols)).to(torch.bfloat16)  # columns of many magnitudes
    w[:128, :128] = 0  # an all-zero block
    q_cpu, s_cpu = quantize(w)
    q_gpu, s_gpu = quantize(w.to(DEVICE))
    same_q = torch.equal(q_cpu.view(torch.uint8), q_gpu.cpu().view(torch.uint8))
    same_s = torch.equal(s_cpu, s_gpu.cpu())
    d_cpu = dequantize(q_cpu, s_cpu, dtype=torch.bfloat16)
    d_gpu = dequantize(q_gpu, s_gpu, dtype=torch.bfloat16)
    same_d = torch.equal(d_cpu, d_gpu.cpu())
    big = torch.randn(8192, 8192, device=DEVICE).to(torch.bfloat16)
    seconds = timed(lambda: quantize(big), repeats=3)
    differ = {"q": int((q_cpu.view(torch.uint8) != q_gpu.cpu().view(torch.uint8)).sum()),
              "scale": int((s_cpu != s_gpu.cpu()).sum()), "dequantized": int((d_cpu != d_gpu.cpu()).sum())}
    x = torch.rand(1 << 20, generator=torch.Generator().manual_seed(0)) * 100  # why a scalar divisor differs
    differ["x/448 scalar"] = int(((x.to(DEVICE) / 448.0).cpu() != x / 448.0).sum())
    differ["x/448 tensor"] = int(((x.to(DEVICE) / torch.full_like(x, 448.0, device=DEVICE)).cpu() != x / 448.0).sum())
    emit("fp8", shape=[rows, cols], q_bitwise_cpu_gpu=same_q, scale_bitwise_cpu_gpu=same_s,
         dequantize_bitwise_cpu_gpu=same_d, elements_differing=differ, quantize_gbps_bf16_in=round(big.nbytes / seconds / GB, 2),
         device=str(DEVICE))


# --- megatron --------------------------------------------------------------------------------------

def _checkpoint_engine(hf_dir: str, announce: str, endpoints, results) -> None:
    """An engine holding the checkpoint's tensors (fp32) on the device: after one sync, each must
    equal the checkpoint bitwise (the trainer loaded it unchanged)."""
    try:
        from mrl.bridge.hf_checkpoint import HFCheckpoint
        from mrl.sync import WeightReceiver

        ckpt = HFCheckpoint(hf_dir)
        engine = TensorEngine([(n, ckpt.read(n).shape) for n in ckpt.names()], str(DEVICE), announce, torch.float32)
        receiver = WeightReceiver(engine, timeout_s=60)
        endpoints.put(receiver.endpoint)
        report = receiver.receive("megatron-sync", channels=1)
        wrong = [n for n, p in engine.params.items() if not torch.equal(p.cpu(), ckpt.read(n).float())]
        results.put({"engine_tensors": report.tensors, "mismatched": len(report.mismatched),
                     "not_updated": report.not_updated[:5], "bitwise_wrong": wrong[:5]})
    except BaseException:  # noqa: BLE001
        results.put({"error": traceback.format_exc()[-2500:]})


def _sync_from_megatron(built, coords, hf_dir: str) -> dict:
    """mrl.sync.WeightSender's push of this rank's model (the bridge's export on the model's device)
    to an engine process that declares the device: CUDA IPC on a GPU, /dev/shm on a CPU."""
    from mrl.sync.sender import WeightSender

    ctx = mp.get_context("spawn")
    endpoints, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_checkpoint_engine, args=(hf_dir, DEVICE.type, endpoints, results), daemon=True)
    proc.start()
    try:
        sender = WeightSender(endpoints.get(timeout=120), built, coords, transport="colocated", bucket_bytes=1 << 20,
                              timeout_s=60)
        sent = sender.push("megatron-sync")
        got = results.get(timeout=120)
        return {"sync_bytes": sent.bytes, "sync_tensors": len(sent.checksums), **got}
    finally:
        proc.join(30)


def _one_rank_model(hf_dir: str, out: dict) -> tuple:
    """(spec, coords, built): the HF model on one Megatron rank, on this device. `out["step"]` names
    the stage reached (a failure's report says which one broke), `out["device"]` the weights' device."""
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.layout import ParallelLayout
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import initialize_layout
    from mrl.models.registry import model_spec_from_hf

    out["step"] = "initialize_layout"
    spec = model_spec_from_hf(hf_dir)
    coords = initialize_layout(ParallelLayout())
    out["step"] = "build_model"
    built = build_model(spec, ParallelLayout())
    out["device"] = str(built.device)
    out["step"] = "load_hf_weights"
    load_hf_weights(built, coords, hf_dir)
    return spec, coords, built


def _megatron_rank(rank: int, world: int, hf_dir: str) -> dict:
    from mrl.bridge.export import iter_hf_weights
    from mrl.bridge.hf_checkpoint import HFCheckpoint
    from mrl.bridge.verify import probe_tokens
    from mrl.megatron.forward import forward_logits

    out: dict = {}
    try:
        spec, coords, built = _one_rank_model(hf_dir, out)
        out["step"] = "forward_logits"
        out["logits"] = forward_logits(built, probe_tokens(spec.vocab_size))
        out["step"] = "export"
        ckpt = HFCheckpoint(hf_dir)
        exported = dict(iter_hf_weights(built, coords, bucket_bytes=1 << 20))
        out["export_device"] = str(next(iter(exported.values())).device)
        out["export_mismatches"] = [n for n, t in exported.items() if not torch.equal(t.cpu(), ckpt.read(n))][:5]
        out["export_names_equal"] = sorted(exported) == sorted(ckpt.names())
        del exported
        out["step"] = "sync"
        out["sync"] = _sync_from_megatron(built, coords, hf_dir)
        out["step"] = "done"
    except Exception:  # noqa: BLE001 - which step failed on this device is the finding
        out["error"] = traceback.format_exc()[-2500:]
    return out


def _tiny(arch: str, workdir: Path) -> Path:
    from mrl.models.tiny import write_tiny_model

    out = workdir / arch
    return out if (out / "config.json").exists() else write_tiny_model(arch, out)


def megatron(archs: list[str], workdir: Path) -> None:
    """Section `megatron`: a tiny model of each architecture (--archs) through mrl's Megatron path on
    one rank (NCCL on a GPU; needs megatron-core): logits parity with transformers (on the CPU), a
    bitwise HF export, and a colocated sync of that export (WeightSender; CUDA IPC on a GPU) checked
    bitwise."""
    from mrl.bridge.verify import probe_tokens, reference_logits
    from mrl.megatron.local_launch import run_local

    os.environ["MRL_DIST_BACKEND"] = "nccl" if CUDA else "gloo"
    for arch in archs:
        hf_dir = _tiny(arch, workdir)
        got = run_local(_megatron_rank, 1, str(hf_dir), timeout_s=300)[0]
        logits = got.pop("logits", None)
        if logits is not None:
            expected = reference_logits(str(hf_dir), probe_tokens(json.loads((hf_dir / "config.json").read_text())["vocab_size"]))
            got["max_logit_diff_vs_transformers"] = float((logits - expected).abs().max())
        emit("megatron", arch=arch, **got)


def _ragged_batch(vocab: int) -> dict:
    """The policy tests' batch: 5 prompts of 4 tokens, responses of 3..18 tokens, right-padded."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from fixtures.rollout import ragged_rollout_batch

    return ragged_rollout_batch(vocab, [9, 18, 3, 14, 6])


def _train_rank(rank: int, world: int, hf_dir: str) -> dict:
    from mrl.megatron.policy import compute_logprobs, update_actor
    from mrl.megatron.training import OptimConfig, make_trainable

    out: dict = {}
    try:
        spec, _, built = _one_rank_model(hf_dir, out)
        out["step"] = "make_trainable"
        trainable = make_trainable(built, OptimConfig(lr=1e-3))
        out["optimizer"] = type(trainable.optimizer).__name__
        batch = _ragged_batch(spec.vocab_size)
        before = {n: p.detach().clone() for chunk in built.chunks for n, p in chunk.named_parameters()}
        out["step"] = "compute_logprobs"
        scored = compute_logprobs(trainable, batch, 1, 2, with_entropy=True)
        logprobs = scored["logprobs"]
        out["logprobs_device"] = str(logprobs.device)
        out["step"] = "update_actor"
        metrics = update_actor(trainable, {**batch, "old_logprobs": logprobs.cpu()}, {}, 2)
        out["metrics"] = {k: metrics[k] for k in ("actor/ppo_kl", "actor/ratio_mean", "actor/pg_clipfrac",
                                                   "actor/grad_norm", "actor/skipped") if k in metrics}
        after = {n: p.detach() for chunk in built.chunks for n, p in chunk.named_parameters()}
        out["unchanged"] = [n for n in before if torch.equal(before[n], after[n])][:5]
        out["params"] = len(before)
        out["step"] = "second logprobs"
        again = compute_logprobs(trainable, batch, 1, 2)["logprobs"].cpu()
        mask = batch["response_mask"].bool()
        out["logprob_change_after_update"] = float((again - logprobs.cpu())[mask].abs().max())
        out["gpu_peak_mb"] = round(torch.cuda.max_memory_allocated() / MB) if CUDA else None
        out["step"] = "done"
    except Exception:  # noqa: BLE001 - which step failed on this device is the finding
        out["error"] = traceback.format_exc()[-2500:]
    return out


def _actor_offload_rank(rank: int, world: int, hf_dir: str) -> dict:
    """Two PPO updates of a Megatron actor, with and without an offload round trip of its weights,
    gradient buffers and optimizer state between them (trainer.offload_actor_during_rollout's
    StateOffloader over mrl.megatron.offload.trainable_tensors)."""
    from mrl.megatron.offload import StateOffloader, trainable_tensors
    from mrl.megatron.parallel import destroy_layout
    from mrl.megatron.policy import compute_logprobs, update_actor
    from mrl.megatron.training import OptimConfig, make_trainable

    out: dict = {}
    try:
        finals = []
        for offload in (False, True):
            spec, _, built = _one_rank_model(hf_dir, {})
            trainable = make_trainable(built, OptimConfig(lr=1e-3))
            batch = _ragged_batch(spec.vocab_size)

            def update():
                logprobs = compute_logprobs(trainable, batch, 1, 2)["logprobs"]
                return update_actor(trainable, {**batch, "old_logprobs": logprobs}, {}, 2)

            update()
            if offload:
                offloader = StateOffloader(lambda part: trainable_tensors(trainable, None, part),
                                           move_host_tensors=not CUDA)
                sync_device()
                allocated = torch.cuda.memory_allocated() if CUDA else 0
                away = offloader.offload(["weights", "grads", "optimizer"])
                freed = allocated - torch.cuda.memory_allocated() if CUDA else 0
                back = offloader.onload()
                out |= {"bytes": away["bytes"], "by_part": away["by_part"], "moved": away["moved"],
                        "gpu_allocated_freed": freed, "offload_s": round(away["seconds"], 4),
                        "onload_s": round(back["seconds"], 4)}
            metrics = update()
            weights = [p.detach().cpu().clone() for chunk in built.chunks for p in chunk.parameters()]
            finals.append((metrics["actor/pg_loss"], metrics["actor/grad_norm"], weights))
            destroy_layout()
        (loss_a, norm_a, w_a), (loss_b, norm_b, w_b) = finals
        out |= {"second_update_without": [loss_a, norm_a], "second_update_after_round_trip": [loss_b, norm_b],
                "weights_bitwise_equal": all(torch.equal(a, b) for a, b in zip(w_a, w_b))}
    except Exception:  # noqa: BLE001
        out["error"] = traceback.format_exc()[-2500:]
    return out


def actor_offload(arch: str, workdir: Path) -> None:
    """Section `actor_offload`: a tiny qwen3_moe actor's weights, gradient buffers and optimizer state
    offloaded and back between two PPO updates (trainer.offload_actor_during_rollout): the second
    update's loss, grad norm and weights against the same updates without the round trip."""
    from mrl.megatron.local_launch import run_local

    os.environ["MRL_DIST_BACKEND"] = "nccl" if CUDA else "gloo"
    emit("actor_offload", arch=arch, **run_local(_actor_offload_rank, 1, str(_tiny(arch, workdir)), timeout_s=300)[0])


def train(archs: list[str], workdir: Path) -> None:
    """Section `train`: one PPO-clip update of the same models through mrl's Megatron actor on one
    rank: the first step's ppo_kl must be exactly 0 and its ratio exactly 1 (log-probs of the scoring
    forward equal the training forward's), and every weight moved."""
    from mrl.megatron.local_launch import run_local

    os.environ["MRL_DIST_BACKEND"] = "nccl" if CUDA else "gloo"
    for arch in archs:
        hf_dir = _tiny(arch, workdir)
        emit("train", arch=arch, **run_local(_train_rank, 1, str(hf_dir), timeout_s=300)[0])


def _activation_rank(rank: int, world: int, hf_dir: str, seq: int, size: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from plan_activations import measure

    from mrl.layout import ParallelLayout

    try:
        return measure(rank, world, hf_dir, ParallelLayout(), seq, size, 1)
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()[-2500:]}


def activations(archs: list[str], workdir: Path, seq: int = 256, size: int = 2) -> None:
    """Section `activations` (--activation-archs): what autograd saves for backward in one DAPO step
    (bf16, one rank, one micro-batch), measured (mrl.megatron.footprint's SavedTensorMeter) beside
    `mrl plan`'s estimate for the kernel the device runs (a GPU's SDPA keeps no probabilities: "flash")."""
    from mrl.layout import ParallelLayout
    from mrl.megatron.local_launch import run_local
    from mrl.models.registry import model_spec_from_hf
    from mrl.plan.activations import MicroBatch, cpu_attention, stage_activations
    from mrl.plan.shapes import ModelShape, stage_chunks

    os.environ["MRL_DIST_BACKEND"] = "nccl" if CUDA else "gloo"
    for arch in archs:
        hf_dir = _tiny(arch, workdir)
        got = run_local(_activation_rank, 1, str(hf_dir), seq, size, timeout_s=300)[0]
        shape = ModelShape.of(model_spec_from_hf(str(hf_dir)))
        kernel = "flash" if CUDA else cpu_attention(shape)
        chunks = stage_chunks(shape.layers, ParallelLayout(), 0)
        plan = stage_activations(shape, ParallelLayout(), chunks, MicroBatch(seq, size), 2, 1, kernel).saved
        row = {"arch": arch, "seq": seq, "micro_batch": size, "plan_kernel": kernel, "planned_bytes": plan}
        if "peak" in got:
            row |= {"measured_bytes": got["peak"], "plan_over_measured": round(plan / got["peak"], 3)}
        emit("activations", **row, **{k: v for k, v in got.items() if k not in ("peak", "stage")})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default="bandwidth,fp8,offload,sync,megatron,train,actor_offload,activations")
    parser.add_argument("--sync-cases", default="cuda_ipc,broadcast,shm")
    parser.add_argument("--size-gb", type=float, default=4.0)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--archs", default="qwen3,deepseek_v3", help="the megatron section's tiny models")
    parser.add_argument("--activation-archs", default="llama,qwen3_moe,deepseek_v3")
    parser.add_argument("--workdir", default="/tmp/mrl-gpu-checks")
    args = parser.parse_args()
    sections = args.sections.split(",")
    global OUT
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    emit("device", name=torch.cuda.get_device_name() if CUDA else "cpu", torch=torch.__version__,
         cuda=torch.version.cuda)
    d2d = 1.0
    for section in sections:
        start = time.perf_counter()
        try:
            if section == "bandwidth":
                rates = bandwidth()
                d2d = rates["d2d_copy"]
                emit("bandwidth", gbps=rates)
            elif section == "sync":
                sync(args.size_gb, args.repeats, args.bucket_mb, d2d, args.sync_cases.split(","))
            elif section == "checksums":
                checksum_rates(args.size_gb, args.bucket_mb)
            elif section == "offload":
                offload()
            elif section == "fp8":
                fp8()
            elif section == "megatron":
                megatron(args.archs.split(","), Path(args.workdir))
            elif section == "actor_offload":
                actor_offload("qwen3_moe", Path(args.workdir))
            elif section == "train":
                train(args.archs.split(","), Path(args.workdir))
            elif section == "activations":
                activations(args.activation_archs.split(","), Path(args.workdir))
        except Exception:  # noqa: BLE001 - the next section still runs
            emit(section, error=traceback.format_exc()[-3000:])
        emit("section_time", name=section, seconds=round(time.perf_counter() - start, 1))


if __name__ == "__main__":
    main()
