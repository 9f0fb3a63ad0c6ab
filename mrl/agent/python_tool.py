"""The built-in Python tool: the model's code runs in a fresh, limited process for each call.

Each call writes the code to a new temporary directory (the working directory, removed after)
and runs `python -I -u` there with limits on CPU time (RLIMIT_CPU), address space (RLIMIT_AS),
file size and wall time, stdin closed, a clean environment (no parent secrets) and each output
stream capped (a program printing past the cap is stopped). The network is cut by `unshare -rn`
(a user namespace too: even a root parent's child cannot raise its hard limits) or `unshare -n`;
where neither works, sockets other than AF_UNIX are refused inside Python, which code can get
around (ctypes, a subprocess): `network_isolation` says which is in force. The process group is
killed when a call ends, so children die with it. Not a filesystem jail: the code can read what
the trainer's user can.
Why not the reward sandbox's worker pool (rewards/sandbox.py): its workers live across calls
and import one function; here each run needs a fresh process (rlimits are per process and CPU
time accumulates, one episode's state must not leak into another, and unshare must exec).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mrl.agent.tools import Tool, ToolError

log = logging.getLogger(__name__)

_POLL_S = 0.01  # how often a run checks whether the program has exited

# Runs in the child before the model's code: limits first, then the code as __main__, with a
# traceback that starts at the model's code rather than here.
_BOOTSTRAP = r"""
import json, resource, sys, traceback
limits = json.loads(sys.argv[1])
resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
resource.setrlimit(resource.RLIMIT_AS, (limits["memory"], limits["memory"]))
resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file"], limits["file"]))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if limits["block_sockets"]:
    import socket
    class _NoNetwork(socket.socket):
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None and family != socket.AF_UNIX:
                raise PermissionError("network access is disabled in this sandbox")
            super().__init__(family, type, proto, fileno)
    socket.socket = _NoNetwork
