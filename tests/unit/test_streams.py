"""The client's one reconnecting stream, driven by tiny in-process Watch servers (not etcd).

etcd itself ends a stream whose member lost its leader with an error (tests/e2e/test_leaderless_watch.py
meets that); a watch can also be *cancelled* with etcd's named "no leader" error in its
``cancel_reason`` (etcd's gRPC proxy does). Either way the watch must resume on another member from
the revision after its last event, not fail; a reason that merely mentions the words is final.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from etcd3.etcdrpc import kv_pb2, rpc_pb2, rpc_pb2_grpc

from etcd_store.client import EtcdClient
from etcd_store.errors import EtcdError

NO_LEADER = "rpc error: code = Unavailable desc = etcdserver: no leader"


class _Watcher(rpc_pb2_grpc.WatchServicer):  # type: ignore[misc]
    """Confirms each watch at ``revision``, then cancels it with ``cancel`` or sends one event
    (key ``k`` at ``revision + 1``) and holds the stream open; records each start revision."""

    def __init__(self, revision: int, cancel: str | None) -> None:
        self.revision = revision
        self.cancel = cancel
        self.starts: list[int] = []

    def Watch(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        create = next(requests).create_request
        self.starts.append(create.start_revision)
        header = rpc_pb2.ResponseHeader(revision=self.revision)
        yield rpc_pb2.WatchResponse(header=header, created=True)
        if self.cancel is not None:
            yield rpc_pb2.WatchResponse(header=header, canceled=True, cancel_reason=self.cancel)
            return
        kv = kv_pb2.KeyValue(key=b"k", value=b"v", mod_revision=self.revision + 1)
        yield rpc_pb2.WatchResponse(header=header, events=[kv_pb2.Event(type=kv_pb2.Event.PUT, kv=kv)])
        done = threading.Event()
        context.add_callback(done.set)
        done.wait(30)


def _serve(*servicers: _Watcher) -> tuple[list[Any], str]:
    servers, endpoints = [], []
    for servicer in servicers:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        rpc_pb2_grpc.add_WatchServicer_to_server(servicer, server)
        endpoints.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    return servers, ",".join(endpoints)


@pytest.fixture
def stop_servers() -> Iterator[list[Any]]:
    servers: list[Any] = []
    yield servers
    for server in servers:
        server.stop(grace=None)


def test_a_watch_cancelled_for_no_leader_resumes_on_the_next_member(stop_servers: list[Any]) -> None:
    leaderless, healthy = _Watcher(10, NO_LEADER), _Watcher(10, None)
    servers, endpoints = _serve(leaderless, healthy)
    stop_servers.extend(servers)
    with EtcdClient(endpoints, timeout=5) as client, client.watch(b"k") as watch:
        events = watch.get(timeout=10)
    assert [(e.kv.key, e.kv.mod_revision) for e in events] == [(b"k", 11)]
    # Watched from now on the first member (revision 10), resumed from 11 on the second.
    assert leaderless.starts[:1] == [0] and healthy.starts[:1] == [11]


def test_a_cancel_reason_that_only_mentions_no_leader_is_final(stop_servers: list[Any]) -> None:
    odd, healthy = _Watcher(10, "etcd-no-leader-0 says: etcdserver: no leader"), _Watcher(10, None)
    servers, endpoints = _serve(odd, healthy)
    stop_servers.extend(servers)
    with EtcdClient(endpoints, timeout=5) as client, client.watch(b"k") as watch:
        with pytest.raises(EtcdError, match="cancelled the watch"):
            watch.get(timeout=10)
    assert healthy.starts == []


def test_watch_deliveries_count_per_client_and_into_the_creating_threads_scope(stop_servers: list[Any]) -> None:
    """A client counts what its watches deliver; ``counting_watches`` attributes each watch to the
    block (thread) that created it, also when its events arrive after the block ended."""
    from etcd_store.client.testing import WatchStats, count_watches, counting_watches

    servers, endpoints = _serve(_Watcher(10, None))
    stop_servers.extend(servers)
    mine, theirs = WatchStats(), WatchStats()
    with EtcdClient(endpoints, timeout=5) as client:
        count_watches(client)
        count_watches(client)  # idempotent: counted once
        with counting_watches(mine):
            first = client.watch(b"k")
        created: list[Any] = []
        other = threading.Thread(target=lambda: created.append(_watch_in(theirs, client)))
        other.start()
        other.join(10)
        unscoped = client.watch(b"k")
        for watch in (first, created[0], unscoped):
            assert len(watch.get(timeout=10)) == 1
            watch.cancel()
        snap = client.stats.snapshot()
    assert snap.watch_events == 3 and snap.watch_bytes > 0
    assert mine.snapshot() == (1, snap.watch_bytes // 3) and theirs.snapshot() == mine.snapshot()


def _watch_in(stats: Any, client: EtcdClient) -> Any:
    from etcd_store.client.testing import counting_watches

    with counting_watches(stats):
        return client.watch(b"k")
