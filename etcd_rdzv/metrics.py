"""The metric names of etcd-rdzv, reported through torch's elastic metrics API.

Each metric is one ``torch.distributed.elastic.metrics.put_metric(name, value, GROUP)``
call, ``GROUP = "etcd_rdzv"``: it goes to the handler configured for that group
(``metrics.configure(handler, group="etcd_rdzv")``), else to torch's default handler
(which drops everything unless configured). Values are ints, as torch's; a counter is one
data point of its increment (usually 1), like torch's ``@prof`` counts. ``<b>`` is the
backend (``etcd-v2``, ``etcd`` or ``etcd-v3``).

=================================  =======  ==================================================
name                               kind     one data point per ...
=================================  =======  ==================================================
``<b>.rendezvous.joins``           counter  round this node joined (etcd-v3: each join
                                            transaction; etcd-v2: each ``next_rendezvous``)
``<b>.rendezvous.completed``       counter  ``next_rendezvous`` that returned a round
``<b>.rendezvous.duration.ms``     gauge    that call: milliseconds from its start to the seal
``<b>.rendezvous.world_size``      gauge    that call: the world size of the round
``<b>.rendezvous.timeouts``        counter  ``next_rendezvous`` that raised a timeout
``<b>.rendezvous.failures``        counter  ``next_rendezvous`` that raised anything else
``<b>.lease.lost``                 counter  lease of this node etcd reported gone (etcd-v3: the
                                            node's lease, counted when it is replaced;
                                            etcd-v2: the state key's lease)
``<b>.members.lost``               counter  round in which this (etcd-v3) node saw a member go
``etcd_client.retries``            counter  extra attempt of a unary etcd call (the client's
                                            retry policy, :mod:`etcd_store.client.stats`)
``etcd_client.errors.<Error>``     counter  etcd error a client call raised, by class name
                                            (e.g. ``etcd_client.errors.EtcdTimeoutError``;
                                            also ones the client handles itself, such as
                                            the revoke of a lease that expired already)
=================================  =======  ==================================================

:func:`watch_client` subscribes to an ``EtcdClient``'s
:class:`~etcd_store.client.CallStats` once per client (again: a no-op), so a client
shared by several handlers counts each retry once. Reporting never raises into the caller.

Prometheus (optional, off by default; usage: docs/operations.md): one endpoint per process,
like torch's metric handlers, started by :func:`maybe_start` (every backend's creator calls it
before any RPC) and fed by a :class:`PrometheusMetricHandler`. Names:
``<b>.rendezvous.joins`` -> ``etcd_rdzv_rendezvous_joins_total{backend="<b>"}`` (counters get
``_total``; gauges keep their name: ``etcd_rdzv_rendezvous_duration_ms``),
``etcd_client.errors.<E>`` -> ``etcd_rdzv_etcd_client_errors_total{error="<E>"}``,
``etcd_client.retries`` -> ``etcd_rdzv_etcd_client_retries_total``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic import metrics as torch_metrics
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from etcd_store.client.stats import ERROR, RETRY

from .conf_keys import read

if TYPE_CHECKING:
    from etcd_store.client import CallStats

    from .conf import RdzvParams

log = logging.getLogger(__name__)

__all__ = [
    "COMPLETED",
    "COUNTERS",
    "DURATION_MS",
    "ETCD_ERRORS",
    "ETCD_RETRIES",
    "FAILURES",
    "GROUP",
    "PrometheusMetricHandler",
    "JOINS",
    "LEASE_LOST",
    "MEMBERS_LOST",
    "RDZV_NAMES",
    "TIMEOUTS",
    "WORLD_SIZE",
    "maybe_start",
    "put",
    "put_rdzv",
    "rdzv_completed",
    "rdzv_failed",
    "serving",
    "watch_client",
]

GROUP = "etcd_rdzv"
"""The torch metric group of every metric here."""

JOINS = "rendezvous.joins"
COMPLETED = "rendezvous.completed"
DURATION_MS = "rendezvous.duration.ms"
WORLD_SIZE = "rendezvous.world_size"
TIMEOUTS = "rendezvous.timeouts"
FAILURES = "rendezvous.failures"
LEASE_LOST = "lease.lost"
MEMBERS_LOST = "members.lost"
ETCD_RETRIES = "etcd_client.retries"
ETCD_ERRORS = "etcd_client.errors"  # the prefix of ``etcd_client.errors.<Error>``

COUNTERS = frozenset({JOINS, COMPLETED, TIMEOUTS, FAILURES, LEASE_LOST, MEMBERS_LOST, ETCD_RETRIES})
"""The rendezvous and client counters (``etcd_client.errors.*`` are counters too; the rest gauges)."""

RDZV_NAMES = frozenset({JOINS, COMPLETED, DURATION_MS, WORLD_SIZE, TIMEOUTS, FAILURES, LEASE_LOST, MEMBERS_LOST})
"""The names that follow ``<backend>.``."""


def put(name: str, value: int) -> None:
    """One data point of ``name`` in :data:`GROUP`; a failing metric handler is logged, not raised."""
    try:
        torch_metrics.put_metric(name, int(value), GROUP)
    except Exception as e:
        log.debug("the metric handler of %r failed on %s: %s", GROUP, name, e)


def put_rdzv(backend: str, name: str, value: int = 1) -> None:
    """``<backend>.<name>`` (one of the rendezvous names above)."""
    put(f"{backend}.{name}", value)


def rdzv_completed(backend: str, started: float, world_size: int) -> None:
    """A ``next_rendezvous`` begun at ``started`` (monotonic) returned a round of ``world_size``."""
    put_rdzv(backend, COMPLETED)
    put_rdzv(backend, DURATION_MS, int((time.monotonic() - started) * 1000))
    put_rdzv(backend, WORLD_SIZE, world_size)


def rdzv_failed(backend: str, error: BaseException) -> None:
    """A ``next_rendezvous`` raised ``error``: a timeout (torch's ``RendezvousTimeoutError``) or a failure."""
    put_rdzv(backend, TIMEOUTS if isinstance(error, RendezvousTimeoutError) else FAILURES)


def _on_client_event(kind: str, detail: str) -> None:
    if kind == RETRY:
        put(ETCD_RETRIES, 1)
    elif kind == ERROR:
        put(f"{ETCD_ERRORS}.{detail}", 1)


def watch_client(stats: CallStats) -> None:
    """Report the ``etcd.*`` metrics of the client whose ``stats`` these are (idempotent)."""
    stats.subscribe(_on_client_event)


# --------------------------------------------------------------------------- the Prometheus endpoint

PREFIX = "etcd_rdzv_"

_lock = threading.Lock()
_serving: tuple[str, int] | None = None  # (addr, port) of this process's endpoint


class PrometheusMetricHandler(torch_metrics.MetricHandler):
    """A torch ``MetricHandler`` feeding Prometheus counters and gauges (module docstring). Thread-safe.

    An unknown name becomes a gauge of the value (dots as ``_``). ``registry`` defaults to
    ``prometheus_client``'s global one.
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
        if rest in RDZV_NAMES:
            counter = rest in COUNTERS
            child = self._metric(rest, counter, ("backend",)).labels(backend)
            if counter:
                child.inc(value)
            else:
                child.set(value)
        elif name.startswith(ETCD_ERRORS + "."):
            error = name[len(ETCD_ERRORS) + 1:]
            self._metric(ETCD_ERRORS, True, ("error",)).labels(error).inc(value)
        elif name in COUNTERS:
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
    """Start this process's endpoint if ``metrics_port`` is configured; its (addr, port) or None.

    ``metrics_port`` (or ``$ETCD_RDZV_METRICS_PORT``; the key wins) and ``metrics_addr`` /
    ``$ETCD_RDZV_METRICS_ADDR`` (default ``127.0.0.1``: this host only). The first call that
    finds a port starts ``prometheus_client``'s HTTP server on a daemon thread, serving until the
    process exits (a scrape after ``shutdown()`` sees the final counts), and configures a
    :class:`PrometheusMetricHandler` for :data:`GROUP` (replacing one configured before); later
    calls with the same port reuse it.

    Raises ``ValueError`` naming the key for a bad port, a port without ``prometheus_client``, or
    a second, different port in one process; ``OSError`` naming a port that cannot be bound.
    """
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
        torch_metrics.configure(PrometheusMetricHandler(), group=GROUP)
        _serving = (addr, port)
    log.info("serving etcd-rdzv metrics for Prometheus on %s:%d", addr, port)
    return _serving


def serving() -> tuple[str, int] | None:
    """The (addr, port) this process serves metrics on, or None."""
    return _serving
