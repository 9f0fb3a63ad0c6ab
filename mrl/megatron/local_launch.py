"""Run a function on N local processes joined in one torch.distributed group (no torchrun).

Used by `mrl verify` and the distributed tests. Each child sets RANK/WORLD_SIZE/MASTER_* itself and
calls init_process_group (gloo on CPU). A failure on any rank is raised in the parent with that
rank's traceback; a rank that neither returns nor fails within `timeout_s` is an error, not a hang.
"""

from __future__ import annotations

import io
import os
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


POLL_S = 0.5  # how often the parent looks for a rank that died without a result
DEATH_REPORT_S = 2.0  # after a rank's error: how long a peer's death that explains it may take to show


class WorkerError(RuntimeError):
    """A rank of a local launch failed; the message carries its traceback.

    `summary` is the failing rank and its exception's last line, for one-line CLI errors.
    """

    def __init__(self, message: str, summary: str):
        super().__init__(message)
        self.summary = summary


def rendezvous_store() -> dist.TCPStore:
    """The parent's rendezvous store on a free port, held for the launch: probing a free port and
    letting a child bind it later can lose the port to another process in between (EADDRINUSE)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def init_process_group(rank: int, world_size: int, port: int, timeout_s: float = 300.0) -> None:
    """Join the default group through the parent's store; the timeout turns a stuck collective into an error."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    backend = "nccl" if os.environ.get("MRL_DIST_BACKEND") == "nccl" else "gloo"
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


def process_context() -> Any:
    """Ranks fork from a server that holds mrl.megatron.rank_imports and nothing else (no threads,
    process groups or tensors of a caller: a fork of the caller itself is not safe); multiprocessing
    starts it on first use and keeps it for the caller's lifetime. With CUDA, spawned ranks as
    before: Megatron imports Transformer Engine where it is installed, whose import may initialise
    CUDA, which no process forked from the server could then use."""
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["mrl.megatron.rank_imports"])
    return ctx


def _raise_if_one_died(procs: list, missing: list[int], results: Any, wait_s: float = 0.0, then: str = "") -> None:
    """A rank without a result whose process has exited (killed, out of memory, os._exit) within
    `wait_s` fails the launch now: its peers would wait for it in their next collective until the
    timeout, or fail there, blaming the connection."""
    end = time.monotonic() + wait_s
    while not (dead := [r for r in missing if procs[r].exitcode is not None]) and time.monotonic() < end:
        time.sleep(0.1)
    if not dead:
        return
    try:  # a result put just before its process ended is still on its way
        rank, ok, value = results.get(timeout=1.0)
        results.put((rank, ok, value))
        return
    except queue.Empty:
        pass
    code = procs[dead[0]].exitcode
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    message = f"rank {dead[0]} {how} before returning a result{then}"
    raise WorkerError(message, message)


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any,
           environ: dict[str, str]) -> None:
    # the fork server's environment is the caller's when the server started: this call's instead
    os.environ.clear()
    os.environ.update(environ)
    try:
        init_process_group(rank, world_size, port)
        value = fn(rank, world_size, *args)
        # Serialised by value: a tensor shared through torch.multiprocessing dies with this process.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException as err:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, (traceback.format_exc(), f"{type(err).__name__}: {err}")))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(fn: Callable, world_size: int, *args: Any, timeout_s: float = 900.0) -> list[Any]:
    """Call fn(rank, world_size, *args) on world_size processes; return the values by rank.

    Values must be tensors, numbers, strings, or lists/tuples/dicts of them.
    """
    ctx = process_context()
    results = ctx.Queue()
    store = rendezvous_store()
    port = store.port
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, results, dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=min(POLL_S, max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(values))
                _raise_if_one_died(procs, missing, results)
                if time.monotonic() < deadline:
                    continue
                message = f"ranks {missing} gave no result within {timeout_s:.0f}s"
                raise WorkerError(message, message) from None
            if not ok:
                trace, last_line = value
                # a peer that died may be why (gloo: "Connection closed by peer"): name it first
                _raise_if_one_died(procs, [r for r in range(world_size) if r not in values and r != rank],
                                   results, wait_s=DEATH_REPORT_S, then=f"; rank {rank} then failed: {last_line}")
                raise WorkerError(f"rank {rank} failed:\n{trace}", f"rank {rank}: {last_line}")
            values[rank] = torch.load(io.BytesIO(value), weights_only=True)
    except BaseException:
        for p in procs:  # a failed launch: the ranks still running wait for a peer that is gone
            if p.is_alive():
                p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [values[r] for r in range(world_size)]
