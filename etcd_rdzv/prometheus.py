"""Optional Prometheus endpoint of an agent: the metrics of :mod:`etcd_rdzv.metrics`, scraped.

Off by default. Turned on by the rdzv-conf key ``metrics_port`` (or the
environment variable ``ETCD_RDZV_METRICS_PORT``; the conf key wins), with
``metrics_addr`` / ``ETCD_RDZV_METRICS_ADDR`` for the address to bind
(default ``127.0.0.1``: this host only; ``0.0.0.0`` serves every interface, for a
Prometheus elsewhere). Needs ``prometheus_client``
(``pip install etcd-rdzv[prometheus]``).

Lifecycle: torch's metric handlers are per process (``metrics.configure``), and
so is this endpoint. The first handler creator of a process that finds a port
configured (:func:`maybe_start`, called by the ``etcd-v2``/``etcd``/``etcd-v3``
creators before any RPC) starts ``prometheus_client``'s HTTP server on a daemon
thread and configures a :class:`PrometheusMetricHandler` for the ``etcd_rdzv``
group (replacing a handler configured for that group before); later creators
with the same port reuse it. It serves until the process
exits (a scrape after ``shutdown()`` still sees the final counts).

Raises ``ValueError`` naming the key for a bad port, for a port while
``prometheus_client`` is missing, and for a second, different port in one
process; ``OSError`` naming the port when it cannot be bound. Mapping
(``<b>`` the backend, as a label): ``<b>.rendezvous.joins`` ->
``etcd_rdzv_rendezvous_joins_total{backend="<b>"}`` (counters get ``_total``,
gauges keep their name: ``etcd_rdzv_rendezvous_duration_ms``),
``etcd_client.errors.<E>`` -> ``etcd_rdzv_etcd_client_errors_total{error="<E>"}``,
``etcd_client.retries`` -> ``etcd_rdzv_etcd_client_retries_total``.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic import metrics as torch_metrics

from . import metrics
from .conf_keys import read

if TYPE_CHECKING:
    from .conf import RdzvParams

log = logging.getLogger(__name__)

__all__ = ["PrometheusMetricHandler", "maybe_start", "serving"]

PREFIX = "etcd_rdzv_"

_lock = threading.Lock()
_serving: tuple[str, int] | None = None  # (addr, port) of this process's endpoint


class PrometheusMetricHandler(torch_metrics.MetricHandler):
    """A torch ``MetricHandler`` feeding Prometheus counters and gauges (see the module docstring).

    A name it does not know becomes a gauge of the value (its dots as ``_``).
    ``registry`` defaults to ``prometheus_client``'s global registry. Thread-safe.
    """

    def __init__(self, registry: Any = None) -> None:
        import prometheus_client

        self._prom = prometheus_client
        self._registry = prometheus_client.REGISTRY if registry is None else registry
        self._made: dict[str, Any] = {}
        self._lock = threading.Lock()

    def emit(self, metric_data: torch_metrics.MetricData) -> None:
        name, value = str(metric_data.name), int(metric_data.value)
        backend, _, rest = name.partition(".")
        if rest in metrics.RDZV_NAMES:
            counter = rest in metrics.COUNTERS
            child = self._metric(rest, counter, ("backend",)).labels(backend)
            if counter:
                child.inc(value)
            else:
                child.set(value)
        elif name.startswith(metrics.ETCD_ERRORS + "."):
            error = name[len(metrics.ETCD_ERRORS) + 1:]
            self._metric(metrics.ETCD_ERRORS, True, ("error",)).labels(error).inc(value)
        elif name in metrics.COUNTERS:
            self._metric(name, True, ()).inc(value)
        else:
            self._metric(name, False, ()).set(value)

    def _metric(self, name: str, counter: bool, labels: tuple[str, ...]) -> Any:
        prom_name = PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", name)
        with self._lock:
            made = self._made.get(prom_name)
            if made is None:
                kind = self._prom.Counter if counter else self._prom.Gauge
                made = kind(prom_name, f"etcd-rdzv metric {name} (see etcd_rdzv.metrics)", labels,
                            registry=self._registry)
                self._made[prom_name] = made
            return made


def maybe_start(params: RdzvParams) -> tuple[str, int] | None:
    """Start this process's endpoint if ``metrics_port`` is configured; its (addr, port) or None."""
    global _serving
    port = read(params, "metrics_port")
    if port is None:
        return None
    addr = read(params, "metrics_addr")
    try:
        import prometheus_client
    except ImportError:
        raise ValueError(
            f"metrics_port={port} asks for a Prometheus endpoint, but prometheus_client is not "
            "installed: pip install 'etcd-rdzv[prometheus]' (or unset it)."
        ) from None
    with _lock:
        if _serving is not None:
            if _serving != (addr, port):
                raise ValueError(f"metrics_port: this process already serves metrics on "
                                 f"{_serving[0]}:{_serving[1]}, not {addr}:{port}.")
            return _serving
        try:
            prometheus_client.start_http_server(port, addr=addr)
        except OSError as e:
            raise OSError(f"cannot serve Prometheus metrics on {addr}:{port} (metrics_port): {e}") from e
        torch_metrics.configure(PrometheusMetricHandler(), group=metrics.GROUP)
        _serving = (addr, port)
    log.info("serving etcd-rdzv metrics for Prometheus on %s:%d", addr, port)
    return _serving


def serving() -> tuple[str, int] | None:
    """The (addr, port) this process serves metrics on, or None."""
    return _serving
