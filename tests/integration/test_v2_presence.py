"""etcd-v2 member liveness from etcd (issue 29): a node's presence key on a short lease.

Before: a member of a running round that stopped without a word (SIGSTOP, power loss) was found dead
only when its stored heartbeat was ``member_expiry`` old (16 s with torch's defaults), so a hung
node cost the survivors 16 s + the last call. Now etcd's leader expires its presence lease after
``presence_ttl`` (3 s) and an observer reports it (:mod:`etcd_rdzv.dynamic.presence`). The other
tests are the false-drop side: a live node whose keep-alive stream sits on a frozen etcd follower,
or whose process is starved of CPU, keeps its key; a node without a key is never judged by it.
"""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from helpers.nodes import ETCD_V2, Nodes, nodes_of, results

from etcd_rdzv import EtcdRendezvousHandler
from etcd_rdzv.dynamic import handler as handler_module
from etcd_rdzv.dynamic.presence import Presence
from etcd_server import EtcdCluster
from etcd_store.client import EtcdClient

pytestmark = pytest.mark.timeout(120)

#: torch's heartbeat defaults: a member's heartbeat alone would condemn it after 16 s.
CONF = {"join_timeout": "60", "last_call_timeout": "1", "close_timeout": "5", "heartbeat_timeout": "5",
        "keep_alive_interval": "5", "keep_alive_max_attempt": "3", "read_timeout": "5", "presence_ttl": "3"}
#: What the detection of a stopped member may take: the 3 s TTL (counted from its last renewal, at
#: most 0.5 s before the stop), etcd's expiry check (0.5 s), the observer's read period (0.5 s), the
#: grace its absence must last (1.5 s), slack.
FOUND_WITHIN = 8.0


@pytest.fixture
def nodes(etcd_endpoint: str) -> Iterator[Nodes]:
    n = Nodes(etcd_endpoint, ETCD_V2, conf=CONF, name="presence")
    try:
        yield n
    finally:
        n.close()


def _presence(handler: EtcdRendezvousHandler) -> Presence:
    presence = handler._presence
    assert presence is not None
    return presence


def _backend_state(nodes: Nodes, handler: EtcdRendezvousHandler) -> bytes:
    got = handler._state_holder.backend.get_state()  # type: ignore[attr-defined]
    assert got is not None
    return bytes(got[0])


def _present(nodes: Nodes, handler: EtcdRendezvousHandler) -> bool:
    return nodes.client.get(_presence(handler).key(str(handler._this_node))) is not None


def test_a_member_that_stops_is_reported_after_its_presence_lease(nodes: Nodes) -> None:
    """A member that stops renewing (its client gone, nothing revoked: a hung or powered-off node) is
    reported by the other member's ``num_nodes_waiting()`` within FOUND_WITHIN (measured 5.0 s: the 3 s TTL, the read period and the 1.5 s absence),
    where its heartbeat (written 5 s apart) would take 16 s."""
    a, b = nodes.new(2, 2), nodes.new(2, 2)
    results(nodes.join(a, b))
    assert _present(nodes, a) and _present(nodes, b)
    assert a.num_nodes_waiting() == 0
    stopped = time.monotonic()
    b._stop_heartbeats()
    b._state_holder.backend.client.close()  # type: ignore[attr-defined]  # the handler stays, unheard
    while a.num_nodes_waiting() == 0:
        assert time.monotonic() - stopped < FOUND_WITHIN, "the stopped member was not reported"
        time.sleep(0.1)
    took = time.monotonic() - stopped
    print(f"[presence] the stopped member was reported {took:.2f} s after it stopped")
    assert "presence" in a._restart_reported, a._restart_reported
    assert took >= 2.0, f"reported after {took:.1f} s: before its 3 s lease could expire"


