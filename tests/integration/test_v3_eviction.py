"""Suspicion-based eviction in ``etcd-v3`` against a real etcd (:mod:`etcd_rdzv.native.leases`).

Three handlers in this process, each with its own client (its own keep-alive stream, as a host
has). A node "dies" when its client closes without revoking its lease: its keep-alives stop and
its join key stays until etcd expires the lease, as after SIGKILL. The lease TTL is 30 s here, so
that a re-formed group well before it can only come from an eviction (each test also checks that
the dead node's lease was still alive when its key went).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator

import pytest
from helpers.nodes import ETCD_V3, Nodes, lease_of

from etcd_rdzv.native.handler import EtcdV3RendezvousHandler, RoundResult
from etcd_server import EtcdCluster

pytestmark = pytest.mark.timeout(120)

TTL = 30  # "heartbeat": far longer than an eviction takes
EVICTED_WITHIN = 20.0  # generous: an eviction takes about 4-5 s, the lease 30 s
_ids = itertools.count()


CONF = {"join_timeout": "60", "last_call_timeout": "30", "close_timeout": "5", "heartbeat": str(TTL),
        "read_timeout": "10"}


class Run(Nodes):
    """etcd-v3 handlers of one run (--nnodes=2:3), each with its own client, in threads."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint, ETCD_V3, conf=CONF, name="v3e")

    def new(self, min_nodes: int = 2, max_nodes: int = 3, **conf: str) -> EtcdV3RendezvousHandler:
        handler: EtcdV3RendezvousHandler = super().new(min_nodes, max_nodes, **conf)
        return handler


@pytest.fixture
def run(etcd_endpoint: str) -> Iterator[Run]:
    r = Run(etcd_endpoint)
    try:
        yield r
    finally:
        r.close()


def form(run: Run, *handlers: EtcdV3RendezvousHandler, timeout: float = 30.0) -> list[RoundResult]:
    res = [f.result(timeout=timeout) for f in run.start(*handlers)]
    assert len({(r.round, r.world_size) for r in res}) == 1, res
    return res


def die(handler: EtcdV3RendezvousHandler) -> None:
    """The node's keep-alives stop and nothing is revoked (its process was SIGKILLed)."""
    handler._client.close()


def test_the_survivors_evict_a_dead_member_long_before_its_lease_expires(run: Run) -> None:
    a, b, c = run.new(), run.new(), run.new()
    assert form(run, a, b, c)[0].world_size == 3
    dead_lease = lease_of(c)
    die(c)
    started = time.monotonic()
    res = form(run, a, b, timeout=EVICTED_WITHIN)  # the group failed: the survivors re-rendezvous
    took = time.monotonic() - started
    print(f"[eviction] survivors re-formed round {res[0].round} in {took:.2f} s (lease TTL {TTL} s)")
    assert {(r.round, r.world_size) for r in res} == {(2, 2)}
    assert run.client.lease_time_to_live(dead_lease) > 0  # its key was evicted, not expired
    assert run.joined(1) == 0


def test_a_live_member_slow_to_rejoin_is_not_evicted(run: Run) -> None:
    """A member that has not noticed the failure yet keeps renewing: it is waited for."""
    a, b, c = run.new(), run.new(), run.new()
    form(run, a, b, c)
    waiting = run.start(a, b)
    time.sleep(5.0)  # the fault: c is slow for 5 s (well over two missed renewals' worth)
    assert run.joined(1) == 1 and not any(f.done() for f in waiting)
    res = [f.result(timeout=30) for f in waiting + run.start(c)]
    assert {(r.round, r.world_size) for r in res} == {(2, 3)}


def test_eviction_off_waits_for_the_lease(run: Run) -> None:
    """``evict_misses=0``: a dead member leaves only when its lease expires."""
    a, b, c = (run.new(evict_misses="0", heartbeat="6") for _ in range(3))
    form(run, a, b, c)
    die(c)
    waiting = run.start(a, b)
    time.sleep(4.0)  # the fault's age: past two missed renewals, short of the 6 s lease
    assert run.joined(1) == 1 and not any(f.done() for f in waiting)
    res = [f.result(timeout=30) for f in waiting]
    assert {(r.round, r.world_size) for r in res} == {(2, 2)}


def test_a_member_renewing_at_a_slower_pace_is_judged_at_its_own(run: Run) -> None:
    """Issue 30: a healthy member with ``renew_interval=5`` is silent up to 5 s between renewals; the
    rule judged it at the observers' 1 s pace and evicted it about 2 s after they re-joined. Its join
    value now names its pace: it is evicted only after 2 x 5 s of silence, so it is waited for."""
    a, b = run.new(), run.new()
    c = run.new(renew_interval="5")
    form(run, a, b, c)
    waiting = run.start(a, b)
    time.sleep(8.0)  # c is slow to notice: more than one of its 5 s renewal gaps passes
    assert run.joined(1) == 1 and not any(f.done() for f in waiting)
    res = [f.result(timeout=30) for f in waiting + run.start(c)]
    assert {(r.round, r.world_size) for r in res} == {(2, 3)}


def test_a_member_whose_stream_sits_on_a_frozen_follower_is_not_evicted(etcd_binary: str) -> None:
    """Issue 30: 3-member etcd; c's keep-alive stream is on a follower that is SIGSTOPped while a and b
    (on the leader) re-join. c's client moves its stream after its answer bound (2 s) counted from its
    first unanswered renewal: the leader hears c again about 3 s after its last renewal, while the old
    rule evicted after 2 s. c must still be in round 1 when it re-joins, and round 2 has all three."""
    with EtcdCluster(3, binary=etcd_binary) as cluster:
        leader = cluster.leader()
        frozen = (leader + 1) % 3
        endpoints = cluster.endpoints
        order = [endpoints[frozen]] + [e for i, e in enumerate(endpoints) if i != frozen]
        run = Run(endpoints[leader])
        try:
            a, b = run.new(), run.new()
            run.endpoint = ",".join(order)  # c prefers the follower: its streams open there
            c = run.new()
            run.endpoint = endpoints[leader]
            form(run, a, b, c)
            time.sleep(1.5)  # c's keep-alive stream is open on the follower
            pid = cluster.pids[frozen]
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            try:
                waiting = run.start(a, b)
                time.sleep(7.0)  # past c's failover (about 3 s) and the new bound (4 s) with a margin
                assert run.joined(1) == 1, "c was evicted although its client failed over in time"
                res = [f.result(timeout=30) for f in waiting + run.start(c)]
            finally:
                os.kill(pid, signal.SIGCONT)
            assert {(r.round, r.world_size) for r in res} == {(2, 3)}
        finally:
            run.close()
