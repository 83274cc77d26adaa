"""The metric names of etcd-rdzv, reported through torch's elastic metrics API.

Every metric is one ``torch.distributed.elastic.metrics.put_metric(name, value,
GROUP)`` call with ``GROUP = "etcd_rdzv"``: it goes to the handler configured
for that group (``metrics.configure(handler, group="etcd_rdzv")``), else to
torch's default handler (``metrics.configure(handler)``; torch's own default
drops everything). Values are ints, as torch's are; a counter is reported as
one data point of its increment (usually 1), like torch's ``@prof`` success
and failure counts. ``<b>`` is the rendezvous backend name (``etcd-v2``,
``etcd`` or ``etcd-v3``).

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

The ``etcd_client.*`` metrics are the client's: :func:`watch_client` subscribes to an
``EtcdClient``'s :class:`~etcd_store.client.CallStats` once per client (a
second call for the same client is a no-op), so a client shared by several
handlers counts each retry once. Reporting never raises into the caller.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch.distributed.elastic import metrics as torch_metrics

from etcd_store.client.stats import ERROR, RETRY

if TYPE_CHECKING:
    from etcd_store.client import CallStats

log = logging.getLogger(__name__)

__all__ = [
    "COMPLETED",
    "COUNTERS",
    "DURATION_MS",
    "ETCD_ERRORS",
    "ETCD_RETRIES",
    "FAILURES",
    "GROUP",
    "JOINS",
    "LEASE_LOST",
    "MEMBERS_LOST",
    "RDZV_NAMES",
    "TIMEOUTS",
    "WORLD_SIZE",
    "put",
    "put_rdzv",
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


def _on_client_event(kind: str, detail: str) -> None:
    if kind == RETRY:
        put(ETCD_RETRIES, 1)
    elif kind == ERROR:
        put(f"{ETCD_ERRORS}.{detail}", 1)


def watch_client(stats: CallStats) -> None:
    """Report the ``etcd.*`` metrics of the client whose ``stats`` these are (idempotent)."""
    stats.subscribe(_on_client_event)
