"""Watches: a key or key range's events, delivered in order to a queue.

Each :class:`Watch` is a task on the stream loop (:mod:`.reactor`; no thread of its own), in a
copy of its creator's ``contextvars`` context, that owns its gRPC stream and resumes it on the
next endpoint from the revision after the last event delivered
(:class:`~.streams.ReconnectingStream`). Consumers block on its queue (:meth:`Watch.get`) in
their own threads; delivered batches count into :class:`~.stats.CallStats` (``watch_events``,
``watch_bytes``).

Liveness: a stream quiet for ``stream_quiet`` seconds sends one ``WatchProgressRequest``
(answered by etcd 3.4+); one owing an answer (to its create or progress request) that hears
nothing for ``first_attempt`` seconds (grown by :func:`~.retry.stall_bound`) is resumed on the
next member, so a hung or SIGSTOPped member is left, which HTTP/2 keepalive does not do. A quiet
stream thus sends one small request about every ``max(stream_quiet, first_attempt)`` seconds
(none while events flow), and a frozen member is left within about ``stream_quiet +
first_attempt`` (7 s by default).

Memory: the queue is unbounded: a watch holds every event not yet taken (about keys and values
plus 0.5 KiB each: 30,000 undrained 4 KiB events measured +133 MiB RSS with etcd 3.7). The
client's own consumers drain or cancel their watches; a caller of
:meth:`~etcd_store.client.EtcdClient.watch` must do the same.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
from etcd3.etcdrpc import rpc_pb2

from ..errors import EtcdCompactedError, EtcdError
from .channels import Member
from .kv import Event, KeyValue, show_key
from .retry import Failure, stall_bound, stream_reconnects
from .streams import Ended, ReconnectingStream, send, step
from .transport import Transport

log = logging.getLogger(__name__)

__all__ = ["Watch"]

# --------------------------------------------------------------------------- watches

_CLOSED = object()


class Watch:
    """A watch on a key or key range, with events delivered to a queue.

    A broken stream (member down, etcd restarted) is resumed elsewhere from the revision after
    the last delivered event: no event lost or repeated. Errors retrying cannot fix
    (compaction, permission denied) are raised from :meth:`get`. ``created_revision``: the
    store revision when etcd registered the watch.
    """

    def __init__(
        self, client: Transport, key: bytes, range_end: bytes, start_revision: int, prev_kv: bool
    ) -> None:
        self._client = client
        self.key = key
        self.range_end = range_end
        self._next_revision = start_revision
        self._prev_kv = prev_kv
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._created = threading.Event()
        self.created_revision = 0
        self._task: asyncio.Task[None] | None = None  # on the stream loop
        self._heard = 0.0  # when the current stream last answered (time.monotonic())
        #: Streams ended because they did not answer in time (see the module docstring).
        self.streams_stalled = 0
        self._stalls_in_row = 0  # of those, since the last answer: the bound doubles (retry.stall_bound)
        #: Progress requests sent on quiet streams.
        self.progress_requests = 0
        self._loop = client.reactor
        self._loop.call_soon(self._start)

    # -------------------------------------------------------- consumer side

    def get(self, timeout: float | None = None) -> list[Event]:
        """The next batch of events; ``[]`` when ``timeout`` passed with none. Raises the watch's
        fatal error (:class:`EtcdCompactedError`, ...), or :class:`EtcdError` once cancelled."""
        try:
            item = self._queue.get(timeout=timeout) if timeout is None or timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return []
        if item is _CLOSED:
            self._queue.put(_CLOSED)
            raise EtcdError(f"watch on {show_key(self.key)} was cancelled")
        if isinstance(item, BaseException):
            self._queue.put(item)
            raise item
        return list(item)

    def __iter__(self) -> Iterator[Event]:
        while True:
            try:
                batch = self.get()
            except EtcdError:
                if self._cancelled.is_set():
                    return
                raise
            yield from batch

    def wait_created(self, timeout: float) -> bool:
        """Block until etcd confirmed the watch (or ``timeout``)."""
        return self._created.wait(timeout)

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop the watch (its task and stream end on the loop soon after). Idempotent, never blocks."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._loop.call_soon(self._stop)
        self._queue.put(_CLOSED)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    # -------------------------------------------------------- the task, on the stream loop

    def _start(self) -> None:
        if not self._cancelled.is_set():
            self._task = self._loop.spawn(self._run(), contextvars.copy_context())

    def _stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        """Streams until cancelled or a final failure (raised from :meth:`get`)."""
        self._relogged = False  # logged in again for this watch since etcd last confirmed it
        stream = self._reconnecting = ReconnectingStream(
            self._client, f"watch on {show_key(self.key)}", self._cancelled.is_set)
        try:
            fatal = await stream.run(self._stream)
        except asyncio.CancelledError:
            return
        except Exception as e:  # a defect: the consumer hears of it rather than waiting forever
            log.exception("watch on %s failed", show_key(self.key))
            fatal = EtcdError(f"watch on {show_key(self.key)} failed: {e!r}")
        if fatal is not None:
            self._fail(fatal)

    def _create_request(self) -> Any:
        return rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(
            key=self.key, range_end=self.range_end, start_revision=self._next_revision, prev_kv=self._prev_kv,
        ))  # fmt: skip

    async def _stream(self, member: Member, metadata: tuple[tuple[str, str], ...]) -> Ended:
        """One watch stream on ``member`` from the next undelivered revision; how it ended
        (liveness: the module docstring)."""
        call = member.stream_stub("Watch").Watch(metadata=metadata)
        note = self._client.stream_opened("Watch/Watch")  # a test's interceptor, else None
        policy = self._client.retry_policy
        stopping = self._cancelled.is_set
        read: asyncio.Future[Any] | None = None
        try:
            create = self._create_request()
            if note is not None:
                note(True, create)
            await send(call, create, stopping)
            asked: float | None = time.monotonic()  # when the request awaiting an answer was sent
            while True:
                if read is None:
                    read = asyncio.ensure_future(call.read())
                now = time.monotonic()
                if asked is None:
                    wait = self._heard + policy.stream_quiet - now
                else:
                    wait = asked + stall_bound(policy.first_attempt, self._stalls_in_row) - now
                if wait > 0:
                    await asyncio.wait((read,), timeout=wait)
                if not read.done():
                    if asked is not None:
                        return self._stalled(member, time.monotonic() - asked)
                    asked = time.monotonic()
                    self.progress_requests += 1
                    progress = rpc_pb2.WatchRequest(progress_request=rpc_pb2.WatchProgressRequest())
                    if note is not None:
                        note(True, progress)
                    await send(call, progress, stopping, read)
                    continue
                resp = await step(read, stopping)
                read = None
                if resp is grpc.aio.EOF:  # etcd ended the stream
                    return Ended.STOP if self._cancelled.is_set() else Ended.MOVE
                if note is not None:
                    note(False, resp)
                self._reconnecting.heard()
                self._heard = time.monotonic()
                self._stalls_in_row = 0
                if asked is not None and self._heard >= asked:
                    asked = None
                outcome = self._answer(member, resp)
                if outcome is not None:
                    return outcome
        finally:
            if read is not None and not read.done():
                read.cancel()
            call.cancel()

    def _stalled(self, member: Member, silent: float) -> Ended:
        """The stream answered nothing for ``silent`` seconds: resume on the next member."""
        self.streams_stalled += 1
        self._stalls_in_row += 1
        log.warning("watch on %s: %s answered nothing for %.1f s; moving on",
                    show_key(self.key), member.endpoint, silent)  # fmt: skip
        return Ended.MOVE

    def _answer(self, member: Member, resp: Any) -> Ended | None:
        """Deliver one response; None to read on, else how the stream ends."""
        client = self._client
        if resp.canceled and not self._relogged and client.cancel_wants_login(resp.cancel_reason):
            # etcd restarted and forgot the token: log in again and resume on the same member.
            log.info("watch on %s: %s; logging in again", show_key(self.key), resp.cancel_reason)
            member.token = None
            self._relogged = True
            return Ended.AGAIN
        if resp.created:
            self._relogged = self._relogged and resp.canceled
            self.created_revision = resp.header.revision
            if self._next_revision == 0:
                self._next_revision = resp.header.revision + 1
            self._created.set()
        if resp.compact_revision:
            self._fail(EtcdCompactedError(
                f"watch on {show_key(self.key)} at {client.describe()}: revision {self._next_revision} "
                f"was compacted (oldest kept {resp.compact_revision})"
            ))  # fmt: skip
            return Ended.STOP
        if resp.canceled:
            reason = resp.cancel_reason or "cancelled by etcd"
            failure = client.cancel_failure(reason)
            if failure is not Failure.STALE_TOKEN and stream_reconnects(failure):
                return Ended.MOVE  # this member cannot serve ("no leader"): resume on another
            self._fail(client.cancel_error(reason, f"watch on {show_key(self.key)}"))
            return Ended.STOP
        if resp.events:
            batch = [self._event(ev) for ev in resp.events]
            self._next_revision = batch[-1].kv.mod_revision + 1
            client.stats.delivered(len(batch), resp.ByteSize())
            self._queue.put(batch)
        return None

    def _fail(self, err: BaseException) -> None:
        self._created.set()
        self._queue.put(err)

    def _event(self, ev: Any) -> Event:
        kind = "DELETE" if ev.type == 1 else "PUT"
        prev = KeyValue._from_pb(ev.prev_kv) if ev.HasField("prev_kv") else None
        return Event(kind, KeyValue._from_pb(ev.kv), prev)

