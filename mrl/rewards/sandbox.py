"""Custom reward functions given by import path, run in a pool of spawned worker processes.

User reward code is untrusted for liveness: it may raise, hang or kill its own process. Each call
runs in a worker with a deadline; an exception, a timeout or a dead worker scores 0.0 with the
reason logged and in RewardResult.error, and a stuck or dead worker is killed and replaced. The
caller never waits longer than the timeout for any one sample.

Spec forms: "package.module:function" or "path/to/file.py:function".
Workers are spawned, not forked: a script that builds a SandboxedReward must keep its top-level
code under `if __name__ == "__main__":`, as multiprocessing's spawn re-imports the main module.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import multiprocessing
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Callable, Sequence

from mrl.rewards.base import RewardFn, RewardInput, RewardLoadError, RewardResult, call_reward
from mrl.rewards.signature import adapt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InWorkers:
    """A built-in reward scored in the sandbox's worker processes, named by import path so that the
    driver never imports it: for code that can run unbounded or that needs a process's main thread.
    `package` is the library it needs (checked by config validation), `install` how to get it."""

    spec: str
    package: str
    install: str


def parse_spec(spec: str, check_file: bool = True, kind: str = "reward") -> tuple[str, str]:
    """Split "module:function" / "file.py:function", checking the form and (check_file) that a
    file target exists; nothing is imported. `kind` names what the spec is for in errors."""
    target, sep, function = spec.rpartition(":")
    if not sep or not target or not function.isidentifier():
        raise RewardLoadError(
            f"{kind} {spec!r} is not an import path: use 'package.module:function' or 'path/to/file.py:function'."
        )
    if check_file and target.endswith(".py") and not Path(target).is_file():
        raise RewardLoadError(f"{kind} file {target} not found (from {spec!r}): check the path.")
    return target, function


def load_reward_fn(spec: str) -> RewardFn:
    """Import the function a spec names, as mrl calls it (a verl compute_score is wrapped: signature.py).
    Runs the user's module: call it inside a worker. A failure is a RewardLoadError of one line."""
    return adapt(import_function(spec), spec)


def import_function(spec: str, kind: str = "reward") -> Callable:
    """The callable a spec names, imported here (runs the user's module); a failure is a
    RewardLoadError of one line naming the `kind`, the spec and the fix."""
    target, function = parse_spec(spec, kind=kind)
    try:
        if target.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location(f"mrl_user_{kind}_{Path(target).stem}", target)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except SyntaxError as exc:
        raise RewardLoadError(f"{kind} {spec!r}: {exc.filename} line {exc.lineno} has a syntax error ({exc.msg}): "
                              "fix that line.") from None
    except ImportError as exc:
        raise RewardLoadError(f"{kind} {spec!r}: importing {target} failed with {type(exc).__name__}: "
                              f"{' '.join(str(exc).split())}: install the missing module, or fix the import path / "
                              "PYTHONPATH.") from None
    except Exception as exc:
        raise RewardLoadError(f"{kind} {spec!r}: importing {target} raised {type(exc).__name__}: "
                              f"{' '.join(str(exc).split())}: fix the module's top-level code.") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise RewardLoadError(f"{target} has no callable {function!r} (from {kind} {spec!r}; its functions: "
                              f"{', '.join(names) or 'none'}): fix the name after the colon.")
    return fn


def load_problem(spec: str, timeout_s: float = 60.0) -> str | None:
    """Why the reward `spec` names cannot be used (one line), or None: imported and its signature
    checked in a spawned process, as the workers will, so the user's module never runs here."""
    try:
        _Worker(spec, multiprocessing.get_context("spawn"), timeout_s).kill()
    except RewardLoadError as exc:
        return str(exc)
    return None


def _worker_main(spec: str, conn: Connection) -> None:
    """Worker process: load the function, report ready, then score samples until the pipe closes."""
    try:
        fn = load_reward_fn(spec)
    except BaseException as exc:  # report any import-time failure to the parent, then stop
        conn.send(("load_error", str(exc) if isinstance(exc, RewardLoadError)
                   else f"cannot load reward {spec!r}: {type(exc).__name__}: {' '.join(str(exc).split())}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            index, sample = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = call_reward(fn, sample)
            conn.send((index, result))
        except BaseException as exc:  # user code: any failure is a scored-0 sample, not a dead worker
            tb = traceback.format_exc(limit=-3)
            conn.send((index, RewardResult(0.0, {"traceback": tb}, f"raised {type(exc).__name__}: {exc}")))


class _Worker:
    def __init__(self, spec: str, context: multiprocessing.context.BaseContext, start_timeout_s: float) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(spec, child), daemon=True, name="mrl-reward")
        self.process.start()
        child.close()
        if not self.conn.poll(start_timeout_s):
            self.kill()
            raise RewardLoadError(f"reward worker for {spec!r} did not start within {start_timeout_s:.0f}s: does "
                                  "importing its module wait on something (a lock, the network)?")
        try:
            kind, message = self.conn.recv()
        except EOFError:
            self.kill()
            raise RewardLoadError(f"reward worker for {spec!r} died while importing it (exit code {self.process.exitcode}).")
        if kind == "load_error":
            self.kill()
            raise RewardLoadError(message)

    def kill(self) -> None:
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)


