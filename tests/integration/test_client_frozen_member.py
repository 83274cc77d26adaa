"""Findings of the etcd-v3 interleaving checker (tests/integration/test_v3_interleavings.py, its member
SIGSTOP step): a client's keep-alive stream that sits on a member which answers nothing (SIGSTOPped,
a hung host) does not move to another member before gRPC's HTTP/2 keepalive declares the connection dead
(``grpc.keepalive_time_ms`` 10 s + ``grpc.keepalive_timeout_ms`` 5 s, etcd_store/client/channels.py), if
that happens at all (see the second test).
Meanwhile no lease of that client is refreshed, so every lease with a TTL below that expires although
the two other members, a quorum, serve all along: the etcd-v3 nodes on that client lose their join keys
(a running group restarts unless its members re-attach first; a waiting node re-joins). A watch-only
stream on such a member does not move at all while it stays frozen: its events are never delivered.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from etcd_server import EtcdCluster
from etcd_store.client import EtcdClient

pytestmark = pytest.mark.timeout(120)  # the client's behaviour, not etcd's: the newest etcd only (3.6 checked)

TTL = 3  # seconds; refreshed every TTL/3 while the stream answers


@pytest.mark.xfail(strict=True, reason=(
    "defect: a keep-alive stream on a member that answers nothing (SIGSTOP) is not moved to another member "
    "in time (KeepAlives has no deadline on the answers to its refreshes; gRPC's HTTP/2 keepalive needs "
    "at least 15 s, if it fires at all), so leases with a shorter TTL expire while a quorum serves"))
def test_a_lease_outlives_a_frozen_follower(etcd_binary: str) -> None:
    """A lease kept by a client whose keep-alive stream is on a follower survives that follower's
    freeze for 2 x TTL: the other two members answer, and the client knows them."""
    with EtcdCluster(3, binary=etcd_binary) as cluster:
        leader = cluster.leader()
        frozen = (leader + 1) % 3
        endpoints = cluster.endpoints
        order = [endpoints[frozen]] + [e for i, e in enumerate(endpoints) if i != frozen]
        with EtcdClient(",".join(order), timeout=3) as client, \
                EtcdClient(endpoints[leader], timeout=3) as observer:
            session = client.session(TTL)
            time.sleep(TTL / 3 + 0.5)  # the keep-alive stream opens (on the preferred member, the follower)
            pid = cluster.pids[frozen]
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(2 * TTL)  # the fault's duration, not a synchronisation
                left = observer.lease_time_to_live(session.id)
            finally:
                os.kill(pid, signal.SIGCONT)
            session.close()
            assert left > 0, f"the lease expired while members {sorted(set(range(3)) - {frozen})} served"


@pytest.mark.xfail(strict=True, reason=(
    "defect: a watch on a member that answers nothing (SIGSTOP) never moves to another member: an event "
    "written through the others is not delivered within the HTTP/2 keepalive's 15 s (nor in 40 s, measured), "
    "although the channel options ask for keepalive pings"))
def test_a_watch_on_a_frozen_follower_moves_on(etcd_binary: str) -> None:
    """A watch (the client's only stream) on a follower that freezes still delivers a write made through
    the leader, within the client's HTTP/2 keepalive (next ping <= 10 s, + 5 s) and a margin."""
    with EtcdCluster(3, binary=etcd_binary) as cluster:
        leader = cluster.leader()
        frozen = (leader + 1) % 3
        endpoints = cluster.endpoints
        order = [endpoints[frozen]] + [e for i, e in enumerate(endpoints) if i != frozen]
        with EtcdClient(",".join(order), timeout=3) as client, \
                EtcdClient(endpoints[leader], timeout=3) as writer:
            watch = client.watch(b"/frozen-watch/", prefix=True)
            assert watch.wait_created(10)
            pid = cluster.pids[frozen]
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            try:
                writer.put(b"/frozen-watch/k", b"v")
                deadline = time.monotonic() + 17.0
                events = []
                while not events and time.monotonic() < deadline:
                    events = watch.get(timeout=deadline - time.monotonic())
            finally:
                os.kill(pid, signal.SIGCONT)
                watch.cancel()
            assert events, f"no event within 17 s while members {sorted(set(range(3)) - {frozen})} served"
