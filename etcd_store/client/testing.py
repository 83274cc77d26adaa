"""Test instruments of the client layer.

:class:`RpcCounter` counts RPCs by method; :func:`watch_stats` returns the
:class:`WatchStats` of a client (the watch events and bytes its watches delivered);
:func:`counting_watches` also counts, into a :class:`WatchStats` of the caller's, the
watches a thread creates (several simulated nodes sharing one client).
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import grpc

__all__ = ["RpcCounter", "WatchStats", "counting_watches", "watch_stats"]

# --------------------------------------------------------------------------- RPC counting


class _CallDetails(grpc.ClientCallDetails):  # type: ignore[misc]
    pass


class RpcCounter(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """A client interceptor that counts RPCs by method (``"KV/Range"``, ``"Watch/Watch"``).

    Streams count once when opened. Pass it as ``EtcdClient(..., interceptors=[counter])``.
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
    """Watch events (and their responses' serialized bytes) delivered by one client's watches.

    Counted by every :class:`~etcd_store.client.Watch` of the client as its reader
    thread queues a batch; thread-safe, never reset (take differences).
    """

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


_watch_stats: weakref.WeakKeyDictionary[Any, WatchStats] = weakref.WeakKeyDictionary()
_watch_stats_lock = threading.Lock()


def watch_stats(client: Any) -> WatchStats:
    """The :class:`WatchStats` of ``client`` (an ``EtcdClient``), created on first use."""
    with _watch_stats_lock:
        stats = _watch_stats.get(client)
        if stats is None:
            stats = _watch_stats[client] = WatchStats()
        return stats


_scope = threading.local()


@contextmanager
def counting_watches(stats: WatchStats) -> Iterator[WatchStats]:
    """Watches created by this thread inside the block also count into ``stats``
    (for their whole life, also after the block)."""
    previous = getattr(_scope, "stats", None)
    _scope.stats = stats
    try:
        yield stats
    finally:
        _scope.stats = previous


def scoped_watch_stats() -> WatchStats | None:
    """The :class:`WatchStats` of the innermost :func:`counting_watches` of this thread."""
    return getattr(_scope, "stats", None)
