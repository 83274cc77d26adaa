"""gRPC channels of the client: per endpoint, one lazily made channel for unary calls and one for streams.

:class:`Member` is one endpoint's channels, stubs and auth token; :func:`open_channel` makes a
channel with the client's options (message sizes, reconnect backoff, HTTP/2 keepalive, gRPC's
own retries off: the client has its own policy, :mod:`.retry`). Unary calls use a synchronous
channel (the caller's thread blocks); watch and keep-alive streams use a ``grpc.aio`` channel,
made and used only on the process's stream loop (:mod:`.reactor`), so a stream holds no thread.
Nothing here makes an RPC; making a channel does not connect (gRPC connects on the first call).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from ..errors import EtcdTLSError
from .endpoints import Endpoint
from .reactor import started

__all__ = ["Member", "channel_credentials", "check_options", "open_aio_channel", "open_channel"]

_OPTIONS = [
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.enable_retries", 0),
]


class Member:
    """One endpoint's channels and stubs, created lazily, and its auth token (None: log in first).

    The synchronous channel (:meth:`stub`) may be used from any thread; the stream channel
    (:meth:`stream_stub`, :meth:`ready`) only on the stream loop.
    """

    def __init__(self, endpoint: Endpoint, factory: Callable[[Endpoint], grpc.Channel],
                 aio_factory: Callable[[Endpoint], grpc.aio.Channel]) -> None:
        self.endpoint = endpoint
        self._factory = factory
        self._aio_factory = aio_factory
        self._channel: grpc.Channel | None = None
        self._aio: grpc.aio.Channel | None = None
        self.stubs: dict[str, Any] = {}
        self._stream_stubs: dict[str, Any] = {}
        self.token: str | None = None

    def stub(self, service: str) -> Any:
        """The stub of etcd's gRPC ``service`` (``"KV"``, ``"Watch"``, ...) on this member."""
        stub = self.stubs.get(service)
        if stub is None:
            stub = self.stubs[service] = _stub(service, self.channel())
        return stub

    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = self._factory(self.endpoint)
        return self._channel

    def stream_stub(self, service: str) -> Any:
        """The stub of ``service`` on the stream channel (on the stream loop only)."""
        stub = self._stream_stubs.get(service)
        if stub is None:
            stub = self._stream_stubs[service] = _stub(service, self._aio_channel())
        return stub

    def _aio_channel(self) -> grpc.aio.Channel:
        if self._aio is None:
            self._aio = self._aio_factory(self.endpoint)
        return self._aio

    async def ready(self, timeout: float) -> bool:
        """Wait until the stream channel connects (True) or ``timeout`` passes or it is closed (False)."""
        try:
            await asyncio.wait_for(self._aio_channel().channel_ready(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
        except Exception:  # closed under us
            return False

    def close(self) -> None:
        """Close both channels (their calls and streams end); the next stub makes new ones.
        The stream channel closes on the stream loop, soon after (no wait): whatever stream
        channel exists when the loop gets there, so a stream opened meanwhile ends too."""
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self.stubs.clear()
        loop = started()
        if loop is not None:  # else no stream ever ran in this process: no stream channel exists
            loop.call_soon(self._close_stream_channel)

    def _close_stream_channel(self) -> None:
        aio, self._aio = self._aio, None
        self._stream_stubs = {}
        if aio is not None:
            asyncio.ensure_future(aio.close())


def _stub(service: str, channel: Any) -> Any:
    from etcd3.etcdrpc import rpc_pb2_grpc

    return getattr(rpc_pb2_grpc, f"{service}Stub")(channel)


def channel_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials:
    """TLS credentials from PEM files; raises :class:`EtcdTLSError` naming a file it cannot read."""

    def read(path: str | None, what: str) -> bytes | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise EtcdTLSError(f"Cannot read TLS {what} file {path!r}: {e}") from None

    return grpc.ssl_channel_credentials(read(ca, "CA"), read(key, "client key"), read(cert, "client certificate"))


def open_channel(
    endpoint: Endpoint, credentials: Callable[[], grpc.ChannelCredentials], interceptors: Sequence[Any]
) -> grpc.Channel:
    """A channel to ``endpoint`` (TLS when it is ``https``; ``credentials`` called only then)."""
    if endpoint.secure:
        channel = grpc.secure_channel(endpoint.target, credentials(), _OPTIONS)
    else:
        channel = grpc.insecure_channel(endpoint.target, _OPTIONS)
    if interceptors:
        channel = grpc.intercept_channel(channel, *interceptors)
    return channel


def open_aio_channel(endpoint: Endpoint, credentials: Callable[[], grpc.ChannelCredentials]) -> grpc.aio.Channel:
    """A stream channel to ``endpoint``, with :func:`open_channel`'s options; on the stream loop only.
    (Client interceptors are synchronous: they see no stream; see ``Transport.stream_opened``.)"""
    if endpoint.secure:
        return grpc.aio.secure_channel(endpoint.target, credentials(), _OPTIONS)
    return grpc.aio.insecure_channel(endpoint.target, _OPTIONS)


def check_options(
    *, protocol: str | None, ca_cert: str | None, cert: str | None, key: str | None, user: str | None,
    password: str | None, timeout: float, connect_timeout: float,
) -> bool | None:
    """Check a client's options; the scheme of endpoints written without one (True: ``https``,
    None: plain unless a URL says ``https``). Raises ``ValueError`` naming the bad option."""
    if protocol not in (None, "http", "https"):
        raise ValueError(f"Invalid etcd protocol {protocol!r}: use 'http' or 'https'.")
    if (cert is None) != (key is None):
        raise ValueError("TLS client certificate and key must be given together (cert, key).")
    if (user is None) != (password is None) and not (user and password == ""):
        raise ValueError("etcd user and password must be given together.")
    if timeout <= 0:
        raise ValueError(f"etcd client timeout must be positive, got {timeout}.")
    if connect_timeout <= 0:
        raise ValueError(f"etcd client connect_timeout must be positive, got {connect_timeout}.")
    if protocol is not None:
        return protocol == "https"
    return True if ca_cert or cert else None
