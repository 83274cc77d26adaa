"""``CallStats``: counters of one client's retry policy, for layers above to read or subscribe to.

Only the transport (:mod:`.transport`) reports a **retry** (another attempt of a unary call:
next member, next round, or after logging in again) and an **error** (an
:class:`~etcd_store.errors.EtcdError` raised or ending a stream, by class name). Watches
(:mod:`.watch`) report a **delivery**: a batch of events and its response's serialized size
(read by benchmarks via :meth:`CallStats.subscribe_deliveries`).

Contract: counting never blocks (one short lock) and never raises into the call it counts.
Retry and error listeners run synchronously in that call's thread, after the counter moved;
on the stream loop (a stream's error) they run in the client's callback thread instead
(:meth:`~.reactor.Reactor.offload`, same ``contextvars`` context), so user code (torch's
metric handlers) never stalls a stream. Delivery listeners run on the loop, in the watch
creator's ``contextvars`` context, and must be counters: quick, no long lock, no I/O. A
listener that raises is logged at DEBUG and ignored. This module knows nothing of torch or
the rendezvous layer, which subscribes here.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import Any, TypeVar

from .reactor import started

log = logging.getLogger(__name__)

__all__ = ["ERROR", "RETRY", "CallStats", "DeliveryListener", "StatsListener", "StatsSnapshot", "counts_error"]

RETRY = "retry"
ERROR = "error"

StatsListener = Callable[[str, str], None]
"""``listener(kind, detail)``: ``kind`` is :data:`RETRY` (``detail``: the RPC method)
or :data:`ERROR` (``detail``: the error's class name, e.g. ``"EtcdTimeoutError"``)."""


DeliveryListener = Callable[[int, int], None]
"""``listener(events, nbytes)``: a watch delivered ``events`` in a response of ``nbytes`` bytes."""


@dataclass(frozen=True)
class StatsSnapshot:
    """The counters at one moment: retries in total, errors by class name, watch events and
    the bytes of the responses that carried them."""

    retries: int
    errors: dict[str, int]
    watch_events: int = 0
    watch_bytes: int = 0


class CallStats:
    """Thread-safe counters of retries, errors and watch deliveries of one client, with listeners."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._retries = 0
        self._errors: Counter[str] = Counter()
        self._watch_events = 0
        self._watch_bytes = 0
        self._listeners: tuple[StatsListener, ...] = ()
        self._delivery_listeners: tuple[DeliveryListener, ...] = ()

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            return StatsSnapshot(self._retries, dict(self._errors), self._watch_events, self._watch_bytes)

    def subscribe_deliveries(self, listener: DeliveryListener) -> None:
        """Call ``listener(events, nbytes)`` on every watch delivery from now on (see the module
        docstring); subscribing the same callable twice is a no-op."""
        with self._lock:
            if listener not in self._delivery_listeners:
                self._delivery_listeners += (listener,)

    def delivered(self, events: int, nbytes: int) -> None:
        with self._lock:
            self._watch_events += events
            self._watch_bytes += nbytes
            listeners = self._delivery_listeners
        for listener in listeners:
            try:
                listener(events, nbytes)
            except Exception as e:  # a broken listener must not break a watch
                log.debug("etcd client delivery listener %r failed: %s", listener, e)

    def subscribe(self, listener: StatsListener) -> Callable[[], None]:
        """Call ``listener`` on every retry and error from now on; returns the unsubscribe.
        Subscribing the same callable twice is a no-op."""
        with self._lock:
            if listener not in self._listeners:
                self._listeners += (listener,)

        def unsubscribe() -> None:
            with self._lock:
                self._listeners = tuple(x for x in self._listeners if x != listener)

        return unsubscribe

    def retried(self, method: str) -> None:
        with self._lock:
            self._retries += 1
            listeners = self._listeners
        self._notify(listeners, RETRY, method)

    def failed(self, error: BaseException) -> None:
        name = type(error).__name__
        with self._lock:
            self._errors[name] += 1
            listeners = self._listeners
        self._notify(listeners, ERROR, name)

    @staticmethod
    def _notify(listeners: tuple[StatsListener, ...], kind: str, detail: str) -> None:
        if not listeners:
            return
        loop = started()
        if loop is not None and loop.on_loop():  # a stream's error: user code runs off the stream loop
            loop.offload(CallStats._call_each, listeners, kind, detail)
        else:
            CallStats._call_each(listeners, kind, detail)

    @staticmethod
    def _call_each(listeners: tuple[StatsListener, ...], kind: str, detail: str) -> None:
        for listener in listeners:
            try:
                listener(kind, detail)
            except Exception as e:  # a broken listener must not break an etcd call
                log.debug("etcd client stats listener %r failed: %s", listener, e)


_E = TypeVar("_E", bound=BaseException)


def counts_error(make: Callable[..., _E]) -> Callable[..., _E]:
    """Decorate a method of an object with a ``stats`` (:class:`CallStats`) attribute
    that builds the error the client raises: each error it builds is counted."""

    @wraps(make)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> _E:
        error = make(self, *args, **kwargs)
        self.stats.failed(error)
        return error

    return wrapper
