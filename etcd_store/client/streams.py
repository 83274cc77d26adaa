"""The one reconnecting stream of the client: watches and keep-alives both run on it.

:class:`ReconnectingStream` runs one gRPC stream after another over the transport's members
until its owner stops it or a failure is final. The owner gives a *body*: it opens the call on
the member it is handed (with the metadata it is handed: the auth token and ``hasleader``) and
consumes the answers, then says how the stream ended (:class:`Ended`). The loop does the rest,
once for both kinds of stream: a broken stream (member gone, etcd restarted, "no leader") is
recognised by the transport (:meth:`~.transport.Transport.stream_error`) and reopened on the
next member whose channel is ready; a refused token is dropped so the next stream logs in; a
closed client ends the loop with an error.

Blocking: :meth:`ReconnectingStream.run` blocks its (the owner's) thread until the end; between
streams it waits for a member's channel in steps of one second, checking ``stopped()``.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from ..errors import EtcdError

if TYPE_CHECKING:
    from .channels import Member
    from .transport import Transport

log = logging.getLogger(__name__)

__all__ = ["Ended", "ReconnectingStream"]


class Ended(enum.Enum):
    """How one stream ended, as its body tells the loop."""

    STOP = "stop"  #: the owner is done (cancelled, nothing left to do): the loop returns
    AGAIN = "again"  #: open a new stream on the same member at once (after logging in again)
    MOVE = "move"  #: this member cannot serve (it ended the stream, "no leader"): the next member


Body = Callable[["Member", tuple[tuple[str, str], ...]], Ended]


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

    def run(self, body: Body) -> EtcdError | None:
        """Run streams until ``body`` says :attr:`Ended.STOP` or ``stopped()`` (None), or a failure
        is final: the error (also :class:`EtcdError` "closed" when the client closed)."""
        transport = self._transport
        while not self._stopped():
            index, member = transport.stream_target()
            try:
                metadata = transport.stream_metadata(member, time.monotonic() + transport.timeout)
                ended = body(member, metadata)
            except grpc.RpcError as e:
                if self._stopped():
                    return None
                fatal = transport.stream_error(member, e, self.what)
                if fatal is not None and not self._recoverable(fatal):
                    return fatal
                ended = Ended.MOVE
            except EtcdError as e:  # auth refused while logging in
                return e
            except ValueError:  # the channel was closed by client.close()
                return self._closed()
            if ended is Ended.STOP:
                return None
            if ended is Ended.AGAIN:
                continue
            log.info("%s lost %s; reconnecting", self.what, member.endpoint)
            if not self._next_member(index):
                return self._closed() if transport.closed else None
            self._on_reconnect()
        return None

    def _next_member(self, index: int) -> bool:
        """Move on from member ``index`` to the next whose channel is ready; False when the
        owner stopped or the client closed first."""
        transport = self._transport
        transport.stream_moved(index)
        while not (self._stopped() or transport.closed):
            nxt, member = transport.stream_target()
            if member.wait_ready(timeout=1.0):
                return True
            transport.stream_moved(nxt)
        return False

    def _closed(self) -> EtcdError:
        return EtcdError(f"The etcd client for {self._transport.describe()} was closed.")

