"""Tests of etcd_server.EtcdCluster: a real 3-member cluster on loopback."""

from __future__ import annotations

import os
import time

import pytest
from conftest import etcd_pids, pid_alive

from etcd_server import EtcdCluster


def _wait_gone(pids: list[int], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_leader_failover_keeps_client_working(etcd_binary: str) -> None:
    from etcd_store.client import EtcdClient

    with EtcdCluster(3, binary=etcd_binary) as cluster:
        assert len(cluster.endpoints) == 3 and len(set(cluster.endpoints)) == 3
        assert cluster.endpoint_string == ",".join(cluster.endpoints)
        assert all(ep.startswith("127.0.0.1:") for ep in cluster.endpoints)
        pids = [p for p in cluster.pids if p is not None]
        assert len(pids) == 3 and pids == sorted(etcd_pids(os.getpid()) & set(pids))
        old = cluster.leader()
        # The client prefers the leader's endpoint, so killing it forces a failover.
        order = [cluster.endpoints[old]] + [e for i, e in enumerate(cluster.endpoints) if i != old]
        with EtcdClient(order, timeout=20) as client:
            client.put(b"before", b"1")
            cluster.stop_member(old)  # SIGKILL: a crash
            assert not cluster.is_running(old)
            assert os.path.isdir(os.path.join(cluster.data_dirs[old], "member"))
            new = cluster.leader(timeout=20)
            assert new != old
            client.put(b"after", b"2")
            got = client.get(b"before")
            assert got is not None and got.value == b"1"
            got = client.get(b"after")
            assert got is not None and got.value == b"2"
            # the crashed member comes back on its ports with its data
            port = cluster.endpoints[old]
            cluster.start_member(old, timeout=30)
            assert cluster.endpoints[old] == port and cluster.is_running(old)
        with EtcdClient(cluster.endpoints[old], timeout=20) as only_old:
            got = only_old.get(b"after")  # linearizable read through the rejoined member
            assert got is not None and got.value == b"2"
    assert _wait_gone(pids), "cluster members left running after stop()"


def test_cluster_stops_on_exception_and_graceful_member_stop(etcd_binary: str) -> None:
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="boom"), EtcdCluster(3, binary=etcd_binary) as cluster:
        pids.extend(p for p in cluster.pids if p is not None)
        cluster.stop_member(cluster.leader(), graceful=True)  # SIGTERM: leadership transfer
        cluster.leader(timeout=20)
        with cluster.get_client(timeout=20) as client:
            client.put(b"k", b"v")
        raise RuntimeError("boom")
    assert len(pids) == 3 and _wait_gone(pids)