class SandboxedReward:
    """Scores samples with a custom reward function in `workers` spawned processes.

    Loading is checked at construction (a bad spec raises RewardLoadError before training starts).
    """

    def __init__(self, spec: str, timeout_s: float = 10.0, workers: int = 2, start_timeout_s: float = 60.0) -> None:
        parse_spec(spec)
        if timeout_s <= 0 or workers < 1:
            raise ValueError(f"reward timeout_s must be > 0 and workers >= 1, got {timeout_s} and {workers}.")
        self.spec, self.timeout_s, self.start_timeout_s = spec, timeout_s, start_timeout_s
        # spawn: a fork of a trainer holding threads, process groups or CUDA state is not safe.
        self._context = multiprocessing.get_context("spawn")
        self._workers = [self._start_worker() for _ in range(workers)]
        self.replaced = 0  # workers killed or found dead and replaced (for metrics)

    def _start_worker(self) -> _Worker:
        return _Worker(self.spec, self._context, self.start_timeout_s)

    def score_batch(self, samples: Sequence[RewardInput]) -> list[RewardResult]:
        """Score every sample; each takes at most timeout_s of a worker's time.

        Failures of the user's code become scores of 0.0; only a replacement worker that cannot
        start at all (the module stopped importing) raises RewardLoadError.
        """
        results: list[RewardResult | None] = [None] * len(samples)
        pending = deque(enumerate(samples))
        idle = list(self._workers)
        busy: dict[Connection, tuple[_Worker, int, float]] = {}
        try:
            self._run(pending, idle, busy, results)
        finally:
            # Interrupted (a replacement failed to start, KeyboardInterrupt): a worker still busy
            # would answer a request of the next batch with this one's score, so stop it; the
            # next batch replaces it when its send fails.
            for worker, _, _ in busy.values():
                worker.kill()
        return results  # type: ignore[return-value]

    def _run(self, pending: deque, idle: list[_Worker], busy: dict, results: list) -> None:
        while pending or busy:
            while pending and idle:
                worker = idle.pop()
                index, sample = pending.popleft()
                try:
                    worker.conn.send((index, sample))
                except (BrokenPipeError, OSError):  # died while idle: replace it, retry the sample
                    pending.appendleft((index, sample))
                    idle.append(self._replace(worker))
                    continue
                busy[worker.conn] = (worker, index, time.monotonic() + self.timeout_s)
            next_deadline = min(deadline for _, _, deadline in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, next_deadline - time.monotonic())):
                worker, index, _ = busy.pop(conn)
                try:
                    answered, result = conn.recv()
                    idle.append(worker)
                except (EOFError, OSError):
                    worker.process.join(timeout=5)
                    results[index] = self._failed(index, f"reward worker died (exit code {worker.process.exitcode})")
                    idle.append(self._replace(worker))
                    continue
                if answered != index:  # cannot happen while interrupted batches stop their workers
                    raise RuntimeError(f"reward worker answered sample {answered} when asked for {index}")
                results[index] = result
                if result.error:
                    log.warning("reward %s scored sample %d as 0.0: %s", self.spec, index, result.error)
            now = time.monotonic()
            for conn, (worker, index, deadline) in list(busy.items()):
                if now >= deadline:
                    del busy[conn]
                    results[index] = self._failed(index, f"timed out after {self.timeout_s:g}s")
                    idle.append(self._replace(worker))

    def _failed(self, index: int, reason: str) -> RewardResult:
        log.warning("reward %s scored sample %d as 0.0: %s", self.spec, index, reason)
        return RewardResult(0.0, {}, reason)

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = self._start_worker()
        self._workers[self._workers.index(worker)] = fresh
        self.replaced += 1
        return fresh

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        for worker in self._workers:
            worker.kill()
        self._workers = []

    def __enter__(self) -> "SandboxedReward":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
