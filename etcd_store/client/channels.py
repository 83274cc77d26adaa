"""gRPC channels of the client: one lazily made channel (and its stubs) per endpoint.

:class:`Member` is one endpoint's channel, stubs and auth token; :func:`open_channel` makes a
channel with the client's options (message sizes, reconnect backoff, HTTP/2 keepalive, gRPC's
own retries off: the client has its own policy, :mod:`.retry`). Nothing here makes an RPC;
making a channel does not connect (gRPC connects on the first call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc

from ..errors import EtcdTLSError
from .endpoints import Endpoint

__all__ = ["Member", "channel_credentials", "check_options", "open_channel"]

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
    """One endpoint's channel and stubs, created lazily, and its auth token (None: log in first)."""

    def __init__(self, endpoint: Endpoint, factory: Callable[[Endpoint], grpc.Channel]) -> None:
        self.endpoint = endpoint
        self._factory = factory
        self._channel: grpc.Channel | None = None
        self.stubs: dict[str, Any] = {}
        self.token: str | None = None

    def stub(self, service: str) -> Any:
        """The stub of etcd's gRPC ``service`` (``"KV"``, ``"Watch"``, ...) on this member."""
        stub = self.stubs.get(service)
        if stub is None:
            from etcd3.etcdrpc import rpc_pb2_grpc

            stub = getattr(rpc_pb2_grpc, f"{service}Stub")(self.channel())
            self.stubs[service] = stub
        return stub

    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = self._factory(self.endpoint)
        return self._channel

    def wait_ready(self, timeout: float) -> bool:
        """Block until the channel connects (True) or ``timeout`` passes or it is closed (False)."""
        ready: grpc.Future | None = None
        try:
            ready = grpc.channel_ready_future(self.channel())
            ready.result(timeout=timeout)
            return True
        except grpc.FutureTimeoutError:
            return False
        except Exception:  # closed under us
            return False
        finally:
            if ready is not None:
                # Unsubscribes: else gRPC's connectivity poller thread runs on, and fails once the channel closes.
                ready.cancel()

    def close(self) -> None:
        """Close the channel (its calls and streams end); the next stub makes a new one."""
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self.stubs.clear()


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
