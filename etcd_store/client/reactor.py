"""The one event loop of a process on which every client's streams run.

Why: with gRPC's synchronous API each waiting stream holds a thread (woken ten times a second)
plus a sender thread: about five threads and 1.6 ms of CPU per second per idle client
(``benchmarks/client_cost.py``). Here every stream of every client is a coroutine on one
asyncio loop (``grpc.aio``) in one daemon thread started with the first stream (plus gRPC's
poller thread); an idle client costs no thread. Unary calls stay synchronous.

:func:`reactor` returns the process's :class:`Reactor`. A process ``fork``-ed from one whose
streams ran cannot run streams (``grpc.aio`` does not survive a fork: a watch would never be
confirmed), so :func:`reactor` raises :class:`~etcd_store.errors.EtcdError` there at once; use
``spawn``/``forkserver``, or fork before the first stream. A forked child making no stream (a
DataLoader worker) is unaffected, as is the parent.

Other code reaches the loop through :meth:`Reactor.call_soon` (any thread, never blocks). Code on
the loop must not block (it would stall every stream): :meth:`Reactor.blocking` runs a login in
a daemon thread, :meth:`Reactor.offload` runs user callbacks in another, and a watchdog logs any
pass that held the loop over :data:`LAG_WARNING` (0.1 s).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import queue
import selectors
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ..errors import EtcdError

log = logging.getLogger(__name__)

__all__ = ["Reactor", "reactor", "started"]

_T = TypeVar("_T")


#: A loop step that held the loop longer than this is logged by the watchdog (:class:`_StepTimer`).
LAG_WARNING = 0.1


def _run_queue_clock() -> Callable[[], float] | None:
    """A clock (seconds) of the calling thread's wait for a CPU: the second field of Linux's
    ``/proc/thread-self/schedstat``, one ``pread`` on a kept descriptor. None where unavailable."""
    try:
        fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None

    def waited() -> float:
        return int(os.pread(fd, 128, 0).split()[1]) / 1e9

    try:
        waited()
    except (OSError, IndexError, ValueError):
        os.close(fd)
        return None
    return waited


class _StepTimer(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The loop's selector, timing each pass between two waits for I/O. A pass holding the loop over
    :data:`LAG_WARNING` (something blocked on it) is logged at WARNING and counted in ``lags``.
    On Linux the thread's wait for a CPU is subtracted: a pass slow only because the machine was
    busy counts in ``preempted`` (DEBUG). Nothing is reported once the main thread ended
    (interpreter teardown holds the GIL). Costs two clock reads (and two ``pread``) a pass."""

    def __init__(self, reactor: Reactor) -> None:
        super().__init__()
        self._reactor = reactor
        self._left = time.monotonic()
        self._waited: Callable[[], float] | None = None
        self._opened = False
        self._waited_at_left = 0.0

    def _run_queue(self) -> float:
        if not self._opened:  # on the loop's thread: thread-self is the loop's
            self._opened = True
            self._waited = _run_queue_clock()
        return self._waited() if self._waited is not None else 0.0

    def select(self, timeout: float | None = None) -> Any:
        took = time.monotonic() - self._left
        held = took
        if took > LAG_WARNING:
            held = took - (self._run_queue() - self._waited_at_left)  # less its wait for a CPU
        if held > self._reactor.max_lag:
            self._reactor.max_lag = held
        if held > LAG_WARNING and not threading.main_thread().is_alive():
            held = 0.0  # the interpreter is exiting: its teardown holds the GIL, nothing of ours waits
        if held > LAG_WARNING:
            self._reactor.lags += 1
            log.warning("a step of the etcd stream loop took %.0f ms (something blocked on it): every "
                        "watch and keep-alive of the process waited", held * 1000)
        elif took > LAG_WARNING:
            self._reactor.preempted += 1
            log.debug("a step of the etcd stream loop took %.0f ms, %.0f ms of it waiting for a CPU (a busy "
                      "machine)", took * 1000, (took - held) * 1000)
        try:
            return super().select(timeout)
        finally:
            self._waited_at_left = self._run_queue()  # first: its pread may wait for the GIL
            self._left = time.monotonic()


