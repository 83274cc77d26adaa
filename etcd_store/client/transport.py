"""Transport of the client layer: channels, auth tokens, failover, the retry policy
and the translation of gRPC errors into :mod:`etcd_store.errors` exceptions.

Wire schema: the protobuf/gRPC stubs of the maintained ``python3-etcd3`` distribution
(``etcd3.etcdrpc``, regenerated for protobuf >= 5). Callers see plain objects (:mod:`.kv`)
and :mod:`etcd_store.errors` exceptions, never a ``grpc.RpcError``.

The one place etcd's errors are recognised: by gRPC status code and etcd's named errors (a
code with an exact description, as etcd's Go client matches them), never by a substring; a
failed TLS handshake by the standard library (:func:`~.channels.tls_failure`). What follows
(resend, next member, log in again, raise) is decided in :mod:`.retry`.

Cost: one RPC per unary call when healthy; the call's deadline bounds it, retries included.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from etcd3.etcdrpc import rpc_pb2

from ..errors import (
    EtcdAuthError,
    EtcdCompactedError,
    EtcdConnectionError,
    EtcdError,
    EtcdLeaseExists,
    EtcdLeaseNotFound,
    EtcdPermissionDenied,
    EtcdRequestError,
    EtcdTimeoutError,
    EtcdTLSError,
)
from ..options import EtcdClientOptions
from .channels import Member, channel_credentials, check_options, open_aio_channel, open_channel, tls_failure
from .endpoints import Endpoint, client_endpoints
from .kv import clip
from .reactor import Reactor, reactor
from .retry import Action, Attempts, Call, Failure, RetryPolicy, stream_reconnects
from .stats import CallStats, counts_error

log = logging.getLogger(__name__)

__all__ = ["Transport"]

#: The longest a TLS probe (:func:`~.channels.tls_failure`) of a failed attempt may take.
_PROBE_TIMEOUT = 2.0

#: gRPC metadata on every stream (etcd Go's ``clientv3.WithRequireLeader``): etcd then ends a
#: stream whose member lost its leader for a few election timeouts (UNAVAILABLE "no leader");
#: without it a partitioned member keeps the stream open and silent.
REQUIRE_LEADER = ("hasleader", "true")

_Status = tuple[grpc.StatusCode, str]
_C = grpc.StatusCode

# --------------------------------------------------------------------------- recognising etcd's errors

# etcd's named errors (its rpctypes): a status code and an exact description.
_LEASE_NOT_FOUND: _Status = (_C.NOT_FOUND, "etcdserver: requested lease not found")
_LEASE_EXISTS: _Status = (_C.FAILED_PRECONDITION, "etcdserver: lease already exists")
_COMPACTED: _Status = (_C.OUT_OF_RANGE, "etcdserver: mvcc: required revision has been compacted")
_TOO_LARGE: _Status = (_C.INVALID_ARGUMENT, "etcdserver: request is too large")
_NO_SPACE: _Status = (_C.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded")
_AUTH_NOT_ENABLED: _Status = (_C.FAILED_PRECONDITION, "etcdserver: authentication is not enabled")
_USER_EMPTY: _Status = (_C.INVALID_ARGUMENT, "etcdserver: user name is empty")
_AUTH_FAILED: frozenset[_Status] = frozenset({
    (_C.INVALID_ARGUMENT, "etcdserver: authentication failed, invalid user ID or password"),
    # Not in etcd's table: the auth package's own error, passed through as UNKNOWN.
    (_C.UNKNOWN, "auth: authentication failed, password was given for no password user"),
})  # fmt: skip
_PERMISSION_DENIED: _Status = (_C.PERMISSION_DENIED, "etcdserver: permission denied")
_INVALID_TOKEN: _Status = (_C.UNAUTHENTICATED, "etcdserver: invalid auth token")
_NO_LEADER: _Status = (_C.UNAVAILABLE, "etcdserver: no leader")

# What each named error means for a resend (UNAVAILABLE: the member cannot get a request through
# raft now). Two bare Go errors arrive as UNKNOWN on etcd 3.4/3.5: the member's request timeout
# (~7 s) expired without a leader (3.6+: DEADLINE_EXCEEDED; the proposal may still be in flight),
# and raft dropped the proposal (it never entered the log).
_FAILURES: dict[_Status, Failure] = {
    _NO_LEADER: Failure.NOT_APPLIED,
    (_C.UNAVAILABLE, "etcdserver: not capable"): Failure.NOT_APPLIED,
    (_C.UNAVAILABLE, "etcdserver: rpc not supported for learner"): Failure.NOT_APPLIED,
    (_C.RESOURCE_EXHAUSTED, "etcdserver: too many requests"): Failure.NOT_APPLIED,
    (_C.UNKNOWN, "raft proposal dropped"): Failure.NOT_APPLIED,
    (_C.UNKNOWN, "context deadline exceeded"): Failure.TIMED_OUT,
    (_C.UNAVAILABLE, "etcdserver: leader changed"): Failure.MAYBE_APPLIED,
    (_C.UNAVAILABLE, "etcdserver: request timed out"): Failure.MAYBE_APPLIED,
    (_C.UNAVAILABLE, "etcdserver: request timed out, possibly due to previous leader failure"): Failure.MAYBE_APPLIED,
    (_C.UNAVAILABLE, "etcdserver: request timed out, possibly due to connection lost"): Failure.MAYBE_APPLIED,
    (_C.UNAVAILABLE, "etcdserver: server stopped"): Failure.MAYBE_APPLIED,
    (_C.UNAVAILABLE, "etcdserver: unhealthy cluster"): Failure.MAYBE_APPLIED,
    (_C.UNAVAILABLE, "etcdserver: cluster version not found during downgrade"): Failure.MAYBE_APPLIED,
    # A token unknown (expired, pre-restart), older than a users/roles change, or missing: log in.
    _INVALID_TOKEN: Failure.STALE_TOKEN,
    _USER_EMPTY: Failure.STALE_TOKEN,
    (_C.INVALID_ARGUMENT, "etcdserver: revision of auth store is old"): Failure.STALE_TOKEN,
}
_NAMED: frozenset[_Status] = frozenset(
    {*_FAILURES, _LEASE_NOT_FOUND, _LEASE_EXISTS, _COMPACTED, _TOO_LARGE, _NO_SPACE, _AUTH_NOT_ENABLED, *_AUTH_FAILED,
     _PERMISSION_DENIED}
)  # fmt: skip


def _go_code_name(code: grpc.StatusCode) -> str:
    """Go's name of a status code (``PERMISSION_DENIED`` -> ``PermissionDenied``)."""
    return "Canceled" if code == _C.CANCELLED else "".join(w.title() for w in code.name.split("_"))