path = sys.argv[2]
sys.argv = [path]
del json, resource, limits
try:
    code = compile(open(path, encoding="utf-8").read(), path, "exec")
    exec(code, {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as exc:
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
    sys.exit(1)
"""


@dataclass(frozen=True)
class PythonLimits:
    """Per-call limits. cpu_s: CPU seconds (RLIMIT_CPU); wall_s: seconds from start to kill;
    memory_mb: address space (RLIMIT_AS); output_bytes: per stream; file_mb: any file written."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 1024
    output_bytes: int = 16_384
    file_mb: int = 16

    def __post_init__(self) -> None:
        if min(self.cpu_s, self.wall_s, self.memory_mb, self.output_bytes, self.file_mb) <= 0:
            raise ValueError(f"python tool limits must all be > 0, got {self}.")


@dataclass(frozen=True)
class PythonRun:
    """What one run printed and how it ended. `stopped` is set when the wall-time limit ended it,
    `output_cut` when its output passed the cap (it is stopped then too); `exit_code` is negative
    for a signal (-24: SIGXCPU, the CPU-time limit)."""

    stdout: str
    stderr: str
    exit_code: int | None
    seconds: float
    stopped: str | None = None
    output_cut: bool = False

    @property
    def hit_limit(self) -> bool:
        """Ended by a limit of the sandbox (wall or CPU time, or a kill), not by the program."""
        return self.stopped is not None or ((self.exit_code or 0) < 0 and not self.output_cut)

    def text(self, limits: PythonLimits) -> str:
        """The run as the model reads it: stdout, then stderr, then how it ended if not normally."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stderr:
            parts.append(f"[stderr]\n{self.stderr.rstrip(chr(10))}")
        if self.output_cut:
            parts.append(f"[stopped: the output passed {limits.output_bytes} bytes per stream and was cut there]")
        elif self.stopped:
            parts.append(f"[{self.stopped}]")
        elif self.exit_code == -signal.SIGXCPU:
            parts.append(f"[killed: the CPU-time limit of {limits.cpu_s} s was reached]")
        elif self.exit_code == -signal.SIGKILL:
            parts.append(f"[killed: the CPU-time limit of {limits.cpu_s} s or the memory limit was reached]")
        elif self.exit_code and self.exit_code < 0:
            parts.append(f"[killed by signal {signal.Signals(-self.exit_code).name}]")
        elif self.exit_code:
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(parts) or "(no output)"


class PythonSandbox:
    """Runs code in limited processes, at most `max_concurrent` at once (the rest wait their turn;
    the wait is not part of wall_s but is part of a Toolbox's per-call timeout)."""

    def __init__(self, limits: PythonLimits | None = None, max_concurrent: int | None = None,
                 python: str = sys.executable) -> None:
        self.limits = limits or PythonLimits()
        self.max_concurrent = max_concurrent or os.cpu_count() or 1
        self.python = python
        self.network_isolation, self._prefix = _network_isolation()
        self._gate: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    async def run(self, code: str) -> PythonRun:
        """Run `code` as a script and return what it printed; never raises for the code's failure."""
        async with self._semaphore():
            with tempfile.TemporaryDirectory(prefix="mrl-python-", ignore_cleanup_errors=True) as workdir:
                return await self._run_in(code, Path(workdir))

    async def _run_in(self, code: str, workdir: Path) -> PythonRun:
        script = workdir / "main.py"
        script.write_text(code, encoding="utf-8")
        limits = {"cpu_s": int(self.limits.cpu_s), "memory": self.limits.memory_mb << 20,
                  "file": self.limits.file_mb << 20, "block_sockets": not self._prefix}
        start = time.monotonic()
        process = await asyncio.create_subprocess_exec(
            *self._prefix, self.python, "-I", "-u", "-c", _BOOTSTRAP, json.dumps(limits), str(script),
            cwd=workdir, env=_child_env(workdir), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True)
        out, err = _Capture(self.limits.output_bytes), _Capture(self.limits.output_bytes)
        readers = [asyncio.ensure_future(c.read(s, process.pid)) for c, s in ((out, process.stdout),
                                                                             (err, process.stderr))]
        stopped = None
        try:
            await asyncio.wait_for(self._finish(process, readers), self.limits.wall_s)
        except asyncio.TimeoutError:
            stopped = f"stopped: the wall-time limit of {self.limits.wall_s:g} s was reached"
        finally:
            _kill_group(process.pid)
            await asyncio.wait(readers, timeout=2.0)  # the pipes close with the group
            for reader in readers:
                reader.cancel()
            if process.returncode is None:
                await asyncio.wait({asyncio.ensure_future(process.wait())}, timeout=5.0)
        return PythonRun(out.text(), err.text(), process.returncode, time.monotonic() - start, stopped,
                         out.cut or err.cut)

    @staticmethod
    async def _finish(process: asyncio.subprocess.Process, readers: list[asyncio.Future]) -> None:
        # Not process.wait(): it also waits for the pipes, which a background child keeps open.
        while process.returncode is None:
            await asyncio.sleep(_POLL_S)
        _kill_group(process.pid)  # background children the code started die with it
        await asyncio.gather(*readers)

    def _semaphore(self) -> asyncio.Semaphore:
        # A semaphore belongs to one event loop: make a new one when called from another loop.
        loop = asyncio.get_running_loop()
        if self._gate is None or self._gate[0] is not loop:
            self._gate = (loop, asyncio.Semaphore(self.max_concurrent))
        return self._gate[1]


class _Capture:
    """One output stream, kept up to `limit` bytes; passing it stops the program."""

    def __init__(self, limit: int) -> None:
        self.limit, self.data, self.cut = limit, bytearray(), False

    async def read(self, stream: asyncio.StreamReader, pid: int) -> None:
        while chunk := await stream.read(65536):
            room = self.limit - len(self.data)
            self.data += chunk[:room]
            if len(chunk) > room:
                self.cut = True
                _kill_group(pid)
                return

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _child_env(workdir: Path) -> dict[str, str]:
    # Nothing of the parent's environment (API keys, tokens) reaches the model's code.
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workdir), "TMPDIR": str(workdir),
            "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


_ISOLATION: tuple[str, list[str]] | None = None


def _network_isolation() -> tuple[str, list[str]]:
    """How the network is cut here, and the command prefix that does it (probed once)."""
    global _ISOLATION
    if _ISOLATION is None:
        _ISOLATION = ("python socket block (best effort: ctypes or a subprocess can get around it)", [])
        for prefix in (["unshare", "-rn"], ["unshare", "-n"]):
            try:
                probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                break  # no unshare binary
            if probe.returncode == 0:
                _ISOLATION = (" ".join(prefix), prefix)
                break
        if not _ISOLATION[1]:
            log.warning("python tool: cannot run under `unshare -n` here (no network namespaces); the network "
                        "is blocked inside Python only, which code can get around.")
    return _ISOLATION


def python_tool(limits: PythonLimits | None = None, max_concurrent: int | None = None,
                name: str = "python", timeout_s: float | None = None) -> Tool:
    """The sandboxed Python executor as a Tool. A run that hits the wall or CPU limit is a failed
    call (counted); an exception in the code is not: its traceback is the answer."""
    sandbox = PythonSandbox(limits, max_concurrent)
    limits = sandbox.limits

    async def run_python(code: str) -> str:
        run = await sandbox.run(code)
        if run.hit_limit:
            raise ToolError(run.text(limits))
        return run.text(limits)

    description = (f"Run a Python 3 program and return what it prints (stdout, then stderr). Each call is a "
                   f"fresh process: nothing is kept between calls, there is no network and no input, and it "
                   f"is stopped after {limits.wall_s:g} s ({limits.cpu_s} s of CPU), {limits.memory_mb} MB of "
                   f"memory or {limits.output_bytes} bytes of output. Print the results you need.")
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                  "required": ["code"], "additionalProperties": False}
    return Tool(name, description, parameters, run_python, timeout_s)