class Reactor:
    """One asyncio loop in one daemon thread (``etcd-streams``), started by the constructor.

    :meth:`blocking` uses a daemon thread, not an executor (whose threads would be joined before
    ``atexit``). Watchdog counters (:class:`_StepTimer`): :attr:`lags`, :attr:`max_lag` (the tests
    assert it stays quiet), :attr:`preempted`.
    """

    def __init__(self) -> None:
        self.lags = 0
        self.preempted = 0
        self.max_lag = 0.0
        self.loop = asyncio.SelectorEventLoop(_StepTimer(self))
        self._callbacks: queue.SimpleQueue[tuple[contextvars.Context, Callable[..., Any], tuple[Any, ...]]] = (
            queue.SimpleQueue())
        self._callback_thread: threading.Thread | None = None
        self._callback_lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="etcd-streams", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop, in the caller's ``contextvars`` context (any thread; never blocks)."""
        self.loop.call_soon_threadsafe(fn, *args, context=contextvars.copy_context())

    def spawn(self, coro: Coroutine[Any, Any, _T], context: contextvars.Context) -> asyncio.Task[_T]:
        """A task for ``coro`` running in ``context``; on the loop only. Made inside ``context.run``
        (a task copies the current context), as ``create_task(context=...)`` needs Python 3.11."""
        return context.run(self.loop.create_task, coro)

    async def blocking(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` (a login) in its own daemon thread, awaited; exit does not wait for it."""
        loop = self.loop
        done: asyncio.Future[_T] = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

        def work() -> None:
            try:
                result = fn(*args)
            except BaseException as e:  # handed to the awaiting stream, which classifies it
                loop.call_soon_threadsafe(settle, None, e)
            else:
                loop.call_soon_threadsafe(settle, result, None)

        threading.Thread(target=work, name="etcd-login", daemon=True).start()
        return await done

    def on_loop(self) -> bool:
        """Whether the caller runs on the loop's thread."""
        return threading.current_thread() is self._thread

    def offload(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` (user code, e.g. ``on_lost``) in the ``etcd-callbacks`` daemon thread, in
        order, in the caller's ``contextvars`` context; never blocks. Errors are logged."""
        self._callbacks.put((contextvars.copy_context(), fn, args))
        if self._callback_thread is None:
            with self._callback_lock:
                if self._callback_thread is None:
                    self._callback_thread = threading.Thread(target=self._run_callbacks, name="etcd-callbacks",
                                                             daemon=True)
                    self._callback_thread.start()

    def _run_callbacks(self) -> None:
        while True:
            context, fn, args = self._callbacks.get()
            try:
                context.run(fn, *args)
            except Exception:
                log.exception("an etcd client callback (%r) failed", fn)


_lock = threading.Lock()
_current: tuple[int, Reactor] | None = None


def reactor() -> Reactor:
    """The process's reactor, started on first use. Raises :class:`EtcdError` in a process forked
    from one whose streams ran (see the module docstring)."""
    global _current
    pid = os.getpid()
    current = _current
    if current is not None and current[0] == pid:
        return current[1]
    with _lock:
        if _current is not None and _current[0] != pid:
            raise EtcdError(
                f"etcd streams (watches, lease keep-alives) cannot run in process {pid}: it was forked from "
                f"process {_current[0]}, whose etcd streams ran, and gRPC's asyncio API does not survive a fork. "
                "Start this process with the 'spawn' or 'forkserver' method, or fork before the first stream."
            )
        if _current is None:
            _current = (pid, Reactor())
            log.debug("stream loop started in process %d", pid)
        return _current[1]


def started() -> Reactor | None:
    """The process's reactor if one was started (no stream ever ran otherwise); starts none."""
    current = _current
    return current[1] if current is not None and current[0] == os.getpid() else None