def test_a_member_without_a_presence_key_is_judged_by_its_heartbeat_only(nodes: Nodes) -> None:
    """A member that keeps no key (``presence_ttl=0``: as a node of an older etcd-rdzv, or torch's own
    handler) is never reported by presence while its heartbeats go on."""
    a, b = nodes.new(2, 2), nodes.new(2, 2, presence_ttl="0")
    results(nodes.join(a, b))
    assert b._presence is None and not nodes.client.range(
        _presence(a).key(str(b._this_node)), count_only=True).count
    until = time.monotonic() + 2 * int(CONF["presence_ttl"])
    while time.monotonic() < until:
        assert a.num_nodes_waiting() == 0, a._restart_reported
        time.sleep(0.2)


def test_shutdown_removes_the_key_at_once(nodes: Nodes) -> None:
    """A node that ends revokes its presence lease: its key is gone when ``shutdown()`` returns."""
    a, b = nodes.new(2, 2), nodes.new(2, 2)
    results(nodes.join(a, b))
    assert a.shutdown()
    assert not _present(nodes, a) and _present(nodes, b)


def test_a_live_node_keeps_its_key_through_a_frozen_follower(etcd_binary: str) -> None:
    """The false-drop bound: a node whose keep-alive stream is on an etcd follower that freezes (SIGSTOP)
    for three TTLs keeps its presence key (its stream moves to another member within 1 s without an
    answer: 0.5 + 1 s + the reconnect, under the 3 s TTL), and an observer on the leader reports nobody."""
    ttl = 3
    with EtcdCluster(3, binary=etcd_binary) as cluster:
        leader = cluster.leader()
        frozen = (leader + 1) % 3
        endpoints = cluster.endpoints
        order = [endpoints[frozen]] + [e for i, e in enumerate(endpoints) if i != frozen]
        with EtcdClient(",".join(order), timeout=3) as client, EtcdClient(endpoints[leader], timeout=3) as observer:
            kept, view = Presence(client, "/presence-test/run", ttl), Presence(observer, "/presence-test/run", ttl)
            assert kept.ensure("node-b")
            time.sleep(ttl / 6 + 0.5)  # the keep-alive stream opens on the preferred member, the follower
            assert view.departed(["node-b"]) == []  # the observer has read the key once
            key = observer.get(kept.key("node-b"))
            assert key is not None
            pid = cluster.pids[frozen]
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            try:
                until = time.monotonic() + 3 * ttl  # the fault's duration, not a synchronisation
                while time.monotonic() < until:
                    assert view.departed(["node-b"]) == [], "a live node was reported gone"
                    time.sleep(0.2)
            finally:
                os.kill(pid, signal.SIGCONT)
            after = observer.get(kept.key("node-b"))
            assert after is not None and after.create_revision == key.create_revision  # never expired
            kept.leave()
            assert observer.get(kept.key("node-b")) is None


def test_a_starved_node_keeps_its_key(etcd_endpoint: str) -> None:
    """The false-drop bound under load: three CPU hogs on the 2-core host and a thread of the node's own
    process spinning in Python (the GIL) for three TTLs; the key is never deleted (same create revision),
    and the node's renewals stay well under the TTL apart."""
    ttl = 3
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    spinner = threading.Thread(target=spin, daemon=True)
    try:
        with EtcdClient(etcd_endpoint, timeout=3) as client, EtcdClient(etcd_endpoint, timeout=3) as observer:
            kept = Presence(client, f"/presence-starved/{time.monotonic_ns()}", ttl)
            assert kept.ensure("node-s")
            key = observer.get(kept.key("node-s"))
            assert key is not None
            spinner.start()
            time.sleep(3 * ttl)  # the load's duration, not a synchronisation
            stop.set()
            spinner.join()
            after = observer.get(kept.key("node-s"))
            assert after is not None and after.create_revision == key.create_revision, "the key expired under load"
            session = kept._session
            assert session is not None
            renewed = session.renewed_at()
            gaps = [b - a for a, b in itertools.pairwise(renewed)]
            assert gaps and max(gaps) < ttl - 1, f"renewals {max(gaps):.2f} s apart under load"
            kept.leave()
    finally:
        stop.set()
        for hog in hogs:
            hog.kill()
            hog.wait()


# ------------------------------------------------------------------ fast_recovery (opt-in)

FAST = {"last_call_timeout": "30", "fast_recovery": "true"}


