"""The etcd v3 client layer: the only module of the project that touches gRPC.

Wire schema: the generated protobuf/gRPC stubs of the maintained ``python3-etcd3``
distribution (``etcd3.etcdrpc``, regenerated for protobuf >= 5). Everything else
(endpoint failover, TLS, auth tokens, deadlines, watches, lease keep-alive and
error translation) is written here, so the store and the rendezvous code see
plain Python objects and :mod:`etcd_store.errors` exceptions, never a
``grpc.RpcError``.

Cost model: every unary method is one RPC in the uncontended, healthy case.
A failed attempt against a dead endpoint is retried on the next endpoint until
the call's deadline; the deadline bounds the whole call, retries included.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from etcd3.etcdrpc import rpc_pb2

from ..errors import (
    EtcdAuthError,
    EtcdCompactedError,
    EtcdConnectionError,
    EtcdError,
    EtcdPermissionDenied,
    EtcdRequestError,
    EtcdTimeoutError,
    EtcdTLSError,
)

log = logging.getLogger(__name__)

__all__ = [
    "DeleteResult",
    "EtcdClient",
    "Endpoint",
    "Event",
    "KeyValue",
    "LeaseKeeper",
    "PutResult",
    "RangeResult",
    "RpcCounter",
    "TxnResult",
    "Watch",
    "compare_create",
    "compare_lease",
    "compare_mod",
    "compare_value",
    "compare_version",
    "op_delete",
    "op_get",
    "op_put",
    "parse_endpoints",
    "prefix_range_end",
]

DEFAULT_PORT = 2379
DEFAULT_TIMEOUT = 30.0

_T = TypeVar("_T")


# --------------------------------------------------------------------------- endpoints


@dataclass(frozen=True)
class Endpoint:
    """One etcd member address."""

    host: str
    port: int
    secure: bool = False

    @property
    def target(self) -> str:
        """The gRPC target, ``host:port`` (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"{'https' if self.secure else 'http'}://{self.target}"


def parse_endpoints(
    spec: str | Sequence[str], *, secure: bool | None = None, default_port: int = DEFAULT_PORT
) -> list[Endpoint]:
    """Parse ``"h1:2379,h2:2379"``, ``http://`` / ``https://`` URLs, or a list of those.

    ``secure`` forces the scheme of endpoints written without one (``None``: plain
    text unless a URL says ``https``). Raises ``ValueError`` naming the bad part.
    """
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    endpoints: list[Endpoint] = []
    for raw in parts:
        text = raw.strip()
        if not text:
            continue
        is_secure = bool(secure)
        if "://" in text:
            scheme, _, text = text.partition("://")
            if scheme not in ("http", "https"):
                raise ValueError(
                    f"Invalid etcd endpoint {raw.strip()!r}: scheme must be http or https."
                )
            is_secure = scheme == "https"
        text = text.rstrip("/")
        host, port_text = text, ""
        if text.startswith("["):
            host, _, rest = text[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
        elif text.count(":") == 1:
            host, _, port_text = text.partition(":")
        if not host or "/" in host:
            raise ValueError(f"Invalid etcd endpoint {raw.strip()!r}: no host.")
        try:
            port = int(port_text) if port_text else default_port
        except ValueError:
            raise ValueError(
                f"Invalid etcd endpoint {raw.strip()!r}: port {port_text!r} is not a number."
            ) from None
        if not 0 < port < 65536:
            raise ValueError(f"Invalid etcd endpoint {raw.strip()!r}: port out of range.")
        endpoints.append(Endpoint(host, port, is_secure))
    if not endpoints:
        raise ValueError(f"No etcd endpoint given in {spec!r}.")
    return endpoints


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def _from_pb(cls, kv: Any) -> KeyValue:
        return cls(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease)


@dataclass(frozen=True)
class RangeResult:
    kvs: list[KeyValue]
    count: int
    more: bool
    revision: int


@dataclass(frozen=True)
class PutResult:
    revision: int
    prev_kv: KeyValue | None = None


@dataclass(frozen=True)
class DeleteResult:
    deleted: int
    revision: int
    prev_kvs: list[KeyValue] = field(default_factory=list)


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    responses: list[RangeResult | PutResult | DeleteResult]


@dataclass(frozen=True)
class Event:
    """A watch event: ``type`` is ``"PUT"`` or ``"DELETE"``."""

    type: str
    kv: KeyValue
    prev_kv: KeyValue | None = None

    @property
    def key(self) -> bytes:
        return self.kv.key

    @property
    def value(self) -> bytes:
        return self.kv.value


@dataclass(frozen=True)
class MemberStatus:
    member_id: int
    leader: int
    revision: int
    db_size: int
    version: str
    raft_term: int


def _range_result(resp: Any) -> RangeResult:
    return RangeResult(
        [KeyValue._from_pb(kv) for kv in resp.kvs], resp.count, resp.more, resp.header.revision
    )


def _put_result(resp: Any) -> PutResult:
    prev = KeyValue._from_pb(resp.prev_kv) if resp.HasField("prev_kv") else None
    return PutResult(resp.header.revision, prev)


def _delete_result(resp: Any) -> DeleteResult:
    return DeleteResult(
        resp.deleted, resp.header.revision, [KeyValue._from_pb(kv) for kv in resp.prev_kvs]
    )


# --------------------------------------------------------------------------- txn building

_CMP_RESULT = {
    "==": rpc_pb2.Compare.EQUAL,
    "!=": rpc_pb2.Compare.NOT_EQUAL,
    "<": rpc_pb2.Compare.LESS,
    ">": rpc_pb2.Compare.GREATER,
}


def prefix_range_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix``."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def _compare(
    key: bytes, op: str, target: int, range_end: bytes | None = None, **value: Any
) -> Any:
    if op not in _CMP_RESULT:
        raise ValueError(f"Unknown compare operator {op!r}; use one of {sorted(_CMP_RESULT)}.")
    return rpc_pb2.Compare(
        key=key, range_end=range_end or b"", result=_CMP_RESULT[op], target=target, **value
    )


def compare_version(key: bytes, op: str, version: int, *, range_end: bytes | None = None) -> Any:
    """Compare the key's version (0 = the key does not exist).

    With ``range_end`` (e.g. :func:`prefix_range_end`) the compare holds only if it
    holds for every key in ``[key, range_end)``; an empty range compares as one
    missing key, so ``version == 0`` over a range means "no key in the range".
    """
    return _compare(key, op, rpc_pb2.Compare.VERSION, range_end, version=version)


def compare_create(key: bytes, op: str, revision: int, *, range_end: bytes | None = None) -> Any:
    """Compare the key's create revision (0 = the key does not exist); ``range_end`` as above."""
    return _compare(key, op, rpc_pb2.Compare.CREATE, range_end, create_revision=revision)


def compare_mod(key: bytes, op: str, revision: int, *, range_end: bytes | None = None) -> Any:
    """Compare the key's mod revision (0 = the key does not exist); ``range_end`` as above."""
    return _compare(key, op, rpc_pb2.Compare.MOD, range_end, mod_revision=revision)


def compare_value(key: bytes, op: str, value: bytes) -> Any:
    """Compare the key's value (a missing key never matches)."""
    return _compare(key, op, rpc_pb2.Compare.VALUE, value=value)


def compare_lease(key: bytes, op: str, lease: int) -> Any:
    """Compare the lease the key is attached to."""
    return _compare(key, op, rpc_pb2.Compare.LEASE, lease=lease)


def op_put(key: bytes, value: bytes, *, lease: int = 0, prev_kv: bool = False) -> Any:
    return rpc_pb2.RequestOp(
        request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease, prev_kv=prev_kv)
    )


