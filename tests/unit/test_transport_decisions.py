"""The client's retry decisions: the pure table (``etcd_store.client.retry``), how failures are
recognised (gRPC code and etcd's exact named errors, ``etcd_store.client.transport``), and the
same decisions end to end against in-process gRPC servers (not etcd: they only answer Txn).

The bare raft errors:

etcd 3.4/3.5 pass two Go errors to the client unnamed, as gRPC UNKNOWN: "raft proposal
dropped" (the request never entered the raft log) and "context deadline exceeded" (its own
request timeout; the proposal may still commit). tests/integration/test_findings.py meets
the second from a real leader without quorum; the first is hard to provoke on purpose, so
here two tiny servers (not etcd: they only answer Txn) give the client each reply on its
first endpoint and a success on its second, and the test sees what the client resends.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from etcd3.etcdrpc import rpc_pb2, rpc_pb2_grpc

from etcd_store.client import EtcdClient
from etcd_store.client.leases import KeepAlives, answer_bound
from etcd_store.client.retry import (
    MAX_STALL_DOUBLINGS,
    Action,
    Attempts,
    Failure,
    RetryPolicy,
    decide,
    stall_bound,
)
from etcd_store.client.transport import Transport, failure_of
from etcd_store.errors import EtcdTimeoutError
from etcd_store.options import EtcdClientOptions


class _Txn(rpc_pb2_grpc.KVServicer):  # type: ignore[misc]
    """Answers every Txn with ``fail`` (an UNKNOWN status text), or succeeds when None."""

    def __init__(self, fail: str | None) -> None:
        self.fail = fail
        self.calls = 0

    def Txn(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls += 1
        if self.fail is not None:
            context.abort(grpc.StatusCode.UNKNOWN, self.fail)
        return rpc_pb2.TxnResponse(succeeded=True)


@pytest.fixture
def members() -> Iterator[tuple[_Txn, _Txn, str]]:
    servicers = (_Txn(None), _Txn(None))
    servers, endpoints = [], []
    for servicer in servicers:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        rpc_pb2_grpc.add_KVServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        endpoints.append(f"127.0.0.1:{port}")
    try:
        yield servicers[0], servicers[1], ",".join(endpoints)
    finally:
        for server in servers:
            server.stop(grace=None)


@pytest.mark.parametrize("idempotent", [False, True])
def test_a_dropped_proposal_is_resent_on_the_next_member(members: tuple[_Txn, _Txn, str], idempotent: bool) -> None:
    first, second, endpoints = members
    first.fail = "raft proposal dropped"
    with EtcdClient(endpoints, timeout=5) as client:
        assert client.txn([], [], idempotent=idempotent).succeeded
    assert (first.calls, second.calls) == (1, 1)


def test_a_server_side_timeout_is_resent_only_when_safe(members: tuple[_Txn, _Txn, str]) -> None:
    first, second, endpoints = members
    first.fail = "context deadline exceeded"
    with EtcdClient(endpoints, timeout=5) as client:
        assert client.txn([], [], idempotent=True).succeeded
    assert (first.calls, second.calls) == (1, 1)
    # Not safe to resend: the timed-out proposal may still commit. The caller hears of it.
    # (A new client: the first one now prefers the member that answered.)
    with EtcdClient(endpoints, timeout=5) as client:
        with pytest.raises(EtcdTimeoutError, match="context deadline exceeded"):
            client.txn([], [], idempotent=False)
    assert (first.calls, second.calls) == (2, 1)


def test_other_unknown_errors_are_not_retried(members: tuple[_Txn, _Txn, str]) -> None:
    first, second, endpoints = members
    first.fail = "something else broke"
    with EtcdClient(endpoints, timeout=5) as client, pytest.raises(Exception, match="something else broke"):
        client.txn([], [], idempotent=True)
    assert (first.calls, second.calls) == (1, 0)


# ------------------------------------------------------------------ the pure decision (etcd_store.client.retry)

_MEMBER = [Failure.UNREACHED, Failure.TLS, Failure.TIMED_OUT, Failure.NOT_APPLIED, Failure.MAYBE_APPLIED]


@pytest.mark.parametrize("failure", _MEMBER)
def test_a_request_safe_to_resend_goes_to_the_next_member_after_any_member_failure(failure: Failure) -> None:
    assert decide(failure, idempotent=True) is Action.NEXT_MEMBER


@pytest.mark.parametrize(
    "failure, action",
    [(Failure.UNREACHED, Action.NEXT_MEMBER), (Failure.NOT_APPLIED, Action.NEXT_MEMBER),
     (Failure.TLS, Action.NEXT_MEMBER), (Failure.TIMED_OUT, Action.RAISE), (Failure.MAYBE_APPLIED, Action.RAISE)],
)  # fmt: skip
def test_a_request_not_safe_to_resend_is_resent_only_when_it_was_not_applied(failure: Failure, action: Action) -> None:
    assert decide(failure, idempotent=False) is action


@pytest.mark.parametrize("idempotent", [True, False])
def test_final_answers_raise_and_stale_tokens_log_in_once(idempotent: bool) -> None:
    assert decide(Failure.FINAL, idempotent=idempotent) is Action.RAISE
    assert decide(Failure.STALE_TOKEN, idempotent=idempotent, can_login=True) is Action.LOGIN_AGAIN
    assert decide(Failure.STALE_TOKEN, idempotent=idempotent, can_login=False) is Action.RAISE
    assert decide(Failure.TLS, idempotent=idempotent, tls_everywhere=True) is Action.RAISE


def test_attempts_remember_tls_members_logins_timeouts_and_pauses() -> None:
    attempts = Attempts(RetryPolicy(), members=2, user=True)
    assert attempts.failed(0, Failure.TLS, True) is Action.NEXT_MEMBER
    assert attempts.failed(0, Failure.TLS, True) is Action.NEXT_MEMBER  # the same member again
    assert attempts.failed(1, Failure.TLS, True) is Action.RAISE  # now every member failed one
    attempts = Attempts(RetryPolicy(), members=2, user=True)
    assert attempts.failed(0, Failure.STALE_TOKEN, True) is Action.LOGIN_AGAIN
    assert attempts.failed(0, Failure.STALE_TOKEN, True) is Action.RAISE  # once per call
    attempts = Attempts(RetryPolicy(first_attempt=2.0), members=2, user=False)
    assert attempts.timeout(30, idempotent=True) == 2.0 and attempts.timeout(30, idempotent=False) == 30
    assert attempts.timeout(1.5, idempotent=True) == 1.5
    attempts.new_round()
    attempts.failed(0, Failure.TIMED_OUT, True)
    attempts.failed(1, Failure.TIMED_OUT, True)
    assert attempts.timeout(30, idempotent=True) == 4.0  # every member timed out in one round
    assert Attempts(RetryPolicy(), members=1, user=False).timeout(30, idempotent=True) == 30
    assert [attempts.next_pause() for _ in range(7)] == [0.025, 0.05, 0.1, 0.2, 0.4, 0.5, 0.5]


def test_unreached_only_holds_while_no_attempt_found_a_server() -> None:
    attempts = Attempts(RetryPolicy(), members=2, user=False)
    attempts.failed(0, Failure.UNREACHED, True)
    assert attempts.unreached_only
    attempts.failed(1, Failure.NOT_APPLIED, True)
    assert not attempts.unreached_only


@pytest.mark.parametrize("bad", [dict(first_attempt=0), dict(first_pause=-1), dict(first_pause=1, max_pause=0.5),
                                 dict(stream_quiet=0)])
def test_a_retry_policy_refuses_bad_numbers_naming_them(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="RetryPolicy"):
        RetryPolicy(**bad)


@pytest.mark.parametrize("interval, first_attempt, bound", [(1.0, 2.0, 1.0), (5.0, 2.0, 2.0), (0.2, 2.0, 1.0),
                                                            (5.0, 0.5, 1.0)])
def test_a_keep_alive_stream_waits_for_answers_a_third_of_a_ttl_at_most_the_attempt_deadline_at_least_1s(
        interval: float, first_attempt: float, bound: float) -> None:
    assert answer_bound(interval, first_attempt) == bound


def test_a_stream_answer_bound_doubles_with_each_stall_in_a_row_up_to_a_cap() -> None:
    assert [stall_bound(2.0, n) for n in range(6)] == [2.0, 4.0, 8.0, 16.0, 16.0, 16.0]
    assert MAX_STALL_DOUBLINGS == 3 and stall_bound(2.0, -1) == 2.0


class _Keeper:
    def _lease_lost(self, lease_id: int, primary: bool) -> None: ...

    def _learn_ttl(self, ttl: int) -> None: ...

    def _stopped(self, reason: BaseException) -> None: ...


def test_a_keep_alive_stream_bound_comes_from_the_ttl_not_the_pace_and_doubles_after_stalls() -> None:
    """A lease renewed every second (etcd-v3's ``renew_interval``) with a TTL of 15 s waits 2 s for an
    answer (a third of the TTL, at most ``first_attempt``), not 1 s: etcd's leader may hold a renewal
    about 1 s under a burst of writes (it was 1 s, and 1,024 clients' streams were cancelled over and
    over in B2). After a stall the bound doubles until an answer comes. No RPC is made here."""
    transport = Transport(EtcdClientOptions("127.0.0.1:1", timeout=5))
    mux = KeepAlives(transport)
    try:
        mux.keep(_Keeper(), 7, 15, first_in=3600.0, interval=1.0)
        assert mux.answer_bound() == 2.0
        mux._stalls_in_row = 2  # two streams in a row ended unanswered
        assert mux.answer_bound() == 8.0
        mux._answer(rpc_pb2.LeaseKeepAliveResponse(ID=7, TTL=15))
        assert mux.answer_bound() == 2.0
        mux.keep(_Keeper(), 8, 3, first_in=3600.0)  # the shortest TTL sets the bound: 3 s / 3 -> 1 s
        assert mux.answer_bound() == 1.0
    finally:
        mux.stop()
        transport.close()


# ------------------------------------------------------------------ recognising etcd's errors: code + exact name

_U, _K = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN


@pytest.mark.parametrize(
    "code, text, failure",
    [
        (_U, "etcdserver: no leader", Failure.NOT_APPLIED),
        (_U, "etcdserver: leader changed", Failure.MAYBE_APPLIED),
        (_U, "etcdserver: request timed out", Failure.MAYBE_APPLIED),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: too many requests", Failure.NOT_APPLIED),
        (_K, "raft proposal dropped", Failure.NOT_APPLIED),
        (_K, "context deadline exceeded", Failure.TIMED_OUT),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "context deadline exceeded", Failure.TIMED_OUT),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", Failure.TIMED_OUT),
        (grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token", Failure.STALE_TOKEN),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: revision of auth store is old", Failure.STALE_TOKEN),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: user name is empty", Failure.STALE_TOKEN),
        (grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found", Failure.FINAL),
        # The text alone decides nothing: a host name or another code around the same words.
        (_U, "errors resolving etcd-tls-0:2379: Domain name not found", Failure.UNREACHED),
        (_U, "failed to connect to all addresses; ssl-proxy-1: Connection refused", Failure.UNREACHED),
        (_K, "etcdserver: no leader", Failure.FINAL),
        (_K, "raft proposal dropped by etcd-2", Failure.FINAL),
        (grpc.StatusCode.INVALID_ARGUMENT, "user 'auth store is old' is empty", Failure.FINAL),
    ],
)
def test_failures_are_recognised_by_code_and_exact_etcd_error(
    code: grpc.StatusCode, text: str, failure: Failure
) -> None:
    assert failure_of((code, text)) is failure


@pytest.mark.parametrize(
    "reason, failure",
    [
        ("rpc error: code = Unavailable desc = etcdserver: no leader", Failure.NOT_APPLIED),
        ("rpc error: code = PermissionDenied desc = etcdserver: permission denied", Failure.FINAL),
        ("rpc error: code = Unauthenticated desc = etcdserver: invalid auth token", Failure.STALE_TOKEN),
        ("watch of etcd-no-leader-0 rpc error: code = Unavailable", Failure.FINAL),
    ],
)
def test_watch_cancel_reasons_are_recognised_by_etcd_named_error(reason: str, failure: Failure) -> None:
    assert Transport.cancel_failure(reason) is failure


# ------------------------------------------------------------------ the same decisions end to end, on tiny servers


class _Scripted(rpc_pb2_grpc.KVServicer):  # type: ignore[misc]
    """Answers Txn with the next scripted failure ``(code, text)``, then succeeds."""

    def __init__(self, *script: tuple[grpc.StatusCode, str]) -> None:
        self.script = list(script)
        self.calls = 0

    def Txn(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls += 1
        if self.script:
            context.abort(*self.script.pop(0))
        return rpc_pb2.TxnResponse(succeeded=True)


def _serve(*servicers: _Scripted) -> tuple[list[Any], str]:
    servers, endpoints = [], []
    for servicer in servicers:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        rpc_pb2_grpc.add_KVServicer_to_server(servicer, server)
        endpoints.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    return servers, ",".join(endpoints)


def test_too_many_requests_is_resent_on_the_next_member_even_when_not_idempotent() -> None:
    """etcd's "too many requests" (RESOURCE_EXHAUSTED) was not applied; it was reported as a
    request "too large" at once because the two share a code."""
    first, second = _Scripted((grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: too many requests")), _Scripted()
    servers, endpoints = _serve(first, second)
    try:
        with EtcdClient(endpoints, timeout=5) as client:
            assert client.txn([], [], idempotent=False).succeeded
        assert (first.calls, second.calls) == (1, 1)
    finally:
        for server in servers:
            server.stop(grace=None)


def test_an_unavailable_answer_naming_tls_on_a_plain_endpoint_is_retried_not_a_tls_error() -> None:
    """A plain-text endpoint cannot fail a TLS handshake, whatever the text says ("tls" in a
    host name); it used to fail at once as a TLS error."""
    only = _Scripted((_U, "upstream etcd-tls-0: ssl certificate proxy restarting"))
    servers, endpoints = _serve(only)
    try:
        with EtcdClient(endpoints, timeout=5) as client:
            assert client.txn([], [], idempotent=True).succeeded
        assert only.calls == 2
    finally:
        for server in servers:
            server.stop(grace=None)
