"""Transport of the client layer: channels, auth tokens, failover, the retry policy
and the translation of gRPC errors into :mod:`etcd_store.errors` exceptions.

Wire schema: the generated protobuf/gRPC stubs of the maintained ``python3-etcd3``
distribution (``etcd3.etcdrpc``, regenerated for protobuf >= 5). Callers see plain
Python objects (:mod:`.kv`) and :mod:`etcd_store.errors` exceptions, never a
``grpc.RpcError``.

Cost model: every unary method is one RPC in the uncontended, healthy case.
A failed attempt against a dead endpoint is retried on the next endpoint until
the call's deadline; the deadline bounds the whole call, retries included.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
from etcd3.etcdrpc import rpc_pb2

from ..errors import (
    EtcdAuthError,
    EtcdCompactedError,
    EtcdConnectionError,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdPermissionDenied,
    EtcdRequestError,
    EtcdTimeoutError,
    EtcdTLSError,
)
from .endpoints import Endpoint, parse_endpoints
from .stats import CallStats, counts_error

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_CONNECT_TIMEOUT", "DEFAULT_TIMEOUT", "Transport"]

DEFAULT_TIMEOUT = 30.0
#: How long a client that never reached etcd keeps retrying refused connections.
DEFAULT_CONNECT_TIMEOUT = 5.0

_Self = TypeVar("_Self", bound="Transport")


# --------------------------------------------------------------------------- error translation

# gRPC reports TLS failures as UNAVAILABLE; only its text tells them from a refused connection.
# A server certificate for another host name reads "Hostname Verification Check failed"; a
# server that refused our (missing) client certificate "Unwrap failed (TSI_DATA_CORRUPTED)".
# Not a bare "handshake": a TCP connect that timed out reads "tcp handshaker shutdown".
_TLS_MARKERS = ("ssl", "tls", "certificate", "x509", "verification check", "tsi_")
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
# Deadline of the first attempt of a request that is safe to resend; it doubles per timed-out attempt.
_FIRST_ATTEMPT_TIMEOUT = 2.0
# Server replies that guarantee the request was not applied: safe to retry a write.
_NOT_APPLIED = ("etcdserver: no leader", "etcdserver: not capable", "etcdserver: too many requests")
# etcd's named errors (its rpctypes) for a member that cannot get a request through raft now
# ("etcdserver: request timed out[, possibly due to ...]", "leader changed", "no leader", "not
# capable", "server stopped", "unhealthy cluster") come with UNAVAILABLE, so _RETRYABLE covers
# them. Two bare Go errors pass through unnamed, as UNKNOWN on etcd 3.4/3.5:
#  - the member's own request timeout (about 7 s: 5 s + two election timeouts) expired while
#    its raft had no leader to take the proposal (a leader cut off from its quorum steps down);
#    3.6+ send the same text as DEADLINE_EXCEEDED. The proposal may still be in flight.
#  - raft dropped the proposal (no leader, leadership transfer): it never entered the log.
_SERVER_TIMED_OUT = "context deadline exceeded"
#: gRPC metadata on every stream (watch, keep-alive): etcd ends a stream whose member has had no
#: leader for a few election timeouts, with UNAVAILABLE "etcdserver: no leader" (etcd Go's
#: ``clientv3.WithRequireLeader``). Without it a member cut off from its peers keeps the stream
#: open and silent while the others move on.
REQUIRE_LEADER = ("hasleader", "true")
_PROPOSAL_DROPPED = "raft proposal dropped"


def _details(err: grpc.RpcError) -> str:
    try:
        return str(err.details() or "")
    except Exception:  # pragma: no cover - defensive: some errors carry no details
        return str(err)


def _is_stale_token(err: grpc.RpcError) -> bool:
    """Whether etcd refused the request's auth token: log in again, then retry.

    etcd answers UNAUTHENTICATED ("invalid auth token") for a token it does not know
    (expired after ``--auth-token-ttl``, or issued before etcd restarted: simple tokens
    live in memory), "auth store is old" for a token older than a change of users or
    roles, and "user name is empty" for a request without a token after auth was enabled.
    """
    text = _details(err)
    if err.code() == grpc.StatusCode.UNAUTHENTICATED:
        return True
    return "auth store is old" in text or "user name is empty" in text


def _cancel_code(reason: str) -> grpc.StatusCode | None:
    """The gRPC status code in a watch's ``cancel_reason`` (``"rpc error: code = X desc = ..."``)."""
    match = re.search(r"code = (\w+)", reason)
    if match is None:
        return None
    name = re.sub(r"(?<!^)(?=[A-Z])", "_", match.group(1)).upper()
    return grpc.StatusCode.__members__.get(name)


