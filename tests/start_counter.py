"""Counts the expensive starts of a test session: vLLM engines and Megatron ranks.

A thread polls the machine's processes every 0.2 s (both kinds live for seconds at least) and
remembers each new one by its title: Ray actors call themselves `ray::<Class>` (a RolloutServer
holds one vLLM engine in its own process), ranks of `run_local` fork from one server, and a test
that runs vLLM in a script of its own names the script. The summary goes to the terminal at the
end of the session; CONTRIBUTING's suite budget quotes it.
"""

from __future__ import annotations

import os
import threading
from collections import Counter

import psutil

POLL_S = 0.2
ACTORS = ("RolloutServer", "MegatronActor")  # an engine; a Megatron rank (actor, critic)


def _kind(proc: psutil.Process, forkservers: set[int]) -> str | None:
    try:
        cmdline = proc.cmdline()
        ppid = proc.ppid()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    title = " ".join(cmdline)
    if title.startswith("ray::"):
        name = title[len("ray::"):].split(".")[0].split()[0]
        return f"ray actor {name}" if name in ACTORS else None
    if "multiprocessing.forkserver" in title:
        if ppid in forkservers:
            return "forked rank"
        forkservers.add(proc.pid)
        return None
    if any(arg.endswith(".py") and "/pytest-" in arg for arg in cmdline):
        return "script (own vLLM or train)"
    if any(arg.endswith("/mrl") or arg == "mrl" for arg in cmdline[:2]):
        return "mrl command"
    return None


class StartCounter:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._seen: set[int] = {p.pid for p in psutil.process_iter()}
        self._forkservers: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="start-counter", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            for proc in psutil.process_iter():
                if proc.pid in self._seen:
                    continue
                kind = _kind(proc, self._forkservers)
                # A Ray worker starts as default_worker.py, then is ray::IDLE until it becomes an
                # actor: look again at the next poll.
                title = _title(proc)
                if kind is not None or not (title.startswith("ray::") or "default_worker.py" in title):
                    self._seen.add(proc.pid)
                if kind is not None:
                    self.counts[kind] += 1

    def stop(self) -> Counter[str]:
        self._stop.set()
        self._thread.join()
        return self.counts


def _title(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def enabled() -> bool:
    return os.environ.get("MRL_COUNT_STARTS", "1") != "0"
