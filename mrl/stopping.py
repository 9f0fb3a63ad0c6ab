"""SIGTERM and SIGINT on the driver: stop the RL loop at the next step boundary, with a checkpoint.

Schedulers end jobs with SIGTERM (Slurm, Kubernetes; then SIGKILL after a grace period), users with
Ctrl-C. While the RL loop runs (`boundary` set), the first signal is recorded and the loop saves
after the step in progress and ends; a second one stops at once (KeyboardInterrupt: every process
is stopped, nothing more is saved). Outside the loop (set-up, SFT) the first signal stops at once.
Ray's ray.init installs a SIGTERM handler of its own (sys.exit); mrl's init_ray puts this one back.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """The signal that asked the run to stop (None: none yet), and the handlers that record it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.boundary = False  # in the RL loop: stop at the next step boundary, not at once
        self._previous: dict[int, object] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def install(self) -> None:
        """Handle SIGTERM and SIGINT here (the main thread only; elsewhere Python cannot)."""
        for signum in SIGNALS:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def __enter__(self) -> StopRequest:
        self.install()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.restore()

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is not None or not self.boundary:
            self.signum = self.signum or signum
            raise KeyboardInterrupt(f"{signal.Signals(signum).name}: stopped at once")
        self.signum = signum
        print(f"mrl: {self.name} received: the run stops after the step in progress and saves a checkpoint "
              f"(send it again to stop at once, without saving)", file=sys.stderr, flush=True)