# A watch etcd cancels carries the Go error string of a named error in ``cancel_reason``.
_CANCEL_REASONS: dict[str, _Status] = {
    f"rpc error: code = {_go_code_name(code)} desc = {desc}": (code, desc) for code, desc in _NAMED
}


def _details(err: grpc.RpcError) -> str:
    try:
        return str(err.details() or "")
    except Exception:  # pragma: no cover - defensive: some errors carry no details
        return str(err)


def _status(err: grpc.RpcError) -> _Status:
    return err.code(), _details(err)


def failure_of(status: _Status) -> Failure:
    """What a failed attempt's status says, TLS aside (the probe decides that): the named error's
    meaning, else by code (any other UNAVAILABLE: no connection, as gRPC fails a call unsent)."""
    named = _FAILURES.get(status)
    if named is not None:
        return named
    code = status[0]
    if code == _C.UNAUTHENTICATED:
        return Failure.STALE_TOKEN
    if code == _C.DEADLINE_EXCEEDED:
        return Failure.TIMED_OUT
    if code == _C.CANCELLED:  # the client cancels no unary call: the member's connection was torn down
        return Failure.MAYBE_APPLIED  # mid-call (RST_STREAM as it was killed); the request may have landed
    if code == _C.UNAVAILABLE and status not in _NAMED:
        return Failure.UNREACHED
    return Failure.FINAL


@dataclass(frozen=True)
class _Failed:
    """One failed attempt: its error, status, what it means, and the TLS probe's finding."""

    err: grpc.RpcError
    status: _Status
    failure: Failure
    tls: str = ""


# --------------------------------------------------------------------------- channels and calls


