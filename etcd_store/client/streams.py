"""The one reconnecting stream of the client: watches and keep-alives both run on it.

:class:`ReconnectingStream` runs one gRPC stream after another over the transport's members
until its owner stops it or a failure is final. The owner gives a *body*: a coroutine that
opens the call on the member it is handed (with the metadata it is handed: the auth token and
``hasleader``), before its first ``await``, and consumes the answers, then says how the stream
ended (:class:`Ended`). The loop does the rest, once for both kinds of stream.

**Where a stream's fate is decided.** Every stream error, wherever it surfaces (login, write,
read, a call cancelled under a step, ``InvalidStateError``), is classified once here
(:func:`cause_of`; etcd's codes via the transport) and judged by one pure table,
:func:`~.retry.stream_fate`. As in etcd's Go client, a send's error decides nothing: :func:`send`
asks the call's receive side (at most :data:`SETTLE` seconds) and raises what it says. So a
stream etcd ends as it opens (no leader in a quorum loss: the write fails with INTERNAL
"Internal error from Core") reconnects, and only etcd's final answer (denied, compacted, bad
request) ends an owner.

**Backoff.** A stream that ended before any answer waits (:class:`~.retry.Backoff`: 0.1 s
doubling to 2 s, jittered), so a member refusing every stream costs a few attempts a second,
then one every 1-2 s; "reconnecting" is logged once per :data:`LOG_EVERY` seconds, with a count.

All of it runs on the stream loop (:mod:`.reactor`); between streams the loop waits for a
member's channel in 1 s steps, checking ``stopped()``; a login (a unary RPC) runs in a daemon
thread, never on the loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from ..errors import EtcdAuthError, EtcdError, EtcdPermissionDenied
from .retry import Backoff, Cause, Fate, StreamStep, stream_fate

if TYPE_CHECKING:
    from .channels import Member
    from .transport import Transport

log = logging.getLogger(__name__)

__all__ = ["SETTLE", "CallCancelled", "Ended", "ReconnectingStream", "SendFailed", "StreamEnded", "cause_of",
           "send", "step"]  # fmt: skip

_T = TypeVar("_T")

#: The longest :func:`send` waits for a call's receive side after a failed write.
SETTLE = 1.0
#: The "reconnecting" line of one stream is logged at most once per this many seconds.
LOG_EVERY = 30.0


class Ended(enum.Enum):
    """How one stream ended, as its body tells the loop."""

    STOP = "stop"  #: the owner is done (cancelled, nothing left to do): the loop returns
    AGAIN = "again"  #: open a new stream on the same member at once (after logging in again)
    MOVE = "move"  #: this member cannot serve (it ended the stream, "no leader"): the next member


Body = Callable[["Member", tuple[tuple[str, str], ...]], Coroutine[Any, Any, Ended]]


class CallCancelled(Exception):
    """A gRPC call was cancelled under a step of it (the client closed its channel): the stream
    is over, the owner's task is not."""


class StreamEnded(Exception):
    """etcd ended the stream cleanly (end of stream) while a request was being sent."""


class SendFailed(Exception):
    """A write failed and the call's receive side said nothing within :data:`SETTLE` seconds."""


async def step(awaited: Awaitable[_T], stopping: Callable[[], bool]) -> _T:
    """Await one step of a call (read, write, reader task): its result or ``grpc.RpcError``. A
    cancellation becomes :class:`CallCancelled` (the client closed the channel) unless
    ``stopping()`` (set by owners before cancelling their task), which propagates it. Makes no
    task: it runs for every message."""
    try:
        return await awaited
    except asyncio.CancelledError:
        if stopping():
            raise
        raise CallCancelled() from None


async def send(call: Any, message: Any, stopping: Callable[[], bool],
               receiving: asyncio.Future[Any] | None = None) -> None:
    """Write ``message`` on ``call`` (None: half-close). On a failed write, waits up to
    :data:`SETTLE` seconds for the receive side (``receiving``: the owner's pending read or
    reader task; else a read made here) and raises what it says: ``grpc.RpcError``,
    :class:`StreamEnded`, :class:`CallCancelled`, or :class:`SendFailed` if it says nothing."""
    try:
        await step(call.write(message) if message is not None else call.done_writing(), stopping)
    except (grpc.RpcError, asyncio.InvalidStateError) as e:
        raise await _receive_side(call, receiving, e) from None


async def _receive_side(call: Any, receiving: asyncio.Future[Any] | None, error: BaseException) -> BaseException:
    """What the receive side of ``call`` says after a failed write (see :func:`send`)."""
    own = receiving is None
    pending = asyncio.ensure_future(call.read()) if receiving is None else receiving
    try:
        done, _ = await asyncio.wait((pending,), timeout=SETTLE)
    finally:
        if own and not pending.done():
            pending.cancel()
    if not done:
        return SendFailed(f"a write failed ({error!r}) and the call's receive side said nothing in {SETTLE:g} s")
    if pending.cancelled():
        return CallCancelled()
    found = pending.exception()
    if found is not None:
        return found
    return StreamEnded()