def op_get(
    key: bytes,
    range_end: bytes | None = None,
    *,
    prefix: bool = False,
    keys_only: bool = False,
    count_only: bool = False,
    limit: int = 0,
) -> Any:
    return rpc_pb2.RequestOp(
        request_range=_range_request(key, range_end, prefix, keys_only, count_only, limit)
    )


def op_delete(
    key: bytes, range_end: bytes | None = None, *, prefix: bool = False, prev_kv: bool = False
) -> Any:
    end = prefix_range_end(key) if prefix else range_end
    return rpc_pb2.RequestOp(
        request_delete_range=rpc_pb2.DeleteRangeRequest(key=key, range_end=end or b"", prev_kv=prev_kv)
    )


def _range_request(
    key: bytes,
    range_end: bytes | None,
    prefix: bool,
    keys_only: bool,
    count_only: bool,
    limit: int,
    revision: int = 0,
    serializable: bool = False,
    sort_by: str | None = None,
    descending: bool = False,
) -> Any:
    end = prefix_range_end(key) if prefix else range_end
    sort: dict[str, int] = {}
    if sort_by is not None:
        if sort_by not in _SORT_TARGETS:
            raise ValueError(f"sort_by must be one of {sorted(_SORT_TARGETS)}, got {sort_by!r}")
        sort = {"sort_target": _SORT_TARGETS[sort_by], "sort_order": 2 if descending else 1}
    return rpc_pb2.RangeRequest(
        key=key,
        range_end=end or b"",
        keys_only=keys_only,
        count_only=count_only,
        limit=limit,
        revision=revision,
        serializable=serializable,
        **sort,
    )


