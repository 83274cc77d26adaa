"""The client's parts, each alone: the transport and the lease calls are objects the client holds
(not its base classes), and each works without an ``EtcdClient`` against in-process gRPC servers
(not etcd: they answer only the RPCs a test needs).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from etcd3.etcdrpc import rpc_pb2, rpc_pb2_grpc

from etcd_store.client import EtcdClient, Session
from etcd_store.client.calls import LeaseCalls
from etcd_store.client.transport import Transport
from etcd_store.errors import EtcdConnectionError, EtcdError
from etcd_store.options import EtcdClientOptions

_NOT_FOUND = (grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found")


class _Lease(rpc_pb2_grpc.LeaseServicer):  # type: ignore[misc]
    """Grants lease 7 with the TTL asked; revokes lease 7 only (any other: etcd's "not found")."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def LeaseGrant(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls.append("LeaseGrant")
        return rpc_pb2.LeaseGrantResponse(ID=7, TTL=request.TTL)

    def LeaseRevoke(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls.append("LeaseRevoke")
        if request.ID != 7:
            context.abort(*_NOT_FOUND)
        return rpc_pb2.LeaseRevokeResponse()


class _Status(rpc_pb2_grpc.MaintenanceServicer):  # type: ignore[misc]
    """Answers Status with ``version``, or fails every call as a member without a leader."""

    def __init__(self, version: str | None) -> None:
        self.version = version
        self.calls = 0

    def Status(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls += 1
        if self.version is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader")
        return rpc_pb2.StatusResponse(version=self.version)


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[Any] = []

    def start(*servicers: Any) -> str:
        endpoints = []
        for servicer in servicers:
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
            if isinstance(servicer, _Lease):
                rpc_pb2_grpc.add_LeaseServicer_to_server(servicer, server)
            else:
                rpc_pb2_grpc.add_MaintenanceServicer_to_server(servicer, server)
            endpoints.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            server.start()
            servers.append(server)
        return ",".join(endpoints)

    try:
        yield start
    finally:
        for server in servers:
            server.stop(grace=None)


@pytest.mark.parametrize("cls", [EtcdClient, LeaseCalls, Transport])
def test_no_client_part_inherits_from_another(cls: type) -> None:
    assert [c for c in cls.__mro__ if c.__module__.startswith("etcd_store")] == [cls]


def test_the_lease_calls_work_over_a_transport_alone(serve: Any) -> None:
    lease = _Lease()
    transport = Transport(EtcdClientOptions(serve(lease), timeout=5))
    try:
        leases = LeaseCalls(transport)
        assert leases.lease_grant(3) == 7
        assert leases.lease_revoke(7) is True
        assert leases.lease_revoke(8) is False  # etcd's "lease not found", recognised by the transport
        assert lease.calls == ["LeaseGrant", "LeaseRevoke", "LeaseRevoke"]
        with Session(leases, 3) as session:  # a session needs the lease calls, not a client
            assert session.id == 7 and leases.kept_leases() == 1
        assert leases.kept_leases() == 0
        leases.close()
    finally:
        transport.close()
    assert transport.closed


def test_a_call_to_one_member_neither_retries_nor_fails_over(serve: Any) -> None:
    leaderless, healthy = _Status(None), _Status("3.7.0")
    transport = Transport(EtcdClientOptions(serve(leaderless, healthy), timeout=5))
    try:
        with pytest.raises(EtcdConnectionError, match="status of 127.0.0.1"):
            transport.call_member(0, "Maintenance", "Status", rpc_pb2.StatusRequest(), what="status of 127.0.0.1")
        assert (leaderless.calls, healthy.calls) == (1, 0)
        assert transport.call("Maintenance", "Status", rpc_pb2.StatusRequest()).version == "3.7.0"  # fails over
        assert (leaderless.calls, healthy.calls) == (2, 1)
    finally:
        transport.close()


def test_a_client_closed_during_a_call_raises_its_own_error_not_grpcs(
        serve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client is closed between two attempts of a call (the first member had no leader): the next
    attempt's channel is closed and gRPC raises a bare ValueError ("Cannot invoke RPC on closed
    channel!"); the call must end with the client's own error."""
    transport = Transport(EtcdClientOptions(serve(_Status(None), _Status("3.7.0")), timeout=5))
    metadata = transport._metadata
    attempts: list[int] = []

    def close_before_the_second_attempt(*args: Any) -> Any:
        attempts.append(1)
        if len(attempts) == 2:
            transport.close()
        return metadata(*args)

    monkeypatch.setattr(transport, "_metadata", close_before_the_second_attempt)
    try:
        with pytest.raises(EtcdError, match="was closed during"):
            transport.call("Maintenance", "Status", rpc_pb2.StatusRequest())
    finally:
        transport.close()


@pytest.mark.parametrize(("name", "value", "shown"), [
    ("timeout", 0, "0.0"), ("timeout", None, "None"), ("timeout", "5", "'5'"), ("timeout", float("nan"), "nan"),
    ("timeout", True, "True"), ("connect_timeout", "x", "'x'"), ("connect_timeout", -1, "-1.0"),
])  # fmt: skip
def test_a_bad_deadline_is_refused_naming_the_option(name: str, value: Any, shown: str) -> None:
    """Not a bare TypeError from float() or a comparison: the option and the value, before any channel."""
    with pytest.raises(ValueError, match=rf"^etcd client {name} must be a positive number of seconds, got {shown}\.$"):
        EtcdClient("127.0.0.1:1", **{name: value})
    assert EtcdClientOptions("h:1", timeout=2).timeout == 2.0  # a number is kept as a float
