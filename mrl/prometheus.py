"""Prometheus sink of run metrics: the step metrics MetricsLogger logs, as gauges on an HTTP endpoint
(`http://HOST:PORT/metrics`) served by prometheus_client from the driver process while a run trains.

Names: `mrl_` + the metric's name with every character Prometheus does not allow in a name replaced
by `_` (actor/ppo_kl → mrl_actor_ppo_kl, timing_s/gen → mrl_timing_s_gen); the help text keeps the
original name. `mrl_step` is the last step logged. Every series carries the label run=<run name>
(trainer.name), so several runs can share one Prometheus.

A gauge holds the value of the last step that reported its metric: eval/accuracy between
evaluations, the parity gap between checks, the actor's metrics across a step that dynamic sampling
skipped. A metric appears once a step has reported it.

The server binds all interfaces (a Prometheus on another host must reach it). Port 0 takes any
free port and prints it; a port that cannot be opened is a one-line error naming it and the fix.
"""

from __future__ import annotations

import errno
import re
import socket
import threading
from typing import Iterator, Mapping

PREFIX = "mrl_"
STEP_METRIC = "mrl_step"
RUN_LABEL = "run"
BIND_ADDRESS = "0.0.0.0"
_NOT_ALLOWED = re.compile(r"[^a-zA-Z0-9_:]")


class PrometheusPortError(RuntimeError):
    """The exporter's port cannot be opened (in use, or not allowed)."""


def metric_name(name: str) -> str:
    """The Prometheus gauge that exposes the mrl metric `name`."""
    return PREFIX + _NOT_ALLOWED.sub("_", name)


def port_problem(port: int) -> str | None:
    """Why logging.prometheus_port `port` cannot be opened on this machine now (None: it can).

    Binds and releases the port as the exporter's server will (SO_REUSEADDR, as http.server sets,
    so a port left in TIME_WAIT by an earlier run counts as free)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((BIND_ADDRESS, port))
    except OSError as exc:
        return _problem_message(port, exc)
    finally:
        probe.close()
    return None


def _problem_message(port: int, exc: OSError) -> str:
    fix = "set logging.prometheus_port to a free port, 0 (any free port) or null (no exporter)"
    if exc.errno == errno.EADDRINUSE:
        return f"logging.prometheus_port {port} is in use on this machine (another process listens there): {fix}."
    return f"logging.prometheus_port {port} cannot be opened ({exc.strerror or exc}): {fix}."


class PrometheusExporter:
    """Serves the last logged value of every step metric as a gauge labelled run=<run_name>.

    `update(step, values)` after each step (MetricsLogger does it); `close()` stops the server.
    """

    def __init__(self, port: int, run_name: str):
        from prometheus_client import CollectorRegistry, start_http_server

        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"prometheus port {port!r}; fix: an int in [0, 65535] (0: any free port)")
        self.run_name = run_name
        self._lock = threading.Lock()  # the server's thread reads what the training loop writes
        self._step: int | None = None
        self._values: dict[str, tuple[str, float]] = {}  # gauge name -> (mrl name, value)
        self._sources: dict[str, str] = {}  # gauge name -> the one mrl name it exposes
        # A registry of its own: nothing else of the process (or another exporter in it) shows up.
        registry = CollectorRegistry()
        registry.register(self)
        try:
            self._server, self._thread = start_http_server(port, addr=BIND_ADDRESS, registry=registry)
        except OSError as exc:
            raise PrometheusPortError(_problem_message(port, exc)) from None
        self.port = self._server.server_port
        print(f"Prometheus metrics of run {run_name!r} at http://{socket.gethostname()}:{self.port}/metrics",
              flush=True)

    def update(self, step: int, values: Mapping[str, float | int]) -> None:
        """Set mrl_step and the gauge of every metric in `values` (numbers, as MetricsLogger logs)."""
        updates = {}
        for name, value in values.items():
            gauge = metric_name(name)
            source = self._sources.setdefault(gauge, name)
            if source != name:
                raise ValueError(f"metrics {source!r} and {name!r} both become the Prometheus gauge {gauge}; "
                                 f"fix: rename one of them")
            updates[gauge] = (name, float(value))
        with self._lock:
            self._step = step
            self._values.update(updates)

    def collect(self) -> Iterator:
        """The gauges now (prometheus_client calls this on every scrape, from the server's thread)."""
        from prometheus_client.core import GaugeMetricFamily

        with self._lock:
            step, values = self._step, dict(self._values)
        if step is None:
            return
        family = GaugeMetricFamily(STEP_METRIC, "the last step logged", labels=[RUN_LABEL])
        family.add_metric([self.run_name], step)
        yield family
        for gauge, (name, value) in sorted(values.items()):
            family = GaugeMetricFamily(gauge, f"mrl metric {name} at its last logged step", labels=[RUN_LABEL])
            family.add_metric([self.run_name], value)
            yield family

    def close(self) -> None:
        """Stop serving and free the port; a second call does nothing."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
        self._server = None
