"""gRPC channels of the client: per endpoint, one lazily made channel for unary calls and one for streams.

:class:`Member` is one endpoint's channels, stubs and auth token; :func:`open_channel` applies
the client's options (message sizes, reconnect backoff, HTTP/2 keepalive, gRPC's own retries
off: :mod:`.retry` is the policy). Unary calls use a synchronous channel; streams a ``grpc.aio``
channel, made and used only on the stream loop (:mod:`.reactor`). Nothing here makes an RPC;
a channel connects on its first call.

:func:`tls_failure` asks the standard library whether an ``https`` endpoint fails its TLS
handshake, because gRPC reports that, a refused connection and an unknown host all as
UNAVAILABLE, told apart only by free text (which holds the host name: a DNS failure for
``etcd-tls-0`` reads like TLS). It repeats the connection with :mod:`socket`/:mod:`ssl` and the
client's CA, certificate and key: an ``OSError`` from ``getaddrinfo``/``connect`` is not TLS; an
:class:`ssl.SSLError` in the handshake, or in answer to the HTTP/2 preface (TLS 1.3 rejects a
missing client certificate only after the handshake), is. Cost: one DNS lookup, TCP connection
and handshake, bounded by ``timeout`` (the lookup in a daemon thread: ``getaddrinfo`` has none).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from ..errors import EtcdTLSError
from ..options import EtcdClientOptions
from .endpoints import Endpoint
from .reactor import started

log = logging.getLogger(__name__)

__all__ = ["Member", "channel_credentials", "check_options", "open_aio_channel", "open_channel", "tls_failure"]

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
        """Close both channels (their calls and streams end); the next stub makes new ones. The
        stream channel closes later on the loop (no wait), so one opened meanwhile closes too."""
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


def check_options(o: EtcdClientOptions) -> None:
    """Check a client's options; raises ``ValueError`` naming the bad option."""
    if o.protocol not in (None, "http", "https"):
        raise ValueError(f"Invalid etcd protocol {o.protocol!r}: use 'http' or 'https'.")
    if (o.cert is None) != (o.key is None):
        raise ValueError("TLS client certificate and key must be given together (cert, key).")
    if (o.user is None) != (o.password is None) and not (o.user and o.password == ""):
        raise ValueError("etcd user and password must be given together.")
    for name, value in (("timeout", o.timeout), ("connect_timeout", o.connect_timeout)):
        if not isinstance(value, float) or not value > 0:  # a number is a float by now (EtcdClientOptions)
            raise ValueError(f"etcd client {name} must be a positive number of seconds, got {value!r}.")


# HTTP/2's client connection preface and an empty SETTINGS frame: a gRPC server answers with its
# own SETTINGS frame, a server that refused our certificate with a TLS alert.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca)
    if cert is not None:
        context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["h2"])
    return context


def _resolve(host: str, port: int, timeout: float) -> list[tuple[socket.AddressFamily, tuple[Any, ...]]]:
    """The addresses of ``host``; ``[]`` when it has none or the lookup outlasts ``timeout``."""
    found: list[tuple[socket.AddressFamily, tuple[Any, ...]]] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            found.extend((family, tuple(sockaddr[:2])) for family, _, _, _, sockaddr in infos)
        except OSError:
            pass
        finally:
            done.set()

    threading.Thread(target=lookup, name="etcd-tls-probe-dns", daemon=True).start()
    return list(found) if done.wait(timeout) else []


def tls_failure(
    host: str, port: int, *, ca: str | None, cert: str | None, key: str | None, timeout: float
) -> str | None:
    """Why a TLS connection to ``host:port`` fails in the handshake, or None (it succeeds, or fails
    before TLS). Never raises; blocks about ``timeout`` seconds at most (twice for two addresses
    that both time out: the first that connects decides)."""
    try:
        context = _context(ca, cert, key)
    except (OSError, ssl.SSLError) as e:  # unreadable or mismatched files: the channel fails the same way
        return f"cannot load the TLS files: {e}"
    for family, address in _resolve(host, port, timeout)[:2]:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(address)
        except OSError:
            sock.close()
            continue
        try:
            with context.wrap_socket(sock, server_hostname=host) as tls:
                tls.sendall(_H2_PREFACE)
                tls.recv(1)
            return None
        except ssl.SSLCertVerificationError as e:
            return f"certificate verification failed: {e.verify_message}"
        except ssl.SSLError as e:
            return f"TLS failed: {e.reason or e}"
        except OSError as e:  # reset or timed out after connecting: not a TLS verdict
            log.debug("TLS probe of %s:%d: %s", host, port, e)
            return None
        finally:
            sock.close()
    return None
