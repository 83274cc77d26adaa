"""The client's retry decision for etcd's bare raft errors, against in-process gRPC servers.

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
from etcd_store.errors import EtcdTimeoutError


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