def cause_of(error: BaseException, transport: Transport, member: Member, what: str,
             recoverable: Callable[[EtcdError], bool]) -> tuple[Cause, EtcdError | None] | None:
    """Classify a stream's error: its :class:`~.retry.Cause` and, for etcd's status, the translated
    error (a final one is the owner's). None for an error that is no stream failure (a defect)."""
    if isinstance(error, grpc.aio.UsageError | ValueError | CallCancelled):
        return Cause.CANCELLED_UNDER, None  # (ValueError: gRPC's "closed channel")
    if isinstance(error, grpc.RpcError):
        fatal = transport.stream_error(member, error, what)  # drops a refused token
        if fatal is None or recoverable(fatal):
            return Cause.RETRYABLE, fatal
        return Cause.FINAL, fatal
    if isinstance(error, asyncio.InvalidStateError | SendFailed):
        return Cause.LOCAL, None
    if isinstance(error, StreamEnded):
        return Cause.ENDED, None
    if isinstance(error, EtcdAuthError | EtcdPermissionDenied):
        return Cause.LOGIN_REFUSED, error
    if isinstance(error, EtcdError):
        return Cause.LOGIN_FAILED, error
    return None


class ReconnectingStream:
    """One stream after another on ``transport``'s members (see the module docstring).

    ``what`` names the stream in logs; ``stopped()``: the owner is done (checked before each
    stream and while waiting for a member); ``recoverable(error)``: a fatal-looking error that
    reconnects anyway (keep-alive "lease not found"); ``on_reconnect()`` runs after moving to
    the next member. The body calls :meth:`heard` on each answer (then no backoff).
    """

    def __init__(
        self,
        transport: Transport,
        what: str,
        stopped: Callable[[], bool],
        *,
        recoverable: Callable[[EtcdError], bool] = lambda _: False,
        on_reconnect: Callable[[], None] = lambda: None,
    ) -> None:
        self._transport = transport
        self.what = what
        self._stopped = stopped
        self._recoverable = recoverable
        self._on_reconnect = on_reconnect
        policy = transport.retry_policy
        self._backoff = Backoff(policy.stream_backoff, policy.stream_backoff_max)
        self._answered = False
        #: Streams opened (attempts), and the pauses taken before them, in seconds.
        self.attempts = 0
        self.paused = 0.0
        self._logged_at = float("-inf")
        self._unlogged = 0

    def heard(self) -> None:
        """The current stream answered (called by the body on each answer; costs a store)."""
        self._answered = True

    async def run(self, body: Body) -> EtcdError | None:
        """Run streams until ``body`` says :attr:`Ended.STOP` or ``stopped()`` (None), or a failure
        is final: the error (also :class:`EtcdError` "closed" when the client closed)."""
        transport = self._transport
        while not self._stopped():
            index, member = transport.stream_target()
            where = StreamStep.OPEN
            self._answered = False
            self.attempts += 1
            try:
                metadata = transport.stream_metadata_now(member)
                if metadata is None:  # a login first: a unary RPC, never on the loop
                    deadline = time.monotonic() + transport.timeout
                    metadata = await transport.reactor.blocking(transport.stream_metadata, member, deadline)
                if transport.closed:  # checked with no await before the body opens its call
                    return self._closed()
                where = StreamStep.RECEIVE  # a send's failure reaches here as its receive side's word
                ended = await body(member, metadata)
            except Exception as e:
                classified = cause_of(e, transport, member, self.what, self._recoverable)
                if classified is None:
                    raise  # a defect: the owner tells its consumers
                cause, error = classified
                fate = stream_fate(where, cause, stopping=self._stopped(), closed=transport.closed)
                if fate is Fate.STOP:
                    return None
                if fate is Fate.CLOSED:
                    return self._closed()
                if fate is Fate.FINAL:
                    assert error is not None
                    return error
                ended = Ended.MOVE
            if self._answered:
                self._backoff.reset()
            if ended is Ended.STOP:
                return None
            if not self._answered:
                await self._pause()
                if self._stopped():
                    return None
            if ended is Ended.AGAIN:
                continue
            self._log_reconnect(member)
            if not await self._next_member(index):
                return self._closed() if transport.closed else None
            self._on_reconnect()
        return None

    async def _pause(self) -> None:
        """The backoff before the next attempt of a stream that never answered."""
        pause = self._backoff.pause()
        self.paused += pause
        await asyncio.sleep(pause)

    def _log_reconnect(self, member: Member) -> None:
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more reconnects in the last {now - self._logged_at:.0f} s)" if self._unlogged else ""
        log.info("%s lost %s; reconnecting%s", self.what, member.endpoint, more)
        self._logged_at = now
        self._unlogged = 0

    async def _next_member(self, index: int) -> bool:
        """Move on from member ``index`` to the next whose channel is ready; False when the
        owner stopped or the client closed first."""
        transport = self._transport
        transport.stream_moved(index)
        while not (self._stopped() or transport.closed):
            nxt, member = transport.stream_target()
            if await member.ready(timeout=1.0):
                return True
            transport.stream_moved(nxt)
        return False

    def _closed(self) -> EtcdError:
        return EtcdError(f"The etcd client for {self._transport.describe()} was closed.")