def test_fast_recovery_re_forms_without_a_stopped_member_before_the_last_call(nodes: Nodes) -> None:
    """fast_recovery: the survivors of a stopped member (its presence lease expires) re-form as soon as
    both joined, not after torch's 30 s last call; the stopped member's heartbeat, still in the state,
    is not waited for."""
    a, b, c = (nodes.new(2, 3, **FAST) for _ in range(3))
    results(nodes.join(a, b, c))
    stopped = time.monotonic()
    c._stop_heartbeats()
    c._state_holder.backend.client.close()  # type: ignore[attr-defined]  # hung: nothing revoked
    while a.num_nodes_waiting() == 0:
        assert time.monotonic() - stopped < FOUND_WITHIN, "the stopped member was not reported"
        time.sleep(0.1)
    infos = results(nodes.join(a, b), timeout=20)
    took = time.monotonic() - stopped
    assert {i.world_size for i in infos} == {2}
    assert took < 15, f"re-formed {took:.1f} s after the stop: the last call ran"


def test_fast_recovery_waits_for_every_live_node(nodes: Nodes) -> None:
    """fast_recovery ends the last call only once every live node of the ended round joined: with
    --nnodes=1:4, a round that one member re-opens stays open while two others are alive and out, and
    completes with the three once they join, without waiting for a fourth whose presence expired."""
    a, b, c, d = (nodes.new(1, 4, **FAST) for _ in range(4))
    results(nodes.join(a, b, c, d))  # max_nodes joined: complete at once
    d._stop_heartbeats()
    d._state_holder.backend.client.close()  # type: ignore[attr-defined]  # hung: its key expires in 3 s
    (first,) = nodes.join(a)  # a leaves the round: the round ends, a joins the next one
    time.sleep(2 * int(CONF["presence_ttl"]))  # b and c train on, alive (a wait for what must not happen)
    state = pickle.loads(_backend_state(nodes, a))
    assert not state.complete and set(state.participants) == {a._this_node}
    assert not first.done()
    joined = time.monotonic()
    infos = results([first, *nodes.join(b, c)], timeout=20)
    assert {i.world_size for i in infos} == {3}
    assert time.monotonic() - joined < 15, "the last call ran"


