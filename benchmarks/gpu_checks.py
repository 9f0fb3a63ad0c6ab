"""mrl's CUDA paths on one GPU: checked bitwise and measured against the same run's physical limits.

Run on a GPU machine (needs torch and nothing else of mrl's dependencies); on CPU every section
runs too, with the CUDA specifics skipped, to debug the script itself.

  bandwidth  device-to-device copy, pinned and pageable host↔device copies: the limits.
  sync       a synthetic bf16 model (--size-gb) from a trainer process to an engine process through
             mrl.sync (BucketSender → WeightReceiver, pipelined, --bucket-mb buckets), three ways:
             colocated over CUDA IPC (the engine maps the trainer's GPU buckets), colocated over
             /dev/shm (host staging: what an engine that declares no CUDA device gets), broadcast
             over gloo from a pinned host buffer. The engine copies each tensor into its own
             parameter (sync.apply in_place's work, without vLLM) and checks every tensor bitwise
             against the values the trainer sent. Timed from the send's start to the engine holding
             the weights; the trainer's tensors exist beforehand (the export is not timed).
  offload    mrl.megatron.offload.StateOffloader on a CUDA model with Adam state: GPU memory freed,
             a bitwise round trip, training after a round trip identical to training without.
  fp8        mrl.quant.fp8's block quantize/dequantize on the GPU bitwise equal to the CPU's, and
             the GPU's quantize rate.
  megatron   tiny models (--archs) through mrl's Megatron path on one rank (NCCL on a GPU; needs
             megatron-core): logits against transformers' on the CPU, and a bitwise HF export.

    python benchmarks/gpu_checks.py [--sections bandwidth,sync,offload,fp8,megatron] [--size-gb 4] [--out DIR]

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

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GB = 1e9
MB = 1 << 20
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
RESULTS: list[dict] = []


def emit(section: str, **row) -> None:
    """Print a result and append it to OUT/gpu_checks.jsonl at once (a run cut short keeps what it had)."""
    row = {"section": section, **row}
    RESULTS.append(row)
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
    """GB/s of bytes copied (each byte counted once, not read + write)."""
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

def model_specs(size_gb: float) -> list[tuple[str, tuple[int, ...]]]:
    """A transformer-like mix of tensor sizes (bf16): per layer four 4096² projections, eight
    1536×4096 expert matrices and two norms (~224 MB a layer)."""
    per_layer = [("q", (4096, 4096)), ("k", (4096, 4096)), ("v", (4096, 4096)), ("o", (4096, 4096))]
    per_layer += [(f"experts.{e}.{w}", (1536, 4096)) for e in range(4) for w in ("up", "down")]
    per_layer += [("input_norm", (4096,)), ("post_norm", (4096,))]
    layer_bytes = sum(2 * torch.Size(s).numel() for _, s in per_layer)
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
    `announce` is the device it declares to the sender ("cpu" sends host-staged buckets)."""

    dtype = torch.bfloat16

    def __init__(self, specs, device: str, announce: str):
        self.params = {n: torch.empty(s, dtype=self.dtype, device=device) for n, s in specs}
        self.device = announce

    def begin_weight_update(self):
        from mrl.sync.wire import WeightUpdateReport

        self.report, self.sums, self.load = WeightUpdateReport(), {}, 0.0

    def load_weights(self, bucket):
        from mrl.sync.wire import checksum_sums

        start = time.perf_counter()
        for name, tensor in bucket:
            param = self.params[name]
            param.copy_(tensor, non_blocking=True)
            self.sums[name] = checksum_sums(param)
            self.report.tensors += 1
            self.report.bytes += param.nbytes
        self.report.load_seconds += time.perf_counter() - start

    def finish_weight_update(self):
        from mrl.sync.wire import checksums_of

        start = time.perf_counter()
        sync_device()
        self.report.checksums = dict(zip(self.sums, checksums_of(list(self.sums.values()))))
        self.report.not_updated = [n for n in self.params if n not in self.sums]
        self.report.finish_seconds = time.perf_counter() - start
        return self.report


