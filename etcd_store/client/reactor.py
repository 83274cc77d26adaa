"""The one event loop of a process on which every client's streams run.

A watch or a keep-alive stream spends its life waiting for etcd's next answer. With gRPC's
synchronous API each such wait holds a thread of its own, which gRPC wakes ten times a
second, and each stream adds a request-sending thread: about five threads and 1.6 ms of CPU
per second per idle client (``benchmarks/client_cost.py``). Here every stream of
every client in the process is a coroutine on one asyncio loop (gRPC's ``grpc.aio`` API), run
by one daemon thread that starts with the first stream; gRPC adds one poller thread of its own.
An idle client then costs no thread. Unary calls stay on the synchronous channels (their
caller's thread blocks).

:func:`reactor` returns the process's :class:`Reactor`, started on first use. A process
``fork``-ed from one whose streams ran cannot run streams (gRPC's asyncio API does not survive
a fork: its poller thread stays in the parent; a watch there would never be confirmed), so
:func:`reactor` raises :class:`~etcd_store.errors.EtcdError` there, at once, saying so; start
such processes with ``spawn`` or ``forkserver``, or before the parent's first stream. A forked
child that makes no stream (a DataLoader worker) is not affected; nor is the parent. Everything else in the client reaches the loop
through :meth:`Reactor.call_soon` (from any thread, never blocks) and code that already runs
on it. Code on the loop must not block: a blocking call there (a unary RPC, a lock held long)
stalls every stream of the process; :meth:`Reactor.blocking` runs one (a login) in a daemon
thread, :meth:`Reactor.offload` runs callbacks into user code in another, and a watchdog logs
any pass of the loop that held it over :data:`LAG_WARNING` (0.1 s).
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
    """A clock of the calling thread's time spent waiting for a CPU (runnable, not running), in seconds:
    Linux's ``/proc/thread-self/schedstat`` (its second field), read with one ``pread`` on a descriptor
    kept open (a few microseconds). None where there is no such file (not Linux, no schedstats)."""
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
    """The loop's selector, timing each pass of the loop between two waits for I/O: the steps it
    ran (callbacks, task steps). A pass that held the loop over :data:`LAG_WARNING` seconds (a
    blocking call on the loop: a lock, an RPC, a long computation) is logged at WARNING and counted
    in ``lags``. Time spent waiting for I/O between passes is not counted, nor, on Linux, the time
    the loop's thread waited for a CPU during a pass (its run-queue wait, from schedstat): a pass
    that was only slow because the machine was busy is counted in ``preempted`` and logged at DEBUG,
    and once the main thread has ended (the interpreter exiting, its teardown holding the GIL) a
    pass is not reported. ``max_lag`` is the longest hold. Costs two clock reads and, on Linux, two ``pread`` of schedstat
    a pass."""

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

    Nothing that can block runs on the loop: :meth:`blocking` runs a login in a daemon thread of
    its own (exit never waits for one: an executor's threads would be joined before ``atexit``),
    :meth:`offload` hands callbacks into user code (a lost lease's ``on_lost``) to the
    ``etcd-callbacks`` daemon thread. A watchdog in the loop's selector times each pass of the
    loop: one that held the loop over :data:`LAG_WARNING` seconds is logged at WARNING and counted in
    :attr:`lags`, the longest hold kept in :attr:`max_lag` (the tests assert it stays quiet); one
    that was only slow waiting for a CPU is counted in :attr:`preempted`.
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
        """A task for ``coro`` running in ``context``; call on the loop only.

        A task copies the context current when it is made, so making it inside ``context.run``
        runs it there (``create_task(context=...)`` is Python 3.11+ only; the package claims 3.10)."""
        return context.run(self.loop.create_task, coro)

    async def blocking(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in a daemon thread of its own, awaited (the rare blocking step of a stream:
        a login). The process's exit does not wait for it."""
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
        """Run ``fn(*args)`` in the ``etcd-callbacks`` daemon thread, in order with other offloaded
        calls, in the caller's ``contextvars`` context (never blocks; call from the loop: callbacks
        into user code must not stall it). An error is logged with its traceback."""
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