def _clip(text: str, limit: int = 300) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out (keys in messages)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def show_key(key: bytes, limit: int = 200) -> str:
    """``repr(key)`` for an error message: keys longer than ``limit`` bytes are cut."""
    if len(key) <= limit:
        return repr(key)
    return f"{key[:limit]!r}... ({len(key)} bytes)"


def _is_tls_failure(err: grpc.RpcError) -> bool:
    text = _details(err).lower()
    return any(m in text for m in _TLS_MARKERS)


def _is_refused(err: grpc.RpcError) -> bool:
    """Whether the attempt found no server at all (connection refused, unknown host).

    gRPC fails such an attempt at once with UNAVAILABLE; an answer from etcd
    ("etcdserver: no leader") or a timeout means something is there.
    """
    if err.code() != grpc.StatusCode.UNAVAILABLE or _is_tls_failure(err):
        return False
    return not _details(err).startswith("etcdserver:")


def _member_cannot_serve(err: grpc.RpcError) -> bool:
    """Whether the attempt failed for want of this member or of its quorum: try another member.

    Unreachable or slow members (UNAVAILABLE, DEADLINE_EXCEEDED, etcd's named "etcdserver: ..."
    unavailability errors) and the bare raft errors of a member without a leader (UNKNOWN
    "context deadline exceeded" / "raft proposal dropped" from etcd 3.4/3.5).
    """
    code = err.code()
    if code in _RETRYABLE:
        return True
    return code == grpc.StatusCode.UNKNOWN and _details(err) in (_SERVER_TIMED_OUT, _PROPOSAL_DROPPED)


def _maybe_applied(err: grpc.RpcError) -> bool:
    """Whether a failed write may nevertheless have been applied by etcd."""
    text = _details(err)
    if text == _PROPOSAL_DROPPED:
        return False
    if text == _SERVER_TIMED_OUT:
        return True  # etcd gave up waiting; a proposal it had taken may still commit
    if not text.startswith("etcdserver:"):
        # Transport failure: with wait_for_ready=False gRPC fails before sending.
        return err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    return not text.startswith(_NOT_APPLIED)


# --------------------------------------------------------------------------- channels and calls


class _Member:
    """One endpoint's channel and stubs, created lazily."""

    def __init__(self, endpoint: Endpoint, factory: Callable[[Endpoint], grpc.Channel]) -> None:
        self.endpoint = endpoint
        self._factory = factory
        self._channel: grpc.Channel | None = None
        self.stubs: dict[str, Any] = {}
        self.token: str | None = None

    def stub(self, service: str) -> Any:
        if self._channel is None:
            self._channel = self._factory(self.endpoint)
        stub = self.stubs.get(service)
        if stub is None:
            from etcd3.etcdrpc import rpc_pb2_grpc

            stub = getattr(rpc_pb2_grpc, f"{service}Stub")(self._channel)
            self.stubs[service] = stub
        return stub

    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = self._factory(self.endpoint)
        return self._channel

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self.stubs.clear()


