"""Test instruments of the client layer (not part of the :mod:`etcd_store.client` API).

:class:`RpcCounter` counts RPCs by method. :func:`counting_watches` counts into the caller's
:class:`WatchStats` the events delivered to watches a thread creates inside the block (several
simulated nodes sharing one client), on clients :func:`count_watches` was called on: a watch's
task runs in its creator's ``contextvars`` context, where that listener finds the stats. (A
client's own totals: ``stats.snapshot()``.) :class:`WatchTap` stands for one client in the code
under test and records (or drops, for a "deaf" node) the events its watches hand out.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import grpc

from ..errors import EtcdError

__all__ = ["RpcCounter", "TappedWatch", "WatchStats", "WatchTap", "count_watches", "counting_watches"]

# --------------------------------------------------------------------------- RPC counting


class RpcCounter(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """A client interceptor that counts RPCs by method (``"KV/Range"``, ``"Watch/Watch"``).

    Streams count once when opened (the client tells it: :meth:`stream_opened`; its streams run
    on ``grpc.aio`` channels, which no synchronous interceptor sees). Pass it as
    ``EtcdClient(..., interceptors=[counter])``.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _count(self, details: Any) -> None:
        name = details.method.decode() if isinstance(details.method, bytes) else details.method
        name = name.split("etcdserverpb.", 1)[-1]
        with self._lock:
            self.counts[name] += 1

    def total(self, *, exclude: Sequence[str] = ("Auth/Authenticate",)) -> int:
        with self._lock:
            return sum(n for k, n in self.counts.items() if k not in exclude)

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def stream_opened(self, method: str) -> None:
        """Count a stream the client opened (``"Watch/Watch"``, ``"Lease/LeaseKeepAlive"``)."""
        with self._lock:
            self.counts[method] += 1

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self._count(details)
        return continuation(details, request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        self._count(details)
        return continuation(details, request)

    def intercept_stream_unary(self, continuation: Any, details: Any, it: Any) -> Any:
        self._count(details)
        return continuation(details, it)

    def intercept_stream_stream(self, continuation: Any, details: Any, it: Any) -> Any:
        self._count(details)
        return continuation(details, it)


# --------------------------------------------------------------------------- watch counting


class WatchStats:
    """Watch events (and their responses' serialized bytes) delivered to the watches created
    inside a :func:`counting_watches` block; thread-safe, never reset (take differences)."""

    def __init__(self) -> None:
        self.events = 0
        self.bytes = 0
        self._lock = threading.Lock()

    def add(self, events: int, nbytes: int) -> None:
        with self._lock:
            self.events += events
            self.bytes += nbytes

    def snapshot(self) -> tuple[int, int]:
        """``(events, bytes)`` so far."""
        with self._lock:
            return self.events, self.bytes


_scope: ContextVar[WatchStats | None] = ContextVar("etcd_store_counting_watches", default=None)


def _count_in_scope(events: int, nbytes: int) -> None:
    stats = _scope.get()
    if stats is not None:
        stats.add(events, nbytes)


def count_watches(client: Any) -> None:
    """Have the watches of ``client`` (an ``EtcdClient``) count into the :class:`WatchStats` of the
    :func:`counting_watches` block they were created in (idempotent)."""
    client.stats.subscribe_deliveries(_count_in_scope)


@contextmanager
def counting_watches(stats: WatchStats) -> Iterator[WatchStats]:
    """Watches created by this thread inside the block also count into ``stats`` (for their whole
    life, also after the block), on the clients :func:`count_watches` was called on."""
    token = _scope.set(stats)
    try:
        yield stats
    finally:
        _scope.reset(token)


# --------------------------------------------------------------------------- watch taps


class TappedWatch:
    """A client's watch whose :meth:`get` records each event in ``events`` and hands on only
    those ``keep`` accepts; all else is the watch's own."""

    def __init__(self, watch: Any, keep: Callable[[Any], bool], lock: threading.Lock) -> None:
        self.watch = watch
        self.events: list[Any] = []  # every event the watch returned from get, kept or not
        self._keep = keep
        self._lock = lock

    def get(self, timeout: float | None = None) -> list[Any]:
        """The watch's next batch (blocks and raises as ``Watch.get``), recorded, then filtered."""
        batch = self.watch.get(timeout=timeout)
        with self._lock:
            self.events.extend(batch)
        return [ev for ev in batch if self._keep(ev)]

    def __iter__(self) -> Iterator[Any]:
        """The events one by one through :meth:`get`, as ``Watch.__iter__`` (ends when cancelled)."""
        while True:
            try:
                batch = self.get()
            except EtcdError:
                if self.watch.cancelled:
                    return
                raise
            yield from batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.watch, name)

    def __enter__(self) -> TappedWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.watch.cancel()


class WatchTap:
    """One client as the code under test sees it: calls go to ``client`` (maybe shared), but
    :meth:`watch` returns a :class:`TappedWatch` (``keep`` default: all; ``lambda ev: False``
    makes a node that hears no event but its watches' errors). Pass it where code takes a
    client (``create_etcd_v3_rdzv_handler(params, client=WatchTap(client))``); closes nothing."""

    def __init__(self, client: Any, keep: Callable[[Any], bool] = lambda ev: True) -> None:
        self.client = client
        self.keep = keep
        self.watches: list[TappedWatch] = []
        self._lock = threading.Lock()

    def watch(self, *args: Any, **kwargs: Any) -> TappedWatch:
        tapped = TappedWatch(self.client.watch(*args, **kwargs), self.keep, self._lock)
        with self._lock:
            self.watches.append(tapped)
        return tapped

    def events(self) -> list[Any]:
        """Every event the tapped watches returned from ``get`` so far, watch by watch."""
        with self._lock:
            return [ev for w in self.watches for ev in w.events]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)