# RangeRequest.SortTarget; sort_order 1 = ASCEND, 2 = DESCEND.
_SORT_TARGETS = {"key": 0, "version": 1, "create": 2, "mod": 3, "value": 4}


# --------------------------------------------------------------------------- RPC counting


class _CallDetails(grpc.ClientCallDetails):  # type: ignore[misc]
    pass


class RpcCounter(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """A client interceptor that counts RPCs by method (``"KV/Range"``, ``"Watch/Watch"``).

    Streams count once when opened. Pass it as ``EtcdClient(..., interceptors=[counter])``.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _count(self, details: Any) -> None:
        name = details.method.decode() if isinstance(details.method, bytes) else details.method
        name = name.split("etcdserverpb.", 1)[-1]
        with self._lock:
            self.counts[name] += 1

    def total(self, *, exclude: Sequence[str] = ("Auth/Authenticate",)) -> int:
        with self._lock:
            return sum(n for k, n in self.counts.items() if k not in exclude)

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self._count(details)
        return continuation(details, request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        self._count(details)
        return continuation(details, request)

    def intercept_stream_unary(self, continuation: Any, details: Any, it: Any) -> Any:
        self._count(details)
        return continuation(details, it)

    def intercept_stream_stream(self, continuation: Any, details: Any, it: Any) -> Any:
        self._count(details)
        return continuation(details, it)


# --------------------------------------------------------------------------- error translation

_TLS_MARKERS = ("ssl", "tls", "handshake", "certificate", "x509")
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
# Deadline of the first attempt of a request that is safe to resend; it doubles per timed-out attempt.
_FIRST_ATTEMPT_TIMEOUT = 2.0
# Server replies that guarantee the request was not applied: safe to retry a write.
_NOT_APPLIED = ("etcdserver: no leader", "etcdserver: not capable", "etcdserver: too many requests")


def _details(err: grpc.RpcError) -> str:
    try:
        return str(err.details() or "")
    except Exception:  # pragma: no cover - defensive: some errors carry no details
        return str(err)


def _is_tls_failure(err: grpc.RpcError) -> bool:
    text = _details(err).lower()
    return any(m in text for m in _TLS_MARKERS)


def _maybe_applied(err: grpc.RpcError) -> bool:
    """Whether a failed write may nevertheless have been applied by etcd."""
    text = _details(err)
    if not text.startswith("etcdserver:"):
        # Transport failure: with wait_for_ready=False gRPC fails before sending.
        return err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    return not text.startswith(_NOT_APPLIED)


# --------------------------------------------------------------------------- the client


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


class EtcdClient:
    """A thread-safe etcd v3 client over one or more endpoints.

    Args:
        endpoints: ``"h1:2379,h2:2379"``, ``http(s)://`` URLs, or a list of those.
        timeout: the default deadline in seconds of every call (retries included).
        ca_cert, cert, key: TLS files (CA bundle; client certificate and key). Giving
            any of them turns TLS on for endpoints written without a scheme.
        user, password: etcd user credentials. The token is fetched on first use and
            fetched again when etcd says it is no longer valid.
        interceptors: gRPC client interceptors (for instance an :class:`RpcCounter`).

    Calls fail over to the next endpoint when one is unreachable. Every failure
    surfaces as an :class:`~etcd_store.errors.EtcdError` that names the endpoints.
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
    ) -> None:
        if protocol not in (None, "http", "https"):
            raise ValueError(f"Invalid etcd protocol {protocol!r}: use 'http' or 'https'.")
        if (cert is None) != (key is None):
            raise ValueError("TLS client certificate and key must be given together (cert, key).")
        if (user is None) != (password is None) and not (user and password == ""):
            raise ValueError("etcd user and password must be given together.")
        if timeout <= 0:
            raise ValueError(f"etcd client timeout must be positive, got {timeout}.")
        secure: bool | None = None
        if protocol is not None:
            secure = protocol == "https"
        elif ca_cert or cert:
            secure = True
        self.endpoints = parse_endpoints(endpoints, secure=secure)
        self.timeout = float(timeout)
        self._tls_files = (ca_cert, cert, key)
        self._credentials: grpc.ChannelCredentials | None = None
        self._user = user
        self._password = password
        self._interceptors = list(interceptors)
        self._members = [_Member(ep, self._make_channel) for ep in self.endpoints]
        self._current = 0
        self._lock = threading.Lock()
        self._closed = False

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

    def _authenticate(self, member: _Member, deadline: float) -> None:
        request = rpc_pb2.AuthenticateRequest(name=self._user, password=self._password)
        stub = member.stub("Auth")
        try:
            resp = stub.Authenticate(request, timeout=max(deadline - time.monotonic(), 0.001))
        except grpc.RpcError as e:
            text = _details(e)
            if "authentication failed" in text or "invalid user" in text:
                raise EtcdAuthError(
                    f"etcd at {member.endpoint} rejected the credentials of user "
                    f"{self._user!r}: wrong user name or password."
                ) from None
            if "authentication is not enabled" in text:
                # Auth is off: run without a token.
                member.token = ""
                return
            raise
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
        """Run one unary RPC with failover, auth and a deadline; translate errors."""
        if self._closed:
            raise EtcdError(f"The etcd client for {self.describe()} is closed.")
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        pause = 0.025
        attempt_budget = _FIRST_ATTEMPT_TIMEOUT
        last: grpc.RpcError | None = None
        tls_failures = 0
        reauthenticated = False
        while True:
            order = self._order()
            tls_failures = 0
            for index in order:
                member = self._members[index]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                # A member whose leader just died holds a request until etcd's own
                # request timeout (~7 s). Requests that are safe to resend get growing
                # per-attempt deadlines (2 s, 4 s, ...) so the next member is tried in
                # time; others get the whole remaining deadline in one attempt.
                attempt = min(remaining, attempt_budget) if idempotent else remaining
                try:
                    metadata = self._metadata(member, deadline)
                    stub = member.stub(service)
                    resp = getattr(stub, method)(request, timeout=attempt, metadata=metadata)
                except grpc.RpcError as e:
                    last = e
                    code = e.code()
                    text = _details(e)
                    if ("invalid auth token" in text or "user name is empty" in text) and (
                        self._user is not None and not reauthenticated
                    ):
                        member.token = None
                        reauthenticated = True
                        last = None
                        break
                    if code not in _RETRYABLE:
                        raise self._translate(e, what) from None
                    if _is_tls_failure(e):
                        tls_failures += 1
                    if not idempotent and _maybe_applied(e):
                        raise self._translate(e, what) from None
                    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                        attempt_budget *= 2
                    log.debug("etcd %s at %s failed (%s): %s", method, member.endpoint, code, text)
                    continue
                if index != order[0]:
                    self._promote(index)
                return resp
            else:
                if tls_failures == len(order) and last is not None:
                    raise self._translate(last, what) from None
            if last is None:
                continue  # re-authenticated: retry at once
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                assert last is not None
                raise self._translate(last, what, timed_out=budget)
            # Every endpoint failed: give reconnects (or a leader election) a moment,
            # bounded by the deadline; the pause grows so a long outage costs few RPCs.
            threading.Event().wait(min(pause, remaining))
            pause = min(pause * 2, 0.5)

    def _translate(self, err: grpc.RpcError, what: str, timed_out: float | None = None) -> EtcdError:
        code = err.code()
        text = _details(err)
        where = f"etcd at {self.describe()}"
        op = f" ({what})" if what else ""
        if _is_tls_failure(err):
            return EtcdTLSError(
                f"TLS handshake with {where} failed{op}: {text}. Check the CA certificate "
                "(ca_cert), the client certificate/key, and http:// versus https://."
            )
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return EtcdPermissionDenied(f"{where} denied permission{op}: {text}")
        if code == grpc.StatusCode.UNAUTHENTICATED or "user name is empty" in text:
            return EtcdAuthError(f"{where} requires authentication{op}: {text}")
        if "authentication failed" in text:
            return EtcdAuthError(f"{where} rejected the user name or password{op}: {text}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED or "too large" in text:
            return EtcdRequestError(
                f"{where} refused the request as too large{op} (etcd's --max-request-bytes): {text}"
            )
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            return EtcdRequestError(f"{where} rejected the request{op}: {text}")
        if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in text:
            return EtcdCompactedError(f"{where}: {text}{op}")
        if timed_out is not None or code == grpc.StatusCode.DEADLINE_EXCEEDED:
            budget = f" within {timed_out:g} s" if timed_out is not None else ""
            return EtcdTimeoutError(f"No answer from {where}{budget}{op}; last error: {text}")
        if code == grpc.StatusCode.UNAVAILABLE:
            return EtcdConnectionError(f"Cannot reach {where}{op}: {text}")
        return EtcdError(f"{where} failed{op}: {code.name}: {text}")

    def close(self) -> None:
        """Close every channel. Open watches and lease keepers end."""
        self._closed = True
        for member in self._members:
            member.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- KV

    def range(
        self,
        key: bytes,
        range_end: bytes | None = None,
        *,
        prefix: bool = False,
        keys_only: bool = False,
        count_only: bool = False,
        limit: int = 0,
        revision: int = 0,
        serializable: bool = False,
        sort_by: str | None = None,
        descending: bool = False,
        timeout: float | None = None,
    ) -> RangeResult:
        """Read a key, a range, or a prefix. One Range RPC.

        ``sort_by`` (``"key"``, ``"version"``, ``"create"``, ``"mod"``, ``"value"``)
        orders the keys etcd returns (ascending unless ``descending``); with
        ``limit`` that picks, say, the earliest-created key of a prefix.
        """
        req = _range_request(
            key, range_end, prefix, keys_only, count_only, limit, revision, serializable,
            sort_by, descending,
        )
        resp = self._call("KV", "Range", req, timeout=timeout, what=f"read {key!r}")
        return _range_result(resp)

    def get(self, key: bytes, *, timeout: float | None = None) -> KeyValue | None:
        """The key's value and revisions, or None. One Range RPC."""
        result = self.range(key, timeout=timeout)
        return result.kvs[0] if result.kvs else None

    def put(
        self,
        key: bytes,
        value: bytes,
        *,
        lease: int = 0,
        prev_kv: bool = False,
        timeout: float | None = None,
    ) -> PutResult:
        """Write a key. One Put RPC (retried on another endpoint only when safe)."""
        req = rpc_pb2.PutRequest(key=key, value=value, lease=lease, prev_kv=prev_kv)
        resp = self._call("KV", "Put", req, timeout=timeout, what=f"write {key!r}")
        return _put_result(resp)

    def delete(
        self,
        key: bytes,
        range_end: bytes | None = None,
        *,
        prefix: bool = False,
        prev_kv: bool = False,
        timeout: float | None = None,
    ) -> DeleteResult:
        """Delete a key, a range or a prefix. One DeleteRange RPC."""
        end = prefix_range_end(key) if prefix else range_end
        req = rpc_pb2.DeleteRangeRequest(key=key, range_end=end or b"", prev_kv=prev_kv)
        resp = self._call("KV", "DeleteRange", req, timeout=timeout, what=f"delete {key!r}")
        return _delete_result(resp)

    def txn(
        self,
        compare: Sequence[Any],
        success: Sequence[Any] = (),
        failure: Sequence[Any] = (),
        *,
        timeout: float | None = None,
        idempotent: bool = False,
    ) -> TxnResult:
        """Run ``if all(compare) then success else failure`` atomically. One Txn RPC.

        With ``idempotent=False`` (the default) a txn whose outcome is unknown (the
        connection broke after sending) is not replayed; the caller gets
        :class:`EtcdConnectionError` and decides.
        """
        req = rpc_pb2.TxnRequest(compare=list(compare), success=list(success), failure=list(failure))
        what = "transaction on " + ", ".join(repr(c.key) for c in compare[:3]) if compare else "txn"
        resp = self._call("KV", "Txn", req, timeout=timeout, what=what, idempotent=idempotent)
        results: list[RangeResult | PutResult | DeleteResult] = []
        for r in resp.responses:
            kind = r.WhichOneof("response")
            if kind == "response_range":
                results.append(_range_result(r.response_range))
            elif kind == "response_put":
                results.append(_put_result(r.response_put))
            elif kind == "response_delete_range":
                results.append(_delete_result(r.response_delete_range))
        return TxnResult(resp.succeeded, resp.header.revision, results)

    # ---------------------------------------------------------------- leases

    def lease_grant(self, ttl: int, *, lease_id: int = 0, timeout: float | None = None) -> int:
        """Grant a lease of ``ttl`` seconds and return its id. One LeaseGrant RPC."""
        req = rpc_pb2.LeaseGrantRequest(TTL=int(ttl), ID=lease_id)
        resp = self._call("Lease", "LeaseGrant", req, timeout=timeout, what=f"grant lease ttl={ttl}")
        if resp.error:
            raise EtcdRequestError(f"etcd at {self.describe()} refused a lease: {resp.error}")
        return int(resp.ID)

    def lease_revoke(self, lease_id: int, *, timeout: float | None = None) -> bool:
        """Revoke a lease (its keys are deleted). False if it had expired already."""
        req = rpc_pb2.LeaseRevokeRequest(ID=lease_id)
        try:
            self._call("Lease", "LeaseRevoke", req, timeout=timeout, what=f"revoke lease {lease_id:x}")
        except EtcdError as e:
            if "lease not found" in str(e):
                return False
            raise
        return True

    def lease_time_to_live(self, lease_id: int, *, keys: bool = False, timeout: float | None = None) -> int:
        """Seconds left on the lease, or -1 when it expired or never existed."""
        req = rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id, keys=keys)
        resp = self._call("Lease", "LeaseTimeToLive", req, timeout=timeout, what=f"lease {lease_id:x}")
        return int(resp.TTL)

    def keep_alive_once(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Refresh a lease once; returns its new TTL (0 when it had expired)."""
        budget = self.timeout if timeout is None else timeout
        member = self._members[self._order()[0]]
        deadline = time.monotonic() + budget
        try:
            responses = member.stub("Lease").LeaseKeepAlive(
                iter([rpc_pb2.LeaseKeepAliveRequest(ID=lease_id)]),
                timeout=budget,
                metadata=self._metadata(member, deadline),
            )
            for resp in responses:
                return int(resp.TTL)
        except grpc.RpcError as e:
            raise self._translate(e, f"keep lease {lease_id:x} alive") from None
        return 0

    def keeper(
        self, ttl: int, *, on_expired: Callable[[], None] | None = None, lease_id: int = 0
    ) -> LeaseKeeper:
        """Grant a lease and keep it alive over one stream until closed."""
        return LeaseKeeper(self, ttl, on_expired=on_expired, lease_id=lease_id)

    # ---------------------------------------------------------------- watches & status

    def watch(
        self,
        key: bytes,
        range_end: bytes | None = None,
        *,
        prefix: bool = False,
        start_revision: int = 0,
        prev_kv: bool = False,
    ) -> Watch:
        """Start watching a key or range from ``start_revision`` (0: from now)."""
        end = prefix_range_end(key) if prefix else range_end
        return Watch(self, key, end or b"", start_revision, prev_kv)

    def status(self, index: int | None = None, *, timeout: float | None = None) -> MemberStatus:
        """Maintenance.Status of one member (``index``) or of whichever answers first."""
        req = rpc_pb2.StatusRequest()
        if index is None:
            resp = self._call("Maintenance", "Status", req, timeout=timeout, what="status")
        else:
            member = self._members[index]
            budget = self.timeout if timeout is None else timeout
            try:
                resp = member.stub("Maintenance").Status(req, timeout=budget)
            except grpc.RpcError as e:
                raise self._translate(e, f"status of {member.endpoint}") from None
        return MemberStatus(
            resp.header.member_id, resp.leader, resp.header.revision, resp.dbSize,
            resp.version, resp.raftTerm,
        )

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


# --------------------------------------------------------------------------- watches

_CLOSED = object()


class Watch:
    """A watch on a key or key range, with events delivered to a queue.

    A reader thread owns the gRPC stream. When the stream breaks (member down,
    etcd restarted), the thread reopens it on the next reachable endpoint from
    the revision after the last event it delivered, so no event is lost or
    repeated. Errors that retrying cannot fix (compaction, permission denied)
    are raised from :meth:`get`.

    ``created_revision`` is the store revision when the watch was registered.
    """

    def __init__(
        self, client: EtcdClient, key: bytes, range_end: bytes, start_revision: int, prev_kv: bool
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
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch-{key!r}", daemon=True)
        self._thread.start()

    # -------------------------------------------------------- consumer side

    def get(self, timeout: float | None = None) -> list[Event]:
        """The next batch of events; ``[]`` when ``timeout`` passed with none.

        Raises the watch's fatal error (:class:`EtcdCompactedError`, ...), or
        :class:`EtcdError` if the watch was cancelled.
        """
        try:
            item = self._queue.get(timeout=timeout) if timeout is None or timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return []
        if item is _CLOSED:
            self._queue.put(_CLOSED)
            raise EtcdError(f"watch on {self.key!r} was cancelled")
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

    def cancel(self) -> None:
        """Stop the watch and its thread. Idempotent, never blocks long."""
        self._cancelled.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._queue.put(_CLOSED)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    # -------------------------------------------------------- reader thread

    def _requests(self) -> Iterator[Any]:
        create = rpc_pb2.WatchCreateRequest(
            key=self.key,
            range_end=self.range_end,
            start_revision=self._next_revision,
            prev_kv=self._prev_kv,
        )
        yield rpc_pb2.WatchRequest(create_request=create)
        self._cancelled.wait()

    def _run(self) -> None:
        client = self._client
        while not self._cancelled.is_set():
            index, member = client._stream_member()
            try:
                deadline = time.monotonic() + client.timeout
                metadata = client._metadata(member, deadline)
                self._call = member.stub("Watch").Watch(self._requests(), metadata=metadata)
                if self._cancelled.is_set():
                    self._call.cancel()
                for resp in self._call:
                    if resp.created:
                        self.created_revision = resp.header.revision
                        if self._next_revision == 0:
                            self._next_revision = resp.header.revision + 1
                        self._created.set()
                    if resp.compact_revision:
                        self._fail(
                            EtcdCompactedError(
                                f"watch on {self.key!r} at {client.describe()}: revision "
                                f"{self._next_revision} was compacted (oldest kept "
                                f"{resp.compact_revision})"
                            )
                        )
                        return
                    if resp.canceled:
                        reason = resp.cancel_reason or "cancelled by etcd"
                        self._fail(self._fatal_cancel(reason))
                        return
                    if resp.events:
                        batch = [self._event(ev) for ev in resp.events]
                        self._next_revision = batch[-1].kv.mod_revision + 1
                        self._queue.put(batch)
                if self._cancelled.is_set():
                    return
            except grpc.RpcError as e:
                if self._cancelled.is_set():
                    return
                if e.code() not in _RETRYABLE and e.code() != grpc.StatusCode.CANCELLED:
                    self._fail(client._translate(e, f"watch {self.key!r}"))
                    return
                if "invalid auth token" in _details(e):
                    member.token = None
            except EtcdError as e:
                self._fail(e)
                return
            except ValueError:
                # Channel closed by client.close().
                self._fail(EtcdError(f"etcd client for {client.describe()} was closed"))
                return
            # The stream broke: reconnect on the next endpoint that is ready.
            log.info("watch on %r lost %s; reconnecting", self.key, member.endpoint)
            client._rotate_from(index)
            _, nxt = client._stream_member()
            while not self._cancelled.is_set() and not client._closed:
                if client._wait_ready(nxt, timeout=1.0):
                    break
                client._rotate_from(client._order()[0])
                _, nxt = client._stream_member()
            if client._closed:
                self._fail(EtcdError(f"etcd client for {client.describe()} was closed"))
                return

    def _fatal_cancel(self, reason: str) -> EtcdError:
        text = f"etcd at {self._client.describe()} cancelled the watch on {self.key!r}: {reason}"
        if "permission denied" in reason:
            return EtcdPermissionDenied(text)
        if "compacted" in reason:
            return EtcdCompactedError(text)
        return EtcdError(text)

    def _fail(self, err: BaseException) -> None:
        self._created.set()
        self._queue.put(err)

    def _event(self, ev: Any) -> Event:
        kind = "DELETE" if ev.type == 1 else "PUT"
        prev = KeyValue._from_pb(ev.prev_kv) if ev.HasField("prev_kv") else None
        return Event(kind, KeyValue._from_pb(ev.kv), prev)


# --------------------------------------------------------------------------- lease keeper


class LeaseKeeper:
    """A lease plus the thread that keeps it alive over one keep-alive stream.

    The lease is granted in the constructor (one LeaseGrant RPC; raises on
    failure). Keep-alives go out every ``ttl / 3`` seconds on one stream; a broken
    stream is reopened on the next endpoint. If etcd reports the lease gone
    (TTL 0), :attr:`expired` is set and ``on_expired`` runs once.
    :meth:`close` stops the thread and, by default, revokes the lease.

    :meth:`keep_also` adds another, already granted lease to the same stream (for
    instance a lease shared by several processes); it is refreshed at the same
    pace, is never revoked by :meth:`close`, and is dropped when etcd reports it gone.
    """

    def __init__(
        self,
        client: EtcdClient,
        ttl: int,
        *,
        on_expired: Callable[[], None] | None = None,
        lease_id: int = 0,
    ) -> None:
        if ttl < 1:
            raise ValueError(f"lease TTL must be at least 1 second, got {ttl}")
        self._client = client
        self.ttl = int(ttl)
        self.id = client.lease_grant(self.ttl, lease_id=lease_id)
        self.expired = threading.Event()
        self._on_expired = on_expired
        self._stop = threading.Event()
        self._call: Any = None
        self._also: frozenset[int] = frozenset()
        self._interval = max(self.ttl / 3.0, 0.2)  # between keep-alives
        self._thread = threading.Thread(target=self._run, name=f"etcd-lease-{self.id:x}", daemon=True)
        self._thread.start()

    def keep_also(self, lease_id: int) -> None:
        """Refresh ``lease_id`` too, on this stream, from the next keep-alive on."""
        if lease_id != self.id:
            self._also = self._also | {lease_id}

    def also_kept(self) -> frozenset[int]:
        """The extra leases still being refreshed (see :meth:`keep_also`)."""
        return self._also

    def _requests(self) -> Iterator[Any]:
        interval = self._interval
        request = rpc_pb2.LeaseKeepAliveRequest(ID=self.id)
        while True:
            yield request
            for extra in self._also:
                yield rpc_pb2.LeaseKeepAliveRequest(ID=extra)
            if self._stop.wait(interval):
                return

    def _run(self) -> None:
        client = self._client
        # The lease was granted with its full TTL a moment ago: the stream opens when
        # the first refresh is due, one interval later (a burst of grants, such as a
        # rendezvous of many nodes, then opens no streams at all). A reopened stream
        # refreshes at once.
        if self._stop.wait(self._interval):
            return
        while not self._stop.is_set():
            index, member = client._stream_member()
            try:
                metadata = client._metadata(member, time.monotonic() + client.timeout)
                self._call = member.stub("Lease").LeaseKeepAlive(self._requests(), metadata=metadata)
                for resp in self._call:
                    if resp.ID != self.id:
                        if resp.TTL <= 0 and resp.ID in self._also:
                            log.info("extra lease %x kept by lease %x is gone", resp.ID, self.id)
                            self._also = self._also - {resp.ID}
                        continue
                    if resp.TTL <= 0:
                        self._expire()
                        return
                if self._stop.is_set():
                    return
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return
                log.info("keep-alive of lease %x lost %s: %s", self.id, member.endpoint, _details(e))
            except (EtcdError, ValueError) as e:
                log.warning("keep-alive of lease %x stopped: %s", self.id, e)
                return
            client._rotate_from(index)
            _, nxt = client._stream_member()
            for _ in itertools.count():
                if self._stop.is_set() or client._closed:
                    return
                if client._wait_ready(nxt, timeout=1.0):
                    break
                client._rotate_from(client._order()[0])
                _, nxt = client._stream_member()

    def _expire(self) -> None:
        if not self.expired.is_set():
            self.expired.set()
            log.warning("lease %x expired", self.id)
            if self._on_expired is not None:
                self._on_expired()

    def close(self, *, revoke: bool = True, timeout: float | None = None) -> None:
        """Stop keeping the lease alive; revoke it (deleting its keys) unless told not to."""
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        if revoke and not self.expired.is_set():
            try:
                self._client.lease_revoke(self.id, timeout=timeout)
            except EtcdError as e:
                log.warning("could not revoke lease %x: %s", self.id, e)

    def __enter__(self) -> LeaseKeeper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