def test_a_quorum_loss_longer_than_the_ttl_drops_nobody(etcd_binary: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two members of a running round on a 3-member etcd lose its quorum for three TTLs (2 of 3 members
    stopped), then it comes back: their clients presume their presence leases lost meanwhile (no answer
    for a TTL), etcd expired nothing (no leader), and each member puts its key anew at its first poll
    after the recovery, before the old lease (extended by a TTL by the new leader) expires: no member is
    reported gone, during the outage or after it (polled as torch's agent polls, 0.2 s apart). Only
    the rank-0 member observes here (as in a job of more than four nodes), so the other one re-puts its
    key in its own poll, not as an observer (before: it did not, and was dropped after the recovery)."""
    ttl = 3
    monkeypatch.setattr(handler_module, "OBSERVERS", 1)
    with EtcdCluster(3, binary=etcd_binary) as cluster, \
            nodes_of(cluster.endpoint_string, ETCD_V2, conf={**CONF, "read_timeout": "30"}, name="presence-ql") as n:
        a, b = n.new(2, 2), n.new(2, 2)
        results(n.join(a, b))
        seen: list[str] = []
        stop = threading.Event()

        def poll(handler: EtcdRendezvousHandler) -> None:
            while not stop.is_set():
                if handler.num_nodes_waiting():
                    seen.append(f"{handler._this_node}: {handler._restart_reported}")
                time.sleep(0.2)

        pollers = [threading.Thread(target=poll, args=(h,), daemon=True) for h in (a, b)]
        for t in pollers:
            t.start()
        try:
            time.sleep(1)  # both poll with the quorum up
            down = [i for i in range(3) if i != cluster.leader()][:1] + [cluster.leader()]
            for i in down:
                cluster.stop_member(i)
            time.sleep(3 * ttl)  # the outage's duration, not a synchronisation
            ups = [threading.Thread(target=cluster.start_member, args=(i,)) for i in down]
            for t in ups:
                t.start()
            for t in ups:
                t.join()
            time.sleep(3 * ttl)  # polls after the recovery, past the old leases' extended expiry
        finally:
            stop.set()
            for t in pollers:
                t.join(timeout=60)
        assert seen == [], seen
        for h in (a, b):
            assert n.client.get(_presence(h).key(str(h._this_node))) is not None


def test_a_live_member_whose_lease_etcd_ended_is_not_reported(nodes: Nodes) -> None:
    """etcd ends one live member's lease and not the observer's: a paused etcd leader, resuming, revokes
    the leases it finds expired on its stale clock (etcd-io/etcd#15247; the nemesis suite's leader
    SIGSTOPs of 2-5 s did it with the 3 s TTL: a member's key gone, the observer's kept, the group
    restarted). The member learns it at its next keep-alive and puts its key again at its next poll
    (here 1 s late); the observer, reading twice before that, must not report it (its absence lasts
    less than the grace)."""
    a, b = nodes.new(2, 2), nodes.new(2, 2)
    results(nodes.join(a, b))
    trusted = time.monotonic() + 2 * _presence(a).ttl
    while _presence(a).present() is None:  # an observer judges from a TTL after its own key was first read
        assert time.monotonic() < trusted, "the observer never came to judge"
        assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
        time.sleep(0.2)
    assert nodes.client.lease_revoke(_presence(b)._session.id)  # type: ignore[union-attr]
    assert not _present(nodes, b) and _present(nodes, a)
    reports: list[int] = []
    late = time.monotonic() + 1.0  # b polls (and re-puts) only after 1 s: a reads its key gone twice
    while time.monotonic() < late:
        reports.append(a.num_nodes_waiting())
        time.sleep(0.1)
    until = time.monotonic() + 3 * _presence(a).ttl
    while time.monotonic() < until:
        reports += [a.num_nodes_waiting(), b.num_nodes_waiting()]
        time.sleep(0.2)
    assert not any(reports), f"a live member was reported after etcd ended its lease: {a._restart_reported}"
    assert _present(nodes, a) and _present(nodes, b)


def test_every_lease_lost_at_once_drops_nobody(nodes: Nodes) -> None:
    """etcd unreachable from every node for longer than the TTL (a network cut, etcd itself up: it
    expires every presence lease, unlike a quorum loss), then reachable again: the members' leases
    are gone from etcd (revoked here, as the expiry would) before their keep-alive streams learn it.
    An observer whose own key is gone judges nobody, and after its key is back judges only members it
    has read again: no member is reported while each re-puts its key at its own poll. (Before: the
    observer's first read after the cut found the other member's key gone and reported it, and the
    whole group restarted after every outage longer than 3 s: test_partitions' test_e.)
    Then a member that stops afterwards is still reported: the view did not go blind."""
    a, b = nodes.new(2, 2), nodes.new(2, 2)
    results(nodes.join(a, b))
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
    leases = [_presence(h)._session.id for h in (a, b)]  # type: ignore[union-attr]
    for lease in leases:
        assert nodes.client.lease_revoke(lease)
    assert nodes.client.range(_presence(a).key("").rstrip(b"/") + b"/", prefix=True).kvs == []
    reports: list[int] = []
    until = time.monotonic() + 3 * _presence(a).ttl
    while time.monotonic() < until:  # a polls first, each round: it reads before b re-puts its key
        reports += [a.num_nodes_waiting(), b.num_nodes_waiting()]
        time.sleep(0.2)
    assert not any(reports), f"a member was reported after its lease was lost with everyone's: {reports}"
    assert _present(nodes, a) and _present(nodes, b)
    stopped = time.monotonic()
    b._stop_heartbeats()
    b._state_holder.backend.client.close()  # type: ignore[attr-defined]
    while a.num_nodes_waiting() == 0:
        assert time.monotonic() - stopped < FOUND_WITHIN, "a member stopped after the cut was not reported"
        time.sleep(0.1)