def _engine(specs, announce: str, versions: list[int], endpoints, results) -> None:
    try:
        from mrl.sync import WeightReceiver

        engine = TensorEngine(specs, str(DEVICE), announce)
        receiver = WeightReceiver(engine, timeout_s=60)
        endpoints.put(receiver.endpoint)
        held = sum(p.nbytes for p in engine.params.values())
        for version in versions:
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            report = receiver.receive(f"{announce}-v{version}", channels=1)
            expected = values(specs, version, DEVICE)
            wrong = [n for n, p in engine.params.items() if not torch.equal(p, expected[n])]
            del expected
            results.put({"finished_at": report.finished_at, "load_s": round(report.load_seconds, 3),
                         "finish_s": round(report.finish_seconds, 3), "engine_tensors": report.tensors,
                         "mismatched": len(report.mismatched), "not_updated": len(report.not_updated),
                         "bitwise_wrong": wrong[:3], "bitwise_wrong_count": len(wrong),
                         "engine_extra_gpu_mb": round((torch.cuda.max_memory_allocated() - held) / MB) if CUDA else None})
    except BaseException:  # noqa: BLE001 - the trainer reports it
        results.put({"error": traceback.format_exc()})


def sync_case(specs, transport: str, announce: str, repeats: int, bucket_bytes: int, d2d: float) -> None:
    from mrl.sync.sender import BucketSender

    ctx = mp.get_context("spawn")
    endpoints, results = ctx.Queue(), ctx.Queue()
    versions = list(range(1, repeats + 1))
    proc = ctx.Process(target=_engine, args=(specs, announce, versions, endpoints, results), daemon=True)
    proc.start()
    try:
        endpoint = endpoints.get(timeout=180)
        sender = BucketSender(endpoint, transport=transport, timeout_s=60, who=f"trainer ({transport}, {announce})")
        total = sum(2 * torch.Size(s).numel() for _, s in specs)
        for version in versions:
            tensors = values(specs, version, DEVICE)
            sync_device()
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if CUDA else 0
            sent = sender.send(f"{announce}-v{version}", buckets(tensors, bucket_bytes))
            trainer_extra = round((torch.cuda.max_memory_allocated() - base) / MB) if CUDA else None
            got = results.get(timeout=150)
            if "error" in got:
                raise RuntimeError(got["error"])
            seconds = got.pop("finished_at") - sent.started_at
            emit("sync", transport=transport, engine_declares=announce, version=version, bytes=sent.bytes,
                 tensors=len(sent.checksums), seconds=round(seconds, 4), gbps=round(total / seconds / GB, 2),
                 ratio_to_d2d_copy=round(total / seconds / GB / d2d, 3), trainer_extra_gpu_mb=trainer_extra,
                 bucket_mb=bucket_bytes // MB, **got)
            del tensors
        if CUDA:
            torch.cuda.ipc_collect()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def sync(size_gb: float, repeats: int, bucket_mb: int, d2d: float, cases: list[str]) -> None:
    specs = model_specs(size_gb)
    emit("sync_model", tensors=len(specs), gb=round(sum(2 * torch.Size(s).numel() for _, s in specs) / GB, 3))
    table = {"cuda_ipc": ("colocated", "cuda"), "shm": ("colocated", "cpu"), "broadcast": ("broadcast", "cpu")}
    for case in cases:
        transport, announce = table[case]
        if announce == "cuda" and not CUDA:
            emit("sync", transport=transport, engine_declares=announce, skipped="no CUDA")
            continue
        free = shutil.disk_usage("/dev/shm").free
        if case == "shm" and free < 3 * bucket_mb * MB:  # a full /dev/shm kills the writer with SIGBUS
            emit("sync", transport=transport, engine_declares=announce, skipped=f"/dev/shm has {free // MB} MB free")
            continue
        try:
            sync_case(specs, transport, announce, repeats, bucket_mb * MB, d2d)
        except Exception:  # noqa: BLE001 - the next case still runs
            emit("sync", transport=transport, engine_declares=announce, error=traceback.format_exc()[-3000:])


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
    emit("fp8", shape=[rows, cols], q_bitwise_cpu_gpu=same_q, scale_bitwise_cpu_gpu=same_s,
         dequantize_bitwise_cpu_gpu=same_d, quantize_gbps_bf16_in=round(big.nbytes / seconds / GB, 2),
         device=str(DEVICE))


# --- megatron --------------------------------------------------------------------------------------

def _megatron_rank(rank: int, world: int, hf_dir: str) -> dict:
    from mrl.bridge.export import iter_hf_weights
    from mrl.bridge.hf_checkpoint import HFCheckpoint
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.bridge.verify import probe_tokens
    from mrl.layout import ParallelLayout
    from mrl.megatron.forward import forward_logits
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import initialize_layout
    from mrl.models.registry import model_spec_from_hf

    out: dict = {"step": "initialize_layout"}
    try:
        spec = model_spec_from_hf(hf_dir)
        coords = initialize_layout(ParallelLayout())
        out["step"] = "build_model"
        built = build_model(spec, ParallelLayout())
        out["device"] = str(built.device)
        out["step"] = "load_hf_weights"
        load_hf_weights(built, coords, hf_dir)
        out["step"] = "forward_logits"
        out["logits"] = forward_logits(built, probe_tokens(spec.vocab_size))
        out["step"] = "export"
        ckpt = HFCheckpoint(hf_dir)
        exported = dict(iter_hf_weights(built, coords, bucket_bytes=1 << 20))
        out["export_device"] = str(next(iter(exported.values())).device)
        out["export_mismatches"] = [n for n, t in exported.items() if not torch.equal(t.cpu(), ckpt.read(n))][:5]
        out["export_names_equal"] = sorted(exported) == sorted(ckpt.names())
        out["step"] = "done"
    except Exception:  # noqa: BLE001 - which step failed on this device is the finding
        out["error"] = traceback.format_exc()[-2500:]
    return out


def megatron(archs: list[str], workdir: Path) -> None:
    """A tiny model of each architecture through mrl's Megatron path on one rank (NCCL on a GPU):
    logits parity with transformers (on the CPU) and a bitwise HF export."""
    from mrl.bridge.verify import probe_tokens, reference_logits
    from mrl.megatron.local_launch import run_local
    from mrl.models.tiny import write_tiny_model

    os.environ["MRL_DIST_BACKEND"] = "nccl" if CUDA else "gloo"
    for arch in archs:
        hf_dir = write_tiny_model(arch, workdir / arch)
        got = run_local(_megatron_rank, 1, str(hf_dir), timeout_s=300)[0]
        logits = got.pop("logits", None)
        if logits is not None:
            expected = reference_logits(str(hf_dir), probe_tokens(json.loads((hf_dir / "config.json").read_text())["vocab_size"]))
            got["max_logit_diff_vs_transformers"] = float((logits - expected).abs().max())
        emit("megatron", arch=arch, **got)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default="bandwidth,fp8,offload,sync,megatron")
    parser.add_argument("--sync-cases", default="cuda_ipc,broadcast,shm")
    parser.add_argument("--size-gb", type=float, default=4.0)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--archs", default="qwen3,deepseek_v3", help="the megatron section's tiny models")
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
            elif section == "offload":
                offload()
            elif section == "fp8":
                fp8()
            elif section == "megatron":
                megatron(args.archs.split(","), Path(args.workdir))
        except Exception:  # noqa: BLE001 - the next section still runs
            emit(section, error=traceback.format_exc()[-3000:])
        emit("section_time", name=section, seconds=round(time.perf_counter() - start, 1))


if __name__ == "__main__":
    main()
