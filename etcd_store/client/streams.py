"""The one reconnecting stream of the client: watches and keep-alives both run on it.

:class:`ReconnectingStream` runs one gRPC stream after another over the transport's members
until its owner stops it or a failure is final. The owner gives a *body*: a coroutine that
opens the call on the member it is handed (with the metadata it is handed: the auth token and
``hasleader``), before its first ``await``, and consumes the answers, then says how the stream
ended (:class:`Ended`). The loop does the rest,
once for both kinds of stream: a broken stream (member gone, etcd restarted, "no leader") is
recognised by the transport (:meth:`~.transport.Transport.stream_error`) and reopened on the
next member whose channel is ready; a refused token is dropped so the next stream logs in; a
closed client ends the loop with an error.

Everything here runs on the process's stream loop (:mod:`.reactor`): :meth:`ReconnectingStream.run`
is a coroutine that ends with the stream's owner; between streams it waits for a member's
channel in steps of one second, checking ``stopped()``; a login (a unary RPC) runs in a worker
thread. :func:`step` awaits one step of a call (a read, a write) and tells a call cancelled
under it (the client closing) from the owner's task being cancelled (its owner is stopping).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from ..errors import EtcdError

if TYPE_CHECKING:
    from .channels import Member
    from .transport import Transport

log = logging.getLogger(__name__)

__all__ = ["CallCancelled", "Ended", "ReconnectingStream", "step"]

_T = TypeVar("_T")


class Ended(enum.Enum):
    """How one stream ended, as its body tells the loop."""

    STOP = "stop"  #: the owner is done (cancelled, nothing left to do): the loop returns
    AGAIN = "again"  #: open a new stream on the same member at once (after logging in again)
    MOVE = "move"  #: this member cannot serve (it ended the stream, "no leader"): the next member


Body = Callable[["Member", tuple[tuple[str, str], ...]], Coroutine[Any, Any, Ended]]


class CallCancelled(Exception):
    """A gRPC call was cancelled under a step of it (the client closed its channel): the stream
    is over, the owner's task is not."""


async def step(awaited: Awaitable[_T], stopping: Callable[[], bool]) -> _T:
    """Await one step of a call (a read, a write, a reader task): its result or its error
    (``grpc.RpcError``). A cancellation is :class:`CallCancelled` (the call was cancelled under
    the step: the client closed its channel) unless ``stopping()`` says the owner is being
    stopped, whose task's cancellation then goes on as it is (owners set that flag before they
    cancel their task). No task is made: this runs for every message of a stream."""
    try:
        return await awaited
    except asyncio.CancelledError:
        if stopping():
            raise
        raise CallCancelled() from None


class ReconnectingStream:
    """One stream after another on ``transport``'s members (see the module docstring).

    ``what`` names the stream in errors and logs; ``stopped()`` says the owner is done (checked
    before each stream and while waiting for a member). ``recoverable(error)``: a fatal-looking
    stream error that should reconnect all the same (a keep-alive's "lease not found").
    ``on_reconnect()`` runs after the loop moved to the next member, before its next stream.
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

    async def run(self, body: Body) -> EtcdError | None:
        """Run streams until ``body`` says :attr:`Ended.STOP` or ``stopped()`` (None), or a failure
        is final: the error (also :class:`EtcdError` "closed" when the client closed)."""
        transport = self._transport
        while not self._stopped():
            index, member = transport.stream_target()
            try:
                deadline = time.monotonic() + transport.timeout
                if transport.login_pending(member):
                    metadata = await transport.reactor.blocking(transport.stream_metadata, member, deadline)
                else:
                    metadata = transport.stream_metadata(member, deadline)
                if transport.closed:  # checked with no await before the body opens its call
                    return self._closed()
                ended = await body(member, metadata)
            except grpc.RpcError as e:
                if self._stopped():
                    return None
                fatal = transport.stream_error(member, e, self.what)
                if fatal is not None and not self._recoverable(fatal):
                    return fatal
                ended = Ended.MOVE
            except EtcdError as e:  # auth refused while logging in
                return e
            except (CallCancelled, ValueError, grpc.aio.UsageError):  # cancelled, or the channel closed
                if self._stopped():
                    return None
                if transport.closed:
                    return self._closed()
                ended = Ended.MOVE
            if ended is Ended.STOP:
                return None
            if ended is Ended.AGAIN:
                continue
            log.info("%s lost %s; reconnecting", self.what, member.endpoint)
            if not await self._next_member(index):
                return self._closed() if transport.closed else None
            self._on_reconnect()
        return None

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