class Transport:
    """Channels to the endpoints, auth tokens, failover, the retry policy, error translation.

    Held by :class:`~etcd_store.client.EtcdClient` (arguments: there) and shared with
    :mod:`.leases`, :mod:`.watch` and :mod:`.streams`. Unary calls: :meth:`call`,
    :meth:`call_member`; streams: the ``stream_*`` and ``cancel_*`` methods. Usable alone:
    ``Transport(EtcdClientOptions("h:2379")).call("KV", "Range", req)``.
    """

    def __init__(self, options: EtcdClientOptions) -> None:
        o = options
        check_options(o)
        self.options = options
        self.endpoints = client_endpoints(
            o.endpoints, protocol=o.protocol, tls=bool(o.ca_cert or o.cert), user=o.user, password=o.password,
            allow_insecure_auth=o.allow_insecure_auth,
        )
        if o.password and not all(ep.secure for ep in self.endpoints):
            log.warning(
                "etcd user %r sends its password in plain text to %s (allow_insecure_auth is set): "
                "anyone on the path can read it.", o.user, self.describe(),
            )
        self._auth_off_warned = False
        # Set once any member answered: from then on calls ride out outages until their deadline.
        self._reached = False
        self._credentials: grpc.ChannelCredentials | None = None
        self._members = [Member(ep, self._make_channel, self._make_aio_channel) for ep in self.endpoints]
        self._current = 0
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()
        #: Retries and errors of this client (:mod:`.stats`), read by the layers above.
        self.stats = CallStats()
        #: The numbers of the retry policy (:mod:`.retry`).
        self.retry_policy = RetryPolicy()

    @property
    def timeout(self) -> float:
        """The default deadline in seconds of every call, retries included."""
        return self.options.timeout

    @property
    def connect_timeout(self) -> float:
        """Seconds a client that never reached etcd retries refused connections."""
        return self.options.connect_timeout

    # ---------------------------------------------------------------- plumbing

    def describe(self) -> str:
        """The endpoints as a user would write them, for error messages."""
        return ",".join(str(ep) for ep in self.endpoints)

    def __repr__(self) -> str:
        return f"Transport({self.describe()!r})"

    def _make_channel(self, endpoint: Endpoint) -> grpc.Channel:
        return open_channel(endpoint, self._channel_credentials, self.options.interceptors)

    def _make_aio_channel(self, endpoint: Endpoint) -> grpc.aio.Channel:
        return open_aio_channel(endpoint, self._channel_credentials)

    def _channel_credentials(self) -> grpc.ChannelCredentials:
        if self._credentials is None:
            self._credentials = channel_credentials(self.options.ca_cert, self.options.cert, self.options.key)
        return self._credentials

    def _metadata(self, member: Member, deadline: float) -> tuple[tuple[str, str], ...] | None:
        if self.options.user is None:
            return None
        if member.token is None:
            self._authenticate(member, deadline)
        return (("token", member.token),) if member.token else None

    def stream_metadata_now(self, member: Member) -> tuple[tuple[str, str], ...] | None:
        """A stream's metadata on ``member`` if no login is needed, else None (then
        :meth:`stream_metadata` logs in, off the stream loop). Never blocks."""
        if self.options.user is None:
            return (REQUIRE_LEADER,)
        token = member.token
        if token is None:
            return None
        return (("token", token), REQUIRE_LEADER) if token else (REQUIRE_LEADER,)

    def stream_metadata(self, member: Member, deadline: float) -> tuple[tuple[str, str], ...]:
        """The metadata of a stream on ``member``: the auth token (logging in first when
        needed, bounded by ``deadline``) and :data:`REQUIRE_LEADER`."""
        return (*(self._metadata(member, deadline) or ()), REQUIRE_LEADER)

    def _authenticate(self, member: Member, deadline: float) -> None:
        request = rpc_pb2.AuthenticateRequest(name=self.options.user, password=self.options.password)
        stub = member.stub("Auth")
        try:
            resp = stub.Authenticate(request, timeout=max(deadline - time.monotonic(), 0.001))
        except grpc.RpcError as e:
            status = _status(e)
            if status in _AUTH_FAILED:
                refused = EtcdAuthError(
                    f"etcd at {member.endpoint} rejected the credentials of user "
                    f"{self.options.user!r}: wrong user name or password."
                )
                self.stats.failed(refused)
                raise refused from None
            if status == _AUTH_NOT_ENABLED:
                # Auth is off: run without a token, and say once that the password is not needed.
                member.token = ""
                if not self._auth_off_warned:
                    self._auth_off_warned = True
                    log.warning(
                        "etcd at %s has authentication disabled, but user %r and a password were "
                        "configured: the password was sent for nothing and every key is open to anyone "
                        "who can reach etcd. Enable auth in etcd, or remove the credentials.",
                        member.endpoint, self.options.user,
                    )
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

    def call(self, service: str, method: str, request: Any, *, timeout: float | None = None, what: str = "",
             idempotent: bool = True) -> Any:
        """Run one unary RPC under the client's one retry policy; raises :class:`EtcdError`
        subclasses only.

        ``timeout`` (default: the client's) bounds the whole call, retries included. A member
        unreachable or unable to get the request through raft (request timeout, no leader,
        leader changed, proposal dropped) is left for the next; after a round where every
        member failed, a pause of 25 ms growing to 0.5 s. ``idempotent`` requests (reads, plain
        writes, compare-fenced writes) get 2 s attempts, doubling after a round where every
        member timed out (one endpoint: the whole deadline). Others get one attempt with all
        that remains, resent only when the failure proves them unapplied (no connection; no
        leader, too many requests, proposal dropped). An expired token is renewed once, at
        once. A client that never reached etcd gives up after ``connect_timeout`` if no attempt
        found a server; a TLS failure on every member fails at once (table: :mod:`.retry`).
        """
        if self._closed:
            raise EtcdError(f"The etcd client for {self.describe()} is closed.")
        budget = self.timeout if timeout is None else timeout
        attempts = Attempts(self.retry_policy, len(self._members), self.options.user is not None)
        call = Call(service, method, request, what, idempotent, budget, time.monotonic(), attempts)
        while True:
            answered, resp = self._round(call)
            if answered:
                return resp
            if resp is not Action.LOGIN_AGAIN:
                self._between_rounds(call)

    def _round(self, call: Call) -> tuple[bool, Any]:
        """One attempt per member, preferred first: ``(True, response)``, ``(False,
        Action.LOGIN_AGAIN)`` (resend at once), or ``(False, None)`` (all failed)."""
        order = self._order()
        call.attempts.new_round()
        for index in order:
            member = self._members[index]
            remaining = call.deadline - time.monotonic()
            if remaining <= 0:
                break
            call.sent += 1
            if call.sent > 1:
                self.stats.retried(call.method)
            try:
                metadata = self._metadata(member, call.deadline)
                if self._closed:  # closed during the call: open no channel again
                    raise self._closed_during(call)
                stub = member.stub(call.service)
                attempt = call.attempts.timeout(remaining, call.idempotent)
                resp = getattr(stub, call.method)(call.request, timeout=attempt, metadata=metadata)
            except grpc.RpcError as e:
                call.last = failed = self._failed(member, e, call.deadline)
                action = call.attempts.failed(index, failed.failure, call.idempotent)
                if action is Action.RAISE:
                    raise self._translate(failed, call.what) from None
                if action is Action.LOGIN_AGAIN:
                    member.token = None
                    return False, action
                log.debug("etcd %s at %s failed (%s): %s", call.method, member.endpoint, *failed.status)
                continue
            except ValueError:  # gRPC's "Cannot invoke RPC on closed channel!": closed during the call
                if not self._closed:
                    raise
                raise self._closed_during(call) from None
            self._reached = True
            if index != order[0]:
                self._promote(index)
            return True, resp
        return False, None

    def _closed_during(self, call: Call) -> EtcdError:
        return EtcdError(f"The etcd client for {self.describe()} was closed during {call.what or call.method}.")

    def _between_rounds(self, call: Call) -> None:
        """After a round where every member failed: raise if the call is over (deadline, or
        ``connect_timeout`` for a never-connected client), else pause."""
        now = time.monotonic()
        remaining = call.deadline - now
        last = call.last
        if last is None:  # the deadline passed before any attempt (after logging in again)
            raise EtcdTimeoutError(f"No answer from etcd at {self.describe()} within {call.budget:g} s")
        if call.attempts.unreached_only and not self._reached and now - call.start >= self.connect_timeout:
            raise self._never_connected(last.err, call.what)
        if remaining <= 0:
            raise self._translate(last, call.what, timed_out=call.budget)
        # Give reconnects or an election a moment; growing, so a long outage costs few RPCs.
        threading.Event().wait(min(call.attempts.next_pause(), remaining))

    def _failed(self, member: Member, err: grpc.RpcError, deadline: float) -> _Failed:
        """Classify a failed attempt by its status, and for an unreachable ``https`` member by a TLS
        probe (:func:`~.channels.tls_failure`, at most 2 s)."""
        status = _status(err)
        failure = failure_of(status)
        if failure is Failure.UNREACHED and member.endpoint.secure:
            ca, cert, key = self.options.ca_cert, self.options.cert, self.options.key
            budget = min(max(deadline - time.monotonic(), 0.05), _PROBE_TIMEOUT)
            found = tls_failure(member.endpoint.host, member.endpoint.port, ca=ca, cert=cert, key=key,
                                timeout=budget)  # fmt: skip
            if found is not None:
                return _Failed(err, status, Failure.TLS, found)
        return _Failed(err, status, failure)

    @counts_error
    def _translate(self, err: grpc.RpcError | _Failed, what: str, timed_out: float | None = None) -> EtcdError:
        """The :class:`EtcdError` for a failed call (``timed_out``: the call's deadline passed)."""
        failed = err if isinstance(err, _Failed) else _Failed(err, _status(err), failure_of(_status(err)))
        status = failed.status
        code = status[0]
        shown = clip(status[1])  # etcd may echo a request's key or value
        where = f"etcd at {self.describe()}"
        op = f" ({what})" if what else ""
        if failed.failure is Failure.TLS:
            return EtcdTLSError(
                f"TLS handshake with {where} failed{op}: {failed.tls}; {shown.rstrip('.')}. Check the CA "
                "certificate (ca_cert), the client certificate/key, that the server certificate names "
                "the endpoint's host, and http:// versus https://."
            )
        if code == _C.PERMISSION_DENIED:
            return EtcdPermissionDenied(f"{where} denied permission{op}: {shown}")
        if status in _AUTH_FAILED:
            return EtcdAuthError(f"{where} rejected the user name or password{op}: {shown}")
        if failed.failure is Failure.STALE_TOKEN:
            return EtcdAuthError(f"{where} requires authentication{op}: {shown}")
        if status == _TOO_LARGE or (code == _C.RESOURCE_EXHAUSTED and status not in _NAMED):
            return EtcdRequestError(
                f"{where} refused the request as too large{op} (etcd's --max-request-bytes): {shown}"
            )
        if status == _NO_SPACE:
            return EtcdRequestError(f"{where} is out of space{op} (etcd's --quota-backend-bytes): {shown}")
        if status == _LEASE_NOT_FOUND:
            return EtcdLeaseNotFound(f"{where}: {shown}{op}")
        if status == _LEASE_EXISTS:
            return EtcdLeaseExists(f"{where}: {shown}{op}")
        if status == _COMPACTED:
            return EtcdCompactedError(f"{where}: {shown}{op}")
        if code in (_C.INVALID_ARGUMENT, _C.FAILED_PRECONDITION, _C.OUT_OF_RANGE):
            return EtcdRequestError(f"{where} rejected the request{op}: {shown}")
        if timed_out is not None or failed.failure is Failure.TIMED_OUT:
            budget = f" within {timed_out:g} s" if timed_out is not None else ""
            return EtcdTimeoutError(f"No answer from {where}{budget}{op}; last error: {shown}")
        if code == _C.UNAVAILABLE:
            return EtcdConnectionError(f"Cannot reach {where}{op}: {shown}")
        return EtcdError(f"{where} failed{op}: {code.name}: {shown}")

    @counts_error
    def _never_connected(self, err: grpc.RpcError, what: str) -> EtcdConnectionError:
        op = f" ({what})" if what else ""
        return EtcdConnectionError(
            f"Cannot connect to etcd at {self.describe()}{op}: no endpoint accepted a connection "
            f"within connect_timeout={self.connect_timeout:g} s. Is etcd running there, on these "
            f"ports? Last error: {clip(_details(err))}"
        )

    def call_member(
        self, index: int, service: str, method: str, request: Any, *, timeout: float | None = None, what: str = ""
    ) -> Any:
        """One attempt on member ``index`` only: no retry, failover or token (for calls etcd
        answers without one, e.g. ``Maintenance.Status``); raises :class:`EtcdError` only."""
        if self._closed:
            raise EtcdError(f"The etcd client for {self.describe()} is closed.")
        member = self._members[index]
        budget = self.timeout if timeout is None else timeout
        try:
            return getattr(member.stub(service), method)(request, timeout=budget)
        except grpc.RpcError as e:
            raise self._translate(e, what or f"{method} of {member.endpoint}") from None
        except ValueError:  # gRPC's "Cannot invoke RPC on closed channel!": closed during the call
            if not self._closed:
                raise
            raise EtcdError(f"The etcd client for {self.describe()} was closed during {method}.") from None

    def close(self) -> None:
        """Close every channel; open streams end (their loops see :attr:`closed`). In a forked
        child, only marks it closed: the channels are the parent's (gRPC objects do not survive
        a fork)."""
        self._closed = True
        if os.getpid() != self._pid:
            return
        for member in self._members:
            member.close()

    @property
    def inherited(self) -> bool:
        """Whether this process was forked from the one that made this transport."""
        return os.getpid() != self._pid

    # ---------------------------------------------------------------- for the client's streams (.streams, .watch)

    @property
    def reactor(self) -> Reactor:
        """The process's stream loop (:mod:`.reactor`), started on first use."""
        return reactor()

    def stream_opened(self, method: str) -> Callable[[bool, Any], None] | None:
        """Tell interceptors a stream (``"Watch/Watch"``) opened: streams run on ``grpc.aio``
        channels, unseen by synchronous interceptors, so an interceptor may define
        ``stream_opened(method)`` (:class:`~.testing.RpcCounter`) and/or ``stream_message(method,
        sent, message)``. Returns ``note(sent, message)`` for the owner to call per request sent
        (True) and answer read (False) if any interceptor wants messages; else None (no cost)."""
        for interceptor in self.options.interceptors:
            opened = getattr(interceptor, "stream_opened", None)
            if opened is not None:
                opened(method)
        notes = [n for n in (getattr(i, "stream_message", None) for i in self.options.interceptors) if n is not None]
        if not notes:
            return None

        def note(sent: bool, message: Any) -> None:
            for each in notes:
                each(method, sent, message)

        return note

    @staticmethod
    def cancel_failure(reason: str) -> Failure:
        """What etcd cancelling a watch with ``reason`` (a named error's Go string) means; an
        unknown reason is final, "no leader" (``NOT_APPLIED``) resumes elsewhere."""
        status = _CANCEL_REASONS.get(reason)
        return Failure.FINAL if status is None else failure_of(status)

    @counts_error
    def cancel_error(self, reason: str, what: str) -> EtcdError:
        """The error for a watch etcd cancelled, from the named error in its ``cancel_reason``."""
        text = f"etcd at {self.describe()} cancelled the {what}: {clip(reason)}"
        status = _CANCEL_REASONS.get(reason)
        if status is not None and status[0] == _C.PERMISSION_DENIED:
            return EtcdPermissionDenied(text)
        if status is not None and status[0] == _C.UNAUTHENTICATED:
            return EtcdAuthError(text)
        if status == _COMPACTED:
            return EtcdCompactedError(text)
        return EtcdError(text)

    def cancel_wants_login(self, reason: str) -> bool:
        """Whether a watch etcd cancelled for ``reason`` may pass after logging in again.

        etcd keeps simple tokens in memory: after a restart a watch resumed with the old token
        is cancelled (UNAUTHENTICATED on 3.4/3.6, PERMISSION_DENIED on 3.5). It logs in again
        once; refused again with a fresh token, it is denied for good.
        """
        status = _CANCEL_REASONS.get(reason)
        return self.options.user is not None and status in (_INVALID_TOKEN, _PERMISSION_DENIED)

    def stream_error(self, member: Member, err: grpc.RpcError, what: str) -> EtcdError | None:
        """None if another stream can get past a broken stream's status, else its error.

        A refused token is dropped (the next stream logs in). As in etcd's Go client, gRPC's
        CANCELLED (a closing client: the loop sees the close) and INTERNAL (e.g. "Internal
        error from Core" writing to a stream etcd ended for want of a leader) reconnect too.
        """
        failure = failure_of(_status(err))
        if failure is Failure.STALE_TOKEN:
            if self.options.user is None:
                return self._translate(err, what)
            member.token = None
        if stream_reconnects(failure) or err.code() in (_C.CANCELLED, _C.INTERNAL):
            return None
        return self._translate(err, what)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def stream_target(self) -> tuple[int, Member]:
        """The member a new stream goes to (the preferred one) and its index."""
        index = self._order()[0]
        return index, self._members[index]

    def stream_moved(self, index: int) -> None:
        """A stream left member ``index``: prefer the next one (unless another stream moved already)."""
        with self._lock:
            if self._current == index:
                self._current = (index + 1) % len(self._members)
