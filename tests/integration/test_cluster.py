"""Tests of etcd_server.EtcdCluster: a real 3-member cluster on loopback (etcd 3.4 to 3.7)."""

from __future__ import annotations

import os
import time

import pytest
from helpers.certs import CertPaths, have_openssl, make_certs
from helpers.processes import etcd_pids, pid_alive
from test_server import binary_of

from etcd_server import AuthConfig, EtcdCluster, TLSConfig

#: EtcdCluster runs on every etcd version of the matrix (3.4 to 3.7).
pytestmark = pytest.mark.etcd_matrix

# etcd's default raft timing, which EtcdCluster keeps (heartbeat_ms/election_timeout_ms None).
ELECTION_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    if not have_openssl():
        pytest.skip("openssl command not available")
    return make_certs(tmp_path_factory.mktemp("certs"))


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


def test_tls_auth_cluster_leader_kill_and_restart_on_3_7(certs: CertPaths) -> None:
    """TLS (client certificates with a CommonName) + auth with a prefix-limited user, etcd 3.7.

    Covers what changed in 3.6+: status needs a token, the gateway refuses CN
    certificates once auth is on, so readiness and leader() must not use it.
    """
    from etcd_store.client import EtcdClient
    from etcd_store.errors import EtcdPermissionDenied

    binary = binary_of("3.7")
    tls = TLSConfig(certs.server_cert, certs.server_key, certs.ca,
                    client_cert_file=certs.client_cert, client_key_file=certs.client_key)  # fmt: skip
    pw = "al1ce-cluster-pw"
    auth = AuthConfig("r00t-cluster-pw", user="alice", password=pw, prefix=b"/jobs/alice/")
    with EtcdCluster(3, binary=binary, tls=tls, auth=auth) as cluster:
        assert cluster.version.startswith("3.7.")
        assert all(u.startswith("https://127.0.0.1:") for u in cluster.client_urls)
        old = cluster.leader()
        with cluster.get_client(user="alice", password=pw, timeout=20) as alice:
            alice.put(b"/jobs/alice/before", b"1")
            with pytest.raises(EtcdPermissionDenied):
                alice.put(b"/jobs/bob/x", b"no")
            cluster.stop_member(old)  # SIGKILL the leader
            new = cluster.leader(timeout=20)
            assert new != old
            alice.put(b"/jobs/alice/after", b"2")
            cluster.start_member(old, timeout=30)  # readiness of a rejoining member, TLS + auth on
        tls_files = dict(ca_cert=certs.ca, cert=certs.client_cert, key=certs.client_key)
        with EtcdClient(cluster.client_urls[old], user="alice", password=pw, timeout=20, **tls_files) as one:
            kv = one.get(b"/jobs/alice/after")  # linearizable read through the rejoined member
            assert kv is not None and kv.value == b"2"
        # the whole cluster again on the same data dirs and ports
        urls = cluster.client_urls
        cluster.stop(keep_data=True)
        assert not any(cluster.is_running(i) for i in range(3))
        cluster.start(timeout=60)
        assert cluster.client_urls == urls
        with cluster.get_client(user="alice", password=pw, timeout=20) as alice:
            got = [alice.get(k) for k in (b"/jobs/alice/before", b"/jobs/alice/after")]
            assert [kv.value if kv else None for kv in got] == [b"1", b"2"]


def test_dead_node_lease_expires_within_ttl_of_a_new_leader_on_3_7() -> None:
    """A lease nobody keeps alive, and the leader killed half-way through its TTL (etcd 3.7).

    etcd's lessor lives on the leader; lease checkpointing (which would carry the
    remaining TTL over) is an alpha feature gate, off by default in 3.6/3.7 (an
    experimental flag, off, in 3.4/3.5). So the new leader renews every lease to
    its full TTL plus one election timeout when it takes over. The test asserts
    only what holds with or without checkpointing:

    * never before ``T`` after the last keep-alive was sent, and
    * at most ``T + election timeout + 1 s`` after the new leader is known
      (the 1 s: etcd checks for expired leases every 0.5 s, then revokes
      through raft, then the watch delivers the delete).

    With T=5 s and a kill at T/2 this measured 9.7 to 10.2 s after the last
    keep-alive (6.3 to 6.5 s after the new leader), against ~5 s with no
    leader change.
    """
    from etcd_store.client import EtcdClient

    binary = binary_of("3.7")
    ttl = 5
    key = b"/nodes/dead-node"
    with EtcdCluster(3, binary=binary) as cluster:
        old = cluster.leader()
        followers = [e for i, e in enumerate(cluster.endpoints) if i != old]
        with cluster.get_client(timeout=10) as client, EtcdClient(followers, timeout=10) as observer:
            watch = observer.watch(key)
            assert watch.wait_created(10)
            sent = time.monotonic()
            lease = client.lease_grant(ttl)  # a fresh grant: the node's full TTL, its last "keep-alive"
            last = time.monotonic()
            client.put(key, b"alive", lease=lease)
            kill_at = last + ttl / 2
            time.sleep(max(0.0, kill_at - time.monotonic()))  # scenario timing: the node is dead
            killed = time.monotonic()
            cluster.stop_member(old)  # SIGKILL the leader, which holds the lessor
            assert cluster.leader(timeout=20) != old
            elected = time.monotonic()
            gone = None
            deadline = elected + ttl + ELECTION_TIMEOUT_S + 10.0
            while gone is None and time.monotonic() < deadline:
                for event in watch.get(timeout=max(0.0, deadline - time.monotonic())):
                    if event.type == "DELETE" and event.key == key:
                        gone = time.monotonic()
            watch.cancel()
        assert gone is not None, "the dead node's key was never deleted"
        detail = (
            f"gone {gone - sent:.2f} s after the last keep-alive, kill at +{killed - last:.2f} s, "
            f"new leader +{elected - killed:.2f} s after the kill, gone {gone - elected:.2f} s after it"
        )
        kill_offset = killed - last
        # the election as measured, the new leader's extension of every lease, the expiry check
        election_allowance = (elected - killed) + ELECTION_TIMEOUT_S + 1.0
        assert gone >= sent + ttl, detail
        assert gone <= last + kill_offset + ttl + election_allowance, detail