class Transport:
    """Channels to the endpoints, auth tokens, failover, the retry policy, error translation.

    Base of :class:`~etcd_store.client.EtcdClient` (see there for the arguments).
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
        protocol: str | None = None,
        interceptors: Sequence[Any] = (),
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ) -> None:
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
        secure: bool | None = None
        if protocol is not None:
            secure = protocol == "https"
        elif ca_cert or cert:
            secure = True
        self.endpoints = parse_endpoints(endpoints, secure=secure)
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        # Set once any member answered: from then on calls ride out outages until their deadline.
        self._reached = False
        self._tls_files = (ca_cert, cert, key)
        self._credentials: grpc.ChannelCredentials | None = None
        self._user = user
        self._password = password
        self._interceptors = list(interceptors)
        self._members = [_Member(ep, self._make_channel) for ep in self.endpoints]
        self._current = 0
        self._lock = threading.Lock()
        self._closed = False
        #: Retries and errors of this client (:mod:`.stats`), read by the layers above.
        self.stats = CallStats()

    # ---------------------------------------------------------------- plumbing

    def describe(self) -> str:
        """The endpoints as a user would write them, for error messages."""
        return ",".join(str(ep) for ep in self.endpoints)

    def __repr__(self) -> str:
        return f"EtcdClient({self.describe()!r})"

    def _make_channel(self, endpoint: Endpoint) -> grpc.Channel:
        options = [
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
        if endpoint.secure:
            channel = grpc.secure_channel(endpoint.target, self._channel_credentials(), options)
        else:
            channel = grpc.insecure_channel(endpoint.target, options)
        if self._interceptors:
            channel = grpc.intercept_channel(channel, *self._interceptors)
        return channel

    def _channel_credentials(self) -> grpc.ChannelCredentials:
        if self._credentials is None:
            ca, cert, key = self._tls_files

            def read(path: str | None, what: str) -> bytes | None:
                if path is None:
                    return None
                try:
                    with open(path, "rb") as f:
                        return f.read()
                except OSError as e:
                    raise EtcdTLSError(f"Cannot read TLS {what} file {path!r}: {e}") from None

            self._credentials = grpc.ssl_channel_credentials(
                read(ca, "CA"), read(key, "client key"), read(cert, "client certificate")
            )
        return self._credentials

    def _metadata(self, member: _Member, deadline: float) -> tuple[tuple[str, str], ...] | None:
        if self._user is None:
            return None
        if member.token is None:
            self._authenticate(member, deadline)
        return (("token", member.token),) if member.token else None

    def _stream_metadata(self, member: _Member, deadline: float) -> tuple[tuple[str, str], ...]:
        """The metadata of a stream on ``member``: the auth token (logging in first when
        needed, bounded by ``deadline``) and :data:`REQUIRE_LEADER`."""
        return (*(self._metadata(member, deadline) or ()), REQUIRE_LEADER)

    def _authenticate(self, member: _Member, deadline: float) -> None:
        request = rpc_pb2.AuthenticateRequest(name=self._user, password=self._password)
        stub = member.stub("Auth")
        try:
            resp = stub.Authenticate(request, timeout=max(deadline - time.monotonic(), 0.001))
        except grpc.RpcError as e:
            text = _details(e)
            if "authentication failed" in text or "invalid user" in text:
                refused = EtcdAuthError(
                    f"etcd at {member.endpoint} rejected the credentials of user "
                    f"{self._user!r}: wrong user name or password."
                )
                self.stats.failed(refused)
                raise refused from None
            if "authentication is not enabled" in text:
                # Auth is off: run without a token.
                member.token = ""
                return
            raise
        self._reached = True
        member.token = resp.token

    def _order(self) -> list[int]:
        with self._lock:
            start = self._current
        n = len(self._members)
        return [(start + i) % n for i in range(n)]

    def _promote(self, index: int) -> None:
        with self._lock:
            self._current = index

    def _call(
        self,
        service: str,
        method: str,
        request: Any,
        *,
        timeout: float | None = None,
        what: str = "",
        idempotent: bool = True,
    ) -> Any:
        """Run one unary RPC under the client's one retry policy; translate errors.

        ``timeout`` (default: the client's) bounds the whole call, retries included.
        An attempt that fails because a member is unreachable, or because it answers
        that it cannot get the request through raft now (etcd's own request timeout, no
        leader, leader changed, proposal dropped: a leader cut off from its quorum),
        goes to the next member;
        when every member failed, the next round starts after a short pause (25 ms
        growing to 0.5 s). Requests that are safe to resend (``idempotent``: reads,
        plain writes, and writes fenced by a compare) get per-attempt deadlines of
        2 s, doubling after a round in which every member timed out, so a member stuck
        on a dead leader costs 2 s (and an isolated leader after it another 2 s), not
        the whole deadline; with a single endpoint an attempt has the whole deadline
        (there is no other member to try, and resending a slow request adds load).
        Others get the whole remaining deadline in one attempt and are resent only when the failure proves they were not applied (connection
        refused; etcd: no leader, too many requests, proposal dropped). An expired auth token is renewed
        once, at once. A client that never reached etcd gives up after
        ``connect_timeout`` when every attempt was refused (nothing listening); a TLS
        handshake failure on every member fails at once.
        """
        if self._closed:
            raise EtcdError(f"The etcd client for {self.describe()} is closed.")
        budget = self.timeout if timeout is None else timeout
        start = time.monotonic()
        deadline = start + budget
        refused_only = True  # every failure so far: no connection at all (nothing listening)
        pause = 0.025
        attempt_budget = _FIRST_ATTEMPT_TIMEOUT
        last: grpc.RpcError | None = None
        # Members that failed a TLS handshake in this call. A bad certificate does not heal:
        # once every member failed one, the call fails at once (a member that resolves to
        # several addresses may alternate with "connection refused" from the others).
        tls_failed: dict[int, grpc.RpcError] = {}
        reauthenticated = False
        attempts = 0
        while True:
            order = self._order()
            timeouts = 0  # members that timed out in this round
            for index in order:
                member = self._members[index]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                # A member whose leader just died holds a request until etcd's own
                # request timeout (~7 s). Requests that are safe to resend get growing
                # per-attempt deadlines (2 s, 4 s, ...) so the next member is tried in
                # time; others get the whole remaining deadline in one attempt.
                # With one member there is no next one: a short deadline would only resend
                # a request that is merely slow (an overloaded etcd) and add to its load.
                attempt = min(remaining, attempt_budget) if idempotent and len(order) > 1 else remaining
                attempts += 1
                if attempts > 1:
                    self.stats.retried(method)
                try:
                    metadata = self._metadata(member, deadline)
                    stub = member.stub(service)
                    resp = getattr(stub, method)(request, timeout=attempt, metadata=metadata)
                except grpc.RpcError as e:
                    last = e
                    code = e.code()
                    text = _details(e)
                    if _is_stale_token(e) and self._user is not None and not reauthenticated:
                        member.token = None
                        reauthenticated = True
                        last = None
                        break
                    if not _member_cannot_serve(e):
                        raise self._translate(e, what) from None
                    if _is_tls_failure(e):
                        tls_failed[index] = e
                        if len(tls_failed) == len(order):
                            raise self._translate(e, what) from None
                    if not idempotent and _maybe_applied(e):
                        raise self._translate(e, what) from None
                    if code == grpc.StatusCode.DEADLINE_EXCEEDED or text == _SERVER_TIMED_OUT:
                        timeouts += 1
                        if timeouts == len(order):
                            attempt_budget *= 2
                    if not _is_refused(e):
                        refused_only = False
                    log.debug("etcd %s at %s failed (%s): %s", method, member.endpoint, code, text)
                    continue
                self._reached = True
                if index != order[0]:
                    self._promote(index)
                return resp
            if last is None:
                continue  # re-authenticated: retry at once
            now = time.monotonic()
            remaining = deadline - now
            if refused_only and not self._reached and now - start >= self.connect_timeout:
                raise self._never_connected(last, what)
            if remaining <= 0:
                assert last is not None
                raise self._translate(last, what, timed_out=budget)
            # Every endpoint failed: give reconnects (or a leader election) a moment,
            # bounded by the deadline; the pause grows so a long outage costs few RPCs.
            threading.Event().wait(min(pause, remaining))
            pause = min(pause * 2, 0.5)

    @counts_error
    def _translate(self, err: grpc.RpcError, what: str, timed_out: float | None = None) -> EtcdError:
        code = err.code()
        text = _details(err)
        shown = _clip(text)  # etcd may echo a request's key or value
        where = f"etcd at {self.describe()}"
        op = f" ({what})" if what else ""
        if _is_tls_failure(err):
            return EtcdTLSError(
                f"TLS handshake with {where} failed{op}: {shown.rstrip('.')}. Check the CA certificate "
                "(ca_cert), the client certificate/key, that the server certificate names the "
                "endpoint's host, and http:// versus https://."
            )
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return EtcdPermissionDenied(f"{where} denied permission{op}: {shown}")
        if code == grpc.StatusCode.UNAUTHENTICATED or "user name is empty" in text:
            return EtcdAuthError(f"{where} requires authentication{op}: {shown}")
        if "authentication failed" in text:
            return EtcdAuthError(f"{where} rejected the user name or password{op}: {shown}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED or "too large" in text:
            return EtcdRequestError(
                f"{where} refused the request as too large{op} (etcd's --max-request-bytes): {shown}"
            )
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            return EtcdRequestError(f"{where} rejected the request{op}: {shown}")
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in text:
            return EtcdLeaseNotFound(f"{where}: {shown}{op}")
        if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in text:
            return EtcdCompactedError(f"{where}: {shown}{op}")
        if timed_out is not None or code == grpc.StatusCode.DEADLINE_EXCEEDED or text == _SERVER_TIMED_OUT:
            budget = f" within {timed_out:g} s" if timed_out is not None else ""
            return EtcdTimeoutError(f"No answer from {where}{budget}{op}; last error: {shown}")
        if code == grpc.StatusCode.UNAVAILABLE:
            return EtcdConnectionError(f"Cannot reach {where}{op}: {shown}")
        return EtcdError(f"{where} failed{op}: {code.name}: {shown}")

    @counts_error
    def _never_connected(self, err: grpc.RpcError, what: str) -> EtcdConnectionError:
        op = f" ({what})" if what else ""
        return EtcdConnectionError(
            f"Cannot connect to etcd at {self.describe()}{op}: no endpoint accepted a connection "
            f"within connect_timeout={self.connect_timeout:g} s. Is etcd running there, on these "
            f"ports? Last error: {_clip(_details(err))}"
        )

    @counts_error
    def _translate_cancel(self, reason: str, what: str) -> EtcdError:
        """The error for a watch etcd cancelled, from the code in its ``cancel_reason``."""
        text = f"etcd at {self.describe()} cancelled the {what}: {_clip(reason)}"
        code = _cancel_code(reason)
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return EtcdPermissionDenied(text)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return EtcdAuthError(text)
        if "compacted" in reason:
            return EtcdCompactedError(text)
        return EtcdError(text)

    def _cancel_wants_login(self, reason: str) -> bool:
        """Whether a watch etcd cancelled for ``reason`` may pass after logging in again.

        etcd keeps simple tokens in memory: after it restarts, a watch resumed with the
        old token is cancelled, UNAUTHENTICATED on 3.4 and 3.6 ("invalid auth token"),
        PERMISSION_DENIED on 3.5. The watch logs in again once and resumes; refused
        again with a fresh token, it is denied for good.
        """
        if self._user is None:
            return False
        return _cancel_code(reason) in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)

    def _stream_error(self, member: _Member, err: grpc.RpcError, what: str) -> EtcdError | None:
        """What a broken stream (watch, keep-alive) should do: None to reconnect, or its fatal error.

        A refused token is dropped, so the next stream logs in again.
        """
        if _is_stale_token(err) and self._user is not None:
            member.token = None
            return None
        if _member_cannot_serve(err) or err.code() == grpc.StatusCode.CANCELLED:
            return None
        return self._translate(err, what)

    def close(self) -> None:
        """Close every channel. Open watches and lease keepers end."""
        self._closed = True
        for member in self._members:
            member.close()

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- for streams

    def _stream_member(self) -> tuple[int, _Member]:
        index = self._order()[0]
        return index, self._members[index]

    def _rotate_from(self, index: int) -> None:
        with self._lock:
            if self._current == index:
                self._current = (index + 1) % len(self._members)

    def _wait_ready(self, member: _Member, timeout: float) -> bool:
        """Block until the member's channel connects or ``timeout`` passes."""
        try:
            grpc.channel_ready_future(member.channel()).result(timeout=timeout)
            return True
        except grpc.FutureTimeoutError:
            return False
        except Exception:  # channel closed under us
            return False

