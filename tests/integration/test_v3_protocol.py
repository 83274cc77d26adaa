"""The ``etcd-v3`` handler against real etcd (3.4 and 3.5), many handlers in threads.

Each test uses a fresh key prefix, so tests share the module's etcd without
seeing each other. ``next_round`` (the barrier without the store) runs in
threads; every handler a test makes is shut down at teardown. Waiting for a
state in etcd is done with a watch (``wait_count``), never by sleeping.
"""

from __future__ import annotations

import itertools
import json
import signal
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import as_completed
from typing import Any

import pytest
from helpers.nodes import ETCD_V3, lease_of, results
from helpers.nodes import Nodes as HarnessNodes
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from etcd_rdzv.conf import parse_v3_settings
from etcd_rdzv.conf_keys import DEFAULT_LEASE_TTL
from etcd_rdzv.native import protocol, records, rounds
from etcd_rdzv.native import wait as round_wait
from etcd_rdzv.native.handler import EtcdV3RendezvousHandler, RoundResult
from etcd_rdzv.native.records import RunKeys, Sealed
from etcd_rdzv.plugin import create_etcd_v3_handler, create_etcd_v3_rdzv_handler
from etcd_store.client import EtcdClient, Watch
from etcd_store.client.testing import RpcCounter, WatchTap
from etcd_store.errors import EtcdConnectionError, EtcdPermissionDenied

pytestmark = pytest.mark.timeout(120)

_ids = itertools.count()
WAIT = 30.0  # generous bound for what should take well under a second
CONF = {"join_timeout": "60", "last_call_timeout": "0.5", "close_timeout": "5",
        "heartbeat": "3", "read_timeout": "10"}


def wait_count(client: EtcdClient, prefix: bytes, want: int, timeout: float = WAIT) -> None:
    """Block until exactly ``want`` keys exist under ``prefix`` (watch-driven)."""
    res = client.range(prefix, prefix=True, count_only=True)
    if res.count == want:
        return
    deadline = time.monotonic() + timeout
    with client.watch(prefix, prefix=True, start_revision=res.revision + 1) as watch:
        while time.monotonic() < deadline:
            if watch.get(timeout=deadline - time.monotonic()) and (
                client.range(prefix, prefix=True, count_only=True).count == want
            ):
                return
    raise AssertionError(f"{prefix!r} never held {want} keys")


class Nodes(HarnessNodes):
    """etcd-v3 handlers of one run sharing one client (``shared=False``: each its own), in threads."""

    def __init__(self, endpoint: str, *, shared: bool = True) -> None:
        super().__init__(endpoint, ETCD_V3, conf=CONF, shared=shared, name="v3t", workers=64)


@pytest.fixture
def nodes(etcd_endpoint: str) -> Iterator[Nodes]:
    n = Nodes(etcd_endpoint)
    try:
        yield n
    finally:
        n.close()


def assert_group(res: list[RoundResult], world_size: int) -> None:
    assert sorted(r.rank for r in res) == list(range(world_size))
    assert {r.world_size for r in res} == {world_size}
    assert len({(r.round, r.seal_revision) for r in res}) == 1


def rendezvous_all(nodes: Nodes, handlers: Iterable[EtcdV3RendezvousHandler]) -> list[RendezvousInfo]:
    """``next_rendezvous`` of every handler at once, in threads; their results in order."""
    return [f.result(timeout=WAIT) for f in [nodes.pool.submit(h.next_rendezvous) for h in handlers]]


def masters(infos: Iterable[RendezvousInfo]) -> set[tuple[str, int]]:
    """The distinct (MASTER_ADDR, MASTER_PORT) the members were given."""
    return {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}


def joined_address(nodes: Nodes, handler: EtcdV3RendezvousHandler, round_: int = 1) -> tuple[str, int]:
    """(addr, port) that ``handler`` put in its join key of ``round_``."""
    kv = nodes.client.get(nodes.keys.join_key(round_, handler.node_id))
    assert kv is not None
    value = json.loads(kv.value)
    return value["addr"], value["port"]


# --------------------------------------------------------------------------- barrier


def test_max_nodes_seals_at_once(nodes: Nodes) -> None:
    hs = nodes.many(3, 2, 3, last_call_timeout="30")
    started = time.monotonic()
    res = results(nodes.start(*hs))
    assert time.monotonic() - started < 20  # far below last_call_timeout=30
    assert_group(res, 3)
    assert res[0].round == 1
    by_rank = sorted(res, key=lambda r: r.rank)
    assert nodes.members(1) == [r.node_id for r in by_rank]


def test_ranks_follow_join_order(nodes: Nodes) -> None:
    hs = nodes.many(3, 3, 3)
    futures = []
    for i, h in enumerate(hs):
        futures += nodes.start(h)
        wait_count(nodes.client, nodes.join_prefix(1), i + 1)
    res = results(futures)
    assert [r.rank for r in res] == [0, 1, 2]


def test_last_call_admits_min_nodes_after_the_timeout(nodes: Nodes) -> None:
    hs = nodes.many(2, 2, 4, last_call_timeout="1")
    started = time.monotonic()
    res = results(nodes.start(*hs))
    assert time.monotonic() - started >= 0.9
    assert_group(res, 2)


def test_join_timeout_below_min_nodes(nodes: Nodes) -> None:
    (h,) = nodes.many(1, 2, 2, join_timeout="1")
    started = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match="join_timeout"):
        h.next_round()
    assert time.monotonic() - started >= 0.9
    # The timed-out node withdrew its join key.
    assert nodes.client.range(nodes.join_prefix(1), prefix=True, count_only=True).count == 0


def test_single_node_round(nodes: Nodes) -> None:
    (h,) = nodes.many(1, 1, 1)
    r = h.next_round()
    assert (r.round, r.rank, r.world_size) == (1, 0, 1)
    r2 = h.next_round()
    assert (r2.round, r2.rank, r2.world_size) == (2, 0, 1)
    # Re-joining left round 1: only the round-2 join key remains.
    assert nodes.client.range(nodes.join_prefix(1), prefix=True, count_only=True).count == 0
    assert nodes.client.range(nodes.join_prefix(2), prefix=True, count_only=True).count == 1


# --------------------------------------------------------------------------- late joiners


def test_late_joiner_waits_is_counted_and_admitted(nodes: Nodes) -> None:
    a, b, late = nodes.many(3, 2, 3)
    assert_group(results(nodes.start(a, b)), 2)
    assert a.num_nodes_waiting() == 0
    (pending,) = nodes.start(late)
    wait_count(nodes.client, nodes.join_prefix(2), 1)
    assert a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1
    assert not pending.done()  # exclusivity: it waits for the running group
    # The agents restart their groups: all three form round 2.
    res = results([*nodes.start(a, b), pending])
    assert_group(res, 3)
    assert {r.round for r in res} == {2}
    assert a.num_nodes_waiting() == 0


def test_num_nodes_waiting_is_one_read(nodes: Nodes, etcd_endpoint: str) -> None:
    counter = RpcCounter()
    client = EtcdClient(etcd_endpoint, interceptors=[counter])
    try:
        h = create_etcd_v3_rdzv_handler(nodes.params(1, 2), client=client)
        nodes.handlers.append(h)
        h.next_round()
        counter.reset()
        for _ in range(5):
            assert h.num_nodes_waiting() == 0
        assert counter.snapshot() == {"KV/Txn": 5}
    finally:
        for h in nodes.handlers:
            h.shutdown()
        client.close()


def test_full_group_keeps_a_late_node_out_without_timing_it_out(nodes: Nodes) -> None:
    """min=1, max=2: a third node must neither form a second group nor time out."""
    a, b = nodes.many(2, 1, 2, join_timeout="60")
    late = nodes.new(1, 2, join_timeout="2")
    assert_group(results(nodes.start(a, b)), 2)
    (pending,) = nodes.start(late)
    wait_count(nodes.client, nodes.join_prefix(2), 1)
    assert a.num_nodes_waiting() == 0  # the group is full: not worth a restart
    # concurrent.futures.TimeoutError: the builtin TimeoutError only from Python 3.11 on.
    with pytest.raises(FutureTimeout):
        pending.result(timeout=3.5)  # > join_timeout and > last call: still waiting
    # One member re-rendezvous (its workers failed): the group is no longer full,
    # so the other member's agent sees nodes waiting and re-rendezvous too.
    (fa,) = nodes.start(a)
    wait_count(nodes.client, nodes.join_prefix(2), 2)
    assert b.num_nodes_waiting() == 2
    (fb,) = nodes.start(b)
    r_late, r_a = pending.result(timeout=WAIT), fa.result(timeout=WAIT)
    assert r_late.round == r_a.round == 2
    assert_group([r_late, r_a], 2)
    assert r_late.rank == 0  # it joined round 2 first
    assert not fb.done()  # b came third: it waits for room in round 3
    wait_count(nodes.client, nodes.join_prefix(3), 1)


def test_over_max_nodes_move_to_the_next_round(nodes: Nodes) -> None:
    hs = nodes.many(3, 1, 2, last_call_timeout="0.3")
    futures = nodes.start(*hs)
    done = list(itertools.islice(as_completed(futures, timeout=WAIT), 2))
    first = [f.result() for f in done]
    assert {r.round for r in first} == {1}
    assert_group(first, 2)
    wait_count(nodes.client, nodes.join_prefix(2), 1)  # the third waits for round 2
    assert sum(f.done() for f in futures) == 2
    assert nodes.client.range(nodes.join_prefix(1), prefix=True, count_only=True).count == 2


# --------------------------------------------------------------------------- events per node


def tapped(nodes: Nodes, n: int, min_nodes: int, max_nodes: int, **conf: str) -> tuple[list[Any], list[WatchTap]]:
    """``n`` handlers whose watches the test sees (:class:`WatchTap` over the shared client)."""
    pairs = [nodes.tapped(min_nodes, max_nodes, **conf) for _ in range(n)]
    return [h for h, _ in pairs], [t for _, t in pairs]


@pytest.mark.parametrize(("min_nodes", "last_call"), [(32, "30"), (2, "0.5")])
def test_a_waiting_node_hears_one_event_per_round(nodes: Nodes, min_nodes: int, last_call: str) -> None:
    """32 nodes form a round: each waiting node's watch delivers the sealed record
    and nothing else (the joins of its round are not in its watch), whether one
    joiner fills the round (min = max) or candidates wait out the last call."""
    hs, taps = tapped(nodes, 32, min_nodes, 32, last_call_timeout=last_call)
    res = results(nodes.start(*hs))
    assert_group(res, 32)
    seal = res[0].seal_revision
    assert all(len(t.watches) == 1 for t in taps)  # one wait each, on the watch opened before its join
    heard = []
    for tap in taps:
        events = tap.events()
        assert [(ev.type, ev.kv.key, ev.kv.mod_revision) for ev in events] in (
            [], [("PUT", nodes.keys.sealed, seal)]), events
        # Not heard: the seal came before the node's watch started, so the catch-up read found it.
        by_read = not events and tap.watches[0].created_revision >= seal
        heard.append(len(events) + by_read)
    # The seal reaches a node as its watch event or, when the seal came before the node's watch
    # started, through the catch-up read; the sealer may see its own seal first.
    assert sum(heard) >= 31, heard


def test_a_re_rendezvous_costs_each_node_the_departures_it_waits_for(nodes: Nodes) -> None:
    """All 16 members of round 1 re-join round 2: a node hears at most 3 events besides
    the departures from round 1 it must wait for (a seal candidate's), and the
    others hear only the seal."""
    hs, taps = tapped(nodes, 16, 2, 16, last_call_timeout="30")
    assert_group(results(nodes.start(*hs)), 16)
    before = [len(t.watches) for t in taps]  # the watches of round 1 are not counted
    started = time.monotonic()
    res = results(nodes.start(*hs))
    assert time.monotonic() - started < 20  # fast recovery: not the 30 s last call
    assert_group(res, 16)
    assert {r.round for r in res} == {2}
    for tap, skip in zip(taps, before, strict=True):
        watches = tap.watches[skip:]
        assert 1 <= len(watches) <= 2  # one wait: its ctl/ watch, widened to round 1's joins or not
        events = [ev for w in watches for ev in w.events]
        departures = [ev for ev in events
                      if ev.type == "DELETE" and (nodes.keys.parse_join_key(ev.kv.key) or (0,))[0] == 1]
        assert len(events) - len(departures) <= 3, events
        assert len(departures) <= 15, events


# --------------------------------------------------------------------------- failures


def _fake_join(nodes: Nodes, round_: int, name: str, ttl: int, value: bytes = b"{}") -> int:
    """A node that joins (the join transaction) and then dies: its lease is never refreshed."""
    lease = nodes.client.lease_grant(ttl)
    sealed = protocol.read_meta(nodes.client, nodes.keys).sealed
    assert sealed.round == round_ - 1
    assert protocol.join(nodes.client, nodes.keys, name, value, lease, sealed).ok
    return lease


def seal_now(nodes: Nodes, keys: RunKeys, round_: int, previous: Sealed, lease: int,
             max_nodes: int = 8) -> protocol.SealOutcome:
    """Read round ``round_`` and seal it with what was read (as a candidate does)."""
    read = protocol.read_round(nodes.client, keys, round_)
    return protocol.seal(nodes.client, keys, round_, previous, read, lease, max_nodes)


def test_node_revoked_before_sealing_is_not_a_member(nodes: Nodes) -> None:
    a, b = nodes.many(2, 2, 3, last_call_timeout="2")
    (fa,) = nodes.start(a)
    wait_count(nodes.client, nodes.join_prefix(1), 1)
    lease = _fake_join(nodes, 1, "dead-node", ttl=30)  # count reaches min: last call starts
    nodes.client.lease_revoke(lease)  # dies before the last call ends
    wait_count(nodes.client, nodes.join_prefix(1), 1)
    (fb,) = nodes.start(b)
    res = results([fa, fb])
    assert_group(res, 2)
    assert "dead-node" not in nodes.members(1)


def test_expired_lease_is_not_counted(nodes: Nodes) -> None:
    a, b, c = nodes.many(3, 3, 3)
    _fake_join(nodes, 1, "expiring-node", ttl=2)
    (fa,) = nodes.start(a)
    wait_count(nodes.client, nodes.join_prefix(1), 2)
    wait_count(nodes.client, nodes.join_prefix(1), 1)  # the lease expired: its key is gone
    res = results([fa, *nodes.start(b, c)])
    assert_group(res, 3)
    assert "expiring-node" not in nodes.members(1)


def test_waiting_node_whose_lease_expires_rejoins(nodes: Nodes) -> None:
    a, b = nodes.many(2, 2, 2)
    (fa,) = nodes.start(a)
    wait_count(nodes.client, nodes.join_prefix(1), 1)
    old_lease = lease_of(a)
    nodes.client.lease_revoke(old_lease)  # as if a's keep-alives had stopped for a TTL
    wait_count(nodes.client, nodes.join_prefix(1), 1)  # gone, then re-joined with a new lease
    (fb,) = nodes.start(b)
    res = results([fa, fb])
    assert_group(res, 2)
    assert lease_of(a) != old_lease


def test_member_lease_loss_re_attaches_while_its_round_runs(nodes: Nodes) -> None:
    """A member whose lease ended while no later round was sealed puts its key back
    with a new lease instead of restarting its group (see also test_v3_outage.py)."""
    a, b = nodes.many(2, 2, 2)
    assert_group(results(nodes.start(a, b)), 2)
    session = a._node.session
    assert session is not None
    nodes.client.lease_revoke(session.id)
    assert session.lost.wait(WAIT)
    assert a.num_nodes_waiting() == 0  # re-attached: a's agent keeps its workers
    kv = nodes.client.get(nodes.keys.join_key(1, a.node_id))
    assert kv is not None and kv.lease == lease_of(a) != session.id
    assert b.num_nodes_waiting() == 0
    res = results(nodes.start(a, b))
    assert_group(res, 2)
    assert {r.round for r in res} == {2}


@pytest.mark.etcd_matrix("3.6")
def test_a_lease_that_ends_between_the_read_and_the_seal_is_a_member_that_re_attaches(
        nodes: Nodes, monkeypatch: pytest.MonkeyPatch) -> None:
    """The seal is fenced on the join counter, which joins and withdrawals bump and a lease end
    does not: a member whose lease ends between the sealer's read and its seal Txn is named
    (present at the read, gone at the seal revision). A node that still runs (its lease ended
    in an outage, or was revoked) may hear the seal before its keep-alive tells it, and report
    its rank: it is then what a member whose lease ended right after the seal is, and it
    re-attaches at its first ``num_nodes_waiting()`` (fenced on that seal being the last), after
    which its group is whole (docs/etcd-v3-design.md, "The read and the seal")."""
    a, b = nodes.many(2, 2, 2)
    (fa,) = nodes.start(a)
    wait_count(nodes.client, nodes.join_prefix(1), 1)
    victim = lease_of(a)
    real_seal = protocol.seal
    revoked: list[int] = []

    def seal_after_a_lease_end(*args: Any, **kwargs: Any) -> protocol.SealOutcome:
        if not revoked:  # between the sealer's read (done) and its Txn
            nodes.client.lease_revoke(victim)
            revoked.append(victim)
        return real_seal(*args, **kwargs)

    monkeypatch.setattr(protocol, "seal", seal_after_a_lease_end)
    (fb,) = nodes.start(b)
    res = results([fa, fb])
    assert revoked == [victim]
    assert_group(res, 2)  # named: one group, ranks 0..1, one seal revision
    seal_revision = res[0].seal_revision
    key = nodes.keys.join_key(1, a.node_id)
    assert not nodes.client.range(key, revision=seal_revision).kvs  # gone at the seal revision
    assert sorted(nodes.members(1)) == sorted([a.node_id, b.node_id])
    session = a._node.session
    assert session is not None
    assert session.lost.wait(WAIT)  # its keep-alive tells it within a renewal
    assert a.num_nodes_waiting() == 0  # re-attached: its agent keeps its workers
    kv = nodes.client.get(key)
    assert kv is not None and kv.lease == lease_of(a) != victim
    assert b.num_nodes_waiting() == 0  # the group is whole again
    res = results(nodes.start(a, b))
    assert_group(res, 2)
    assert {r.round for r in res} == {2}


def test_a_dead_member_breaks_the_group_at_once(nodes: Nodes) -> None:
    """A member's lease ends after sealing: the others are told to re-rendezvous
    (num_nodes_waiting >= 1) without waiting for their workers to time out."""
    a, b, c = nodes.many(3, 2, 3)
    assert_group(results(nodes.start(a, b, c)), 3)
    assert a.num_nodes_waiting() == 0
    nodes.client.lease_revoke(lease_of(c))  # c dies
    wait_count(nodes.client, nodes.join_prefix(1), 2)
    assert a.num_nodes_waiting() >= 1 and b.num_nodes_waiting() >= 1
    res = results(nodes.start(a, b))
    assert_group(res, 2)
    assert {r.round for r in res} == {2}
    assert a.num_nodes_waiting() == 0
    a.set_closed()
    nodes.client.lease_revoke(lease_of(b))
    wait_count(nodes.client, nodes.join_prefix(2), 1)
    # closed: the agent must re-rendezvous to learn it (next_rendezvous raises)
    assert a.num_nodes_waiting() >= 1
    with pytest.raises(RendezvousClosedError):
        a.next_rendezvous()


def test_recovery_round_skips_the_last_call(nodes: Nodes) -> None:
    """A member dies: the survivors re-form the group as soon as its key is gone,
    not ``last_call_timeout`` later (fast_recovery, the default)."""
    a, b, c = nodes.many(3, 2, 3, last_call_timeout="60")
    assert_group(results(nodes.start(a, b, c)), 3)  # max_nodes: sealed at once
    nodes.client.lease_revoke(lease_of(c))  # c dies
    started = time.monotonic()
    res = results(nodes.start(a, b))
    assert time.monotonic() - started < 15  # the last call would take 60 s
    assert_group(res, 2)
    assert {r.round for r in res} == {2}


def test_recovery_round_waits_for_the_last_call_when_disabled(nodes: Nodes) -> None:
    a, b, c = nodes.many(3, 2, 3, last_call_timeout="1.5", fast_recovery="false")
    assert_group(results(nodes.start(a, b, c)), 3)
    nodes.client.lease_revoke(lease_of(c))
    started = time.monotonic()
    res = results(nodes.start(a, b))
    assert time.monotonic() - started >= 1.4
    assert_group(res, 2)


def test_growing_round_still_waits_for_the_last_call(nodes: Nodes) -> None:
    """A newcomer makes the next round bigger than the group: the last call runs,
    so more arrivals can be gathered into one restart."""
    a, b, c = nodes.many(3, 2, 4, last_call_timeout="1.5")
    assert_group(results(nodes.start(a, b)), 2)
    (fc,) = nodes.start(c)
    wait_count(nodes.client, nodes.join_prefix(2), 1)
    started = time.monotonic()
    res = results([*nodes.start(a, b), fc])
    assert time.monotonic() - started >= 1.4
    assert_group(res, 3)


def test_concurrent_seal_transactions_have_one_winner(nodes: Nodes) -> None:
    (h,) = nodes.many(1, 1, 1)
    lease = nodes.client.lease_grant(30)
    barrier = threading.Barrier(8)

    def attempt() -> bool:
        barrier.wait()
        return protocol.seal(nodes.client, h.keys, 1, Sealed(), read, lease, 8).ok

    read = protocol.read_round(nodes.client, h.keys, 1)
    outcomes = [f.result(timeout=WAIT) for f in [nodes.pool.submit(attempt) for _ in range(8)]]
    assert outcomes.count(True) == 1
    meta = protocol.read_meta(nodes.client, h.keys)
    assert meta.sealed.round == 1


def test_many_nodes_race_to_seal_one_round(nodes: Nodes) -> None:
    hs = nodes.many(12, 2, 12, last_call_timeout="0.5")
    res = results(nodes.start(*hs))
    assert_group(res, 12)


def test_backup_sealer_takes_over_a_silent_first_node(nodes: Nodes) -> None:
    """The first joiner is alive (lease refreshed) but never seals: others seal for it."""
    session = nodes.client.session(10)
    try:
        nodes.client.put(nodes.keys.join_key(1, "silent"), b"{}", lease=session.id)
        a, b = nodes.many(2, 3, 3)
        res = results(nodes.start(a, b))
        assert sorted(r.rank for r in res) == [1, 2]  # rank 0 is the silent node
        assert {r.world_size for r in res} == {3}
        assert nodes.members(1)[0] == "silent"
    finally:
        session.close()


def test_the_join_that_fills_the_round_seals_it(nodes: Nodes, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last joiner learns from its join's answer that the round is full and
    seals at once; it does not wait for its place in the backup order."""
    from etcd_rdzv.native import barrier

    monkeypatch.setattr(barrier, "SEAL_BACKUP_DELAY", 3600.0)  # position 1 would wait an hour
    session = nodes.client.session(10)
    try:
        nodes.client.put(nodes.keys.join_key(1, "silent"), b"{}", lease=session.id)
        (h,) = nodes.many(1, 2, 2)
        r = nodes.start(h)[0].result(timeout=WAIT)
        assert (r.rank, r.world_size) == (1, 2)
    finally:
        session.close()


def test_previous_round_must_be_empty_to_seal(nodes: Nodes) -> None:
    (h,) = nodes.many(1, 1, 1)
    run_lease = nodes.client.lease_grant(30)
    node_lease = nodes.client.lease_grant(30)
    keys = h.keys
    assert protocol.join(nodes.client, keys, "member", b"{}", node_lease, Sealed()).ok
    assert seal_now(nodes, keys, 1, Sealed(), run_lease).ok
    sealed = protocol.read_meta(nodes.client, keys).sealed
    out = seal_now(nodes, keys, 2, sealed, run_lease)
    assert not out.ok and out.read is not None and out.read.prev_count == 1
    nodes.client.lease_revoke(node_lease)
    assert seal_now(nodes, keys, 2, sealed, run_lease).ok


def test_a_seal_is_fenced_on_the_joins_it_read(nodes: Nodes) -> None:
    """A join or a withdrawal between a candidate's read and its seal bumps the join
    counter: the seal fails, and its answer is a fresh read to seal with."""
    (h,) = nodes.many(1, 1, 1)
    keys = h.keys
    run_lease = nodes.client.lease_grant(30)
    node_lease = nodes.client.lease_grant(30)
    value = json.dumps({"addr": "10.0.0.7", "port": 29500}).encode()
    first = protocol.join(nodes.client, keys, "first", value, node_lease, Sealed())
    assert (first.ok, first.seq, first.count) == (True, 1, 1)
    read = protocol.read_round(nodes.client, keys, 1)
    assert (read.count, read.joins) == (1, 1)
    second = protocol.join(nodes.client, keys, "second", b"{}", node_lease, Sealed())
    assert (second.seq, second.count) == (2, 2)
    out = protocol.seal(nodes.client, keys, 1, Sealed(), read, run_lease, 8, master=("10.0.0.7", 29500))
    assert not out.ok and out.read is not None and (out.read.count, out.read.joins) == (2, 2)
    # A withdrawal bumps the counter too (a lease expiry does not: a dead member).
    assert protocol.leave_if_unsealed(nodes.client, keys, 1, keys.join_key(1, "second"), Sealed())
    out2 = protocol.seal(nodes.client, keys, 1, Sealed(), out.read, run_lease, 8)
    assert not out2.ok and out2.read is not None and (out2.read.count, out2.read.joins) == (1, 3)
    assert protocol.seal(nodes.client, keys, 1, Sealed(), out2.read, run_lease, 8,
                         master=("10.0.0.7", 29500)).ok  # fmt: skip
    sealed = protocol.read_meta(nodes.client, keys).sealed
    assert (sealed.round, sealed.master) == (1, ("10.0.0.7", 29500))
    # One left, so the members are named by create revision, not by sequence number.
    assert sealed.membership == records.Membership(1, created=(first.create_revision,))
    assert nodes.members(1) == ["first"]


def test_members_take_master_from_the_sealed_record(nodes: Nodes) -> None:
    """Whoever seals (here the node that filled the round, not rank 0) names rank 0's
    address and port in the sealed record; every member's bootstrap info is that."""
    hs = nodes.many(3, 3, 3)
    infos = rendezvous_all(nodes, hs)
    sealed = protocol.read_meta(nodes.client, nodes.keys).sealed
    rank0 = next(h for h, i in zip(hs, infos, strict=True) if i.rank == 0)
    assert sealed.master == joined_address(nodes, rank0)
    assert masters(infos) == {sealed.master}


def _numbered_ports(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make every port probe of the handlers return the next of 41000, 41001, ... (recorded)."""
    from etcd_rdzv.native import start

    issued: list[int] = []
    numbers = itertools.count(41000)

    def probe() -> int:
        issued.append(next(numbers))
        return issued[-1]

    monkeypatch.setattr(start, "get_free_port", probe)
    return issued


@pytest.mark.etcd_matrix
def test_master_port_is_probed_once_the_round_is_known_after_a_long_wait(
    nodes: Nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 waited longer than a probed port may age (MASTER_PORT_MAX_AGE, here 1 s): the
    sealer names no master, rank 0 probes a port when it learns its rank (as torch does) and
    publishes it in the round's store, and every member takes that one, not the port rank 0
    probed when it joined."""
    from etcd_rdzv.native import start

    monkeypatch.setattr(start, "MASTER_PORT_MAX_AGE", 1.0)
    issued = _numbered_ports(monkeypatch)
    a, b, c = nodes.many(3, 3, 3)
    futures = [nodes.pool.submit(a.next_rendezvous)]
    wait_count(nodes.client, nodes.join_prefix(1), 1)
    joined_port = joined_address(nodes, a)[1]
    time.sleep(1.5)
    futures += [nodes.pool.submit(h.next_rendezvous) for h in (b, c)]
    infos = [f.result(timeout=WAIT) for f in futures]
    assert infos[0].rank == 0
    assert protocol.read_meta(nodes.client, nodes.keys).sealed.master is None
    ((addr, port),) = masters(infos)
    assert addr == "127.0.0.1" and port != joined_port
    assert port == max(issued)  # the last probe: rank 0's, after the seal
    assert int(infos[0].store.get("MASTER_PORT")) == port


def test_without_master_in_the_sealed_record_members_read_rank0s_store(
    nodes: Nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sealed record without rank 0's address (its probe too old, or its key changed under
    the sealer): rank 0 probes a port now and publishes it in the round's store, where the
    others read it (torch's RendezvousStoreInfo.build)."""
    issued = _numbered_ports(monkeypatch)
    monkeypatch.setattr(round_wait, "_master_named", lambda read: None)
    hs = nodes.many(3, 3, 3)
    infos = rendezvous_all(nodes, hs)
    assert protocol.read_meta(nodes.client, nodes.keys).sealed.master is None
    rank0 = next(h for h, i in zip(hs, infos, strict=True) if i.rank == 0)
    assert masters(infos) == {("127.0.0.1", max(issued))}
    assert max(issued) != joined_address(nodes, rank0)[1]


def test_a_join_whose_answer_was_lost_is_found_again(nodes: Nodes, monkeypatch: pytest.MonkeyPatch) -> None:
    """The join applied, its answer was lost, the round got sealed, the replay failed:
    the node must find itself in the sealed round rather than orphan its key."""
    (h,) = nodes.many(1, 1, 2, last_call_timeout="30")
    real_join = protocol.join
    calls = []

    def lossy_join(*args: Any, **kwargs: Any) -> protocol.JoinOutcome:
        calls.append(1)
        first = real_join(*args, **kwargs)
        if len(calls) == 1:
            assert first.ok
            lease = nodes.client.lease_grant(30)
            assert seal_now(nodes, h.keys, 1, Sealed(), lease).ok  # another sealer
            replay = real_join(*args, **kwargs)
            assert not replay.ok and replay.joined_anyway
            return replay
        return first

    monkeypatch.setattr(protocol, "join", lossy_join)
    result = h.next_round()
    assert (result.round, result.rank, result.world_size) == (1, 0, 1)
    assert nodes.client.range(nodes.join_prefix(2), prefix=True, count_only=True).count == 0


# --------------------------------------------------------------------------- lease gone: renew, write again


def test_join_refused_for_a_revoked_lease_takes_a_new_one(nodes: Nodes) -> None:
    """etcd refuses the join (lease not found) before the session noticed: the
    handler ends that session, takes a new lease and joins with it."""
    (a,) = nodes.many(1, 1, 1, heartbeat="60", state_ttl="120")  # keep-alives every 20 s
    assert a.next_round().round == 1
    old = a._node.session
    assert old is not None
    nodes.client.lease_revoke(old.id)
    r = a.next_round()
    assert (r.round, r.rank, r.world_size) == (2, 0, 1)
    assert not old.lost.is_set() and old.done().is_set()  # learnt from the join, not the stream
    assert lease_of(a) != old.id and nodes.client.lease_time_to_live(lease_of(a)) > 0


def test_seal_and_close_after_the_run_lease_expired(nodes: Nodes) -> None:
    """The run lease went (with ``run`` and ``ctl/sealed``): the next seal, and
    a close, each write again with a new run lease."""
    (a,) = nodes.many(1, 1, 1)
    assert a.next_round().round == 1
    first = protocol.read_meta(nodes.client, nodes.keys).run_lease
    assert first is not None
    nodes.client.lease_revoke(first)
    r = a.next_round()
    assert (r.round, r.rank, r.world_size) == (1, 0, 1)  # the run starts over
    second = protocol.read_meta(nodes.client, nodes.keys).run_lease
    assert second not in (None, first)
    nodes.client.lease_revoke(second)
    a.set_closed()
    meta = protocol.read_meta(nodes.client, nodes.keys)
    assert meta.closed and meta.run_lease not in (None, first, second)


# --------------------------------------------------------------------------- closing


def test_close_during_join(nodes: Nodes) -> None:
    a, b = nodes.many(2, 2, 2)
    (fa,) = nodes.start(a)
    wait_count(nodes.client, nodes.join_prefix(1), 1)
    assert not b.is_closed()
    b.set_closed()
    with pytest.raises(RendezvousClosedError):
        fa.result(timeout=WAIT)
    assert a.is_closed() and b.is_closed()
    assert nodes.client.range(nodes.join_prefix(1), prefix=True, count_only=True).count == 0
    with pytest.raises(RendezvousClosedError):
        b.next_round()
    b.set_closed()  # idempotent


def test_shutdown_closes_the_run_and_revokes_the_lease(nodes: Nodes) -> None:
    a, b = nodes.many(2, 2, 2)
    assert_group(results(nodes.start(a, b)), 2)
    lease = lease_of(a)
    assert a.shutdown() is True
    assert a.shutdown() is True
    assert nodes.client.lease_time_to_live(lease) == -1
    assert nodes.client.get(nodes.keys.join_key(1, a.node_id)) is None
    assert b.is_closed()
    assert a.num_nodes_waiting() == 0
    with pytest.raises(RendezvousClosedError):
        a.next_round()
    with pytest.raises(RendezvousClosedError):
        b.next_round()
    assert b.shutdown() is True
    # The last node out removed the counters; `closed` and the last sealed round's records stay, on the
    # run lease (a slower member's workers may still use its store after a normal end).
    run_lease = protocol.read_meta(nodes.client, nodes.keys).run_lease
    left = nodes.client.range(nodes.keys.rounds, prefix=True).kvs
    assert left and all(kv.key.startswith(nodes.keys.round_prefix(1)) and kv.lease == run_lease for kv in left)
    assert nodes.client.range(nodes.keys.seq_root, prefix=True, count_only=True).count == 0
    assert nodes.client.get(nodes.keys.closed) is not None


def test_leave_releases_the_node_without_closing_the_run(nodes: Nodes) -> None:
    """A node that leaves (what its process does at exit without shutdown) is gone at
    once: the others see a lost member, re-form without it, and the run stays open."""
    a, b, c = nodes.many(3, 2, 3, last_call_timeout="60")
    assert_group(results(nodes.start(a, b, c)), 3)
    lease = lease_of(c)
    started = time.monotonic()
    assert c.leave() is True
    assert time.monotonic() - started < 2.5  # LEAVE_TIMEOUT, and much less with etcd up
    assert nodes.client.lease_time_to_live(lease) == -1
    assert nodes.client.get(nodes.keys.join_key(1, c.node_id)) is None
    assert not a.is_closed()
    assert a.num_nodes_waiting() >= 1 and b.num_nodes_waiting() >= 1
    res = results(nodes.start(a, b))  # fast recovery: no last call (60 s)
    assert_group(res, 2)
    assert {r.round for r in res} == {2}
    with pytest.raises(RendezvousClosedError):
        c.next_round()  # this handler is done, the run is not
    assert c.leave() is True


def test_a_waiting_node_that_leaves_is_not_counted(nodes: Nodes) -> None:
    a, b, c = nodes.many(3, 3, 3)
    fa, fb = nodes.start(a, b)
    wait_count(nodes.client, nodes.join_prefix(1), 2)
    assert b.leave() is True
    wait_count(nodes.client, nodes.join_prefix(1), 1)
    assert not fa.done()
    d = nodes.new(3, 3)
    res = results([fa, *nodes.start(c, d)])
    assert_group(res, 3)
    assert b.node_id not in nodes.members(1)
    with pytest.raises(RendezvousClosedError):
        fb.result(timeout=WAIT)


LEAVER = r'''
import sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from etcd_rdzv.plugin import create_etcd_v3_rdzv_handler
endpoint, run_id, prefix = sys.argv[1:4]
params = RendezvousParameters("etcd-v3", endpoint, run_id, 1, 2, local_addr="127.0.0.1",
                              key_prefix=prefix, last_call_timeout="0.5", heartbeat="60")
handler = create_etcd_v3_rdzv_handler(params)
result = handler.next_round()
print(handler.node_id, flush=True)
sys.exit(3)  # without shutdown(), as torchrun's agent on SIGTERM
'''


def test_a_process_that_exits_without_shutdown_leaves(nodes: Nodes, tmp_path: Any) -> None:
    """The atexit hook: the node's lease is revoked at exit (heartbeat=60 would keep
    its key a minute otherwise), and the run is not closed."""
    import subprocess
    import sys

    script = tmp_path / "leaver.py"
    script.write_text(LEAVER)
    done = subprocess.run(
        [sys.executable, str(script), nodes.endpoint, nodes.run_id, nodes.prefix],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 3, done.stderr
    node_id = done.stdout.split()[-1]
    assert nodes.client.get(nodes.keys.join_key(1, node_id)) is None
    assert nodes.client.get(nodes.keys.closed) is None


def test_shutdown_interrupts_a_blocked_join(nodes: Nodes) -> None:
    (a,) = nodes.many(1, 2, 2)
    (fa,) = nodes.start(a)
    wait_count(nodes.client, nodes.join_prefix(1), 1)
    assert a.shutdown() is True
    with pytest.raises(RendezvousClosedError):
        fa.result(timeout=WAIT)


# --------------------------------------------------------------------------- cost


def test_idle_job_writes_nothing(nodes: Nodes) -> None:
    """Once the group runs, its nodes write nothing under the run's prefix while keep-alives go on. The
    run's own writes are what counts: the module's etcd is shared, and another test's lease that expires
    meanwhile moves the store's revision (the whole store's revision moved by one here once, under load)."""
    hs = nodes.many(3, 3, 3, heartbeat="2")
    assert_group(results(nodes.start(*hs)), 3)
    prefix = nodes.prefix.encode()
    before = nodes.client.range(prefix, prefix=True, count_only=True).revision
    sessions = [h._node.session for h in hs]
    assert all(k is not None for k in sessions)
    threading.Event().wait(3.0)  # several keep-alives (every ~0.7 s) must happen meanwhile
    assert all(nodes.client.lease_time_to_live(k.id) > 0 for k in sessions if k is not None)
    # Every write under the prefix since ``before``, up to a sentinel put now (a watch from the past
    # replays them in order, so the sentinel's event ends the list).
    sentinel = prefix + b"/~idle-check"
    nodes.client.put(sentinel, b"")
    writes: list[bytes] = []
    with nodes.client.watch(prefix, prefix=True, start_revision=before + 1) as watch:
        while sentinel not in writes:
            batch = watch.get(timeout=10.0)
            assert batch, f"the watch replayed no sentinel within 10 s; writes so far: {writes}"
            writes += [e.kv.key for e in batch]
    assert writes == [sentinel]


def test_each_handler_may_own_its_client(etcd_endpoint: str) -> None:
    n = Nodes(etcd_endpoint, shared=False)
    try:
        hs = n.many(3, 3, 3)
        assert_group(results(n.start(*hs)), 3)
        assert all(h._owns_client for h in hs)
    finally:
        n.close()


# --------------------------------------------------------------------------- store


def test_next_rendezvous_store_and_bootstrap_per_round(nodes: Nodes) -> None:
    a, b, c = nodes.many(3, 2, 3)
    infos = rendezvous_all(nodes, (a, b, c))
    ranks = {h: i.rank for h, i in zip((a, b, c), infos, strict=True)}
    boot = masters(infos)
    assert len(boot) == 1 and next(iter(boot))[0] == "127.0.0.1"
    infos[0].store.set("k", "v")
    assert infos[1].store.get("k") == b"v"
    first_port = next(iter(boot))[1]
    # The rank-0 node dies: its lease goes, it never calls next_rendezvous again.
    host = next(h for h, r in ranks.items() if r == 0)
    host._close_store()
    nodes.client.lease_revoke(lease_of(host))
    rest = [h for h in (a, b, c) if h is not host]
    infos2 = rendezvous_all(nodes, rest)
    assert sorted(i.rank for i in infos2) == [0, 1] and {i.world_size for i in infos2} == {2}
    boot2 = masters(infos2)
    assert len(boot2) == 1
    new_rank0 = next(h for h, i in zip(rest, infos2, strict=True) if i.rank == 0)
    assert new_rank0 is not host
    # A fresh store per round: round 1's keys are not visible in round 2's store.
    assert not infos2[0].store.check(["k"])
    assert next(iter(boot2))[1] == int(infos2[0].store.get("MASTER_PORT"))
    del first_port


def test_bootstrap_is_rank0s_join_value_and_the_store_rides_the_run_lease(nodes: Nodes) -> None:
    """Members read MASTER_ADDR/PORT from rank 0's join key at the seal revision (the
    port rank 0 put there when joining), and the round's store writes its keys
    under the run lease, with no namespace lease of its own."""
    a, b = nodes.many(2, 2, 2)
    infos = rendezvous_all(nodes, (a, b))
    host = next(h for h, i in zip((a, b), infos, strict=True) if i.rank == 0)
    address = joined_address(nodes, host)
    assert masters(infos) == {address}
    # Rank 0 also published both in the store, where torch's build() would look.
    assert int(infos[0].store.get("MASTER_PORT")) == address[1]
    infos[1].store.set("mine", "1")
    run_lease = protocol.read_meta(nodes.client, nodes.keys).run_lease
    assert run_lease is not None
    res = nodes.client.range(nodes.keys.store_prefix(1).encode(), prefix=True)
    assert res.kvs and {kv.lease for kv in res.kvs} == {run_lease}
    assert not any(b"\0lease" in kv.key for kv in res.kvs)


def test_bootstrap_after_the_earliest_joiner_left(nodes: Nodes) -> None:
    """The earliest joiner leaves before the seal: every member gets the address
    and port of the new rank 0 (the earliest join key at the seal revision), none
    the leaver's."""
    b, c, d, e = nodes.many(4, 4, 4)
    prefix = nodes.join_prefix(1)
    leaver = json.dumps({"addr": "192.0.2.1", "port": 4242, "pid": 1}).encode()
    lease = _fake_join(nodes, 1, "early-leaver", ttl=30, value=leaver)  # the earliest joiner, for now
    futures = [nodes.pool.submit(b.next_rendezvous)]
    wait_count(nodes.client, prefix, 2)
    futures.append(nodes.pool.submit(c.next_rendezvous))
    wait_count(nodes.client, prefix, 3)
    nodes.client.lease_revoke(lease)  # leaves before the seal: b becomes rank 0
    wait_count(nodes.client, prefix, 2)
    futures += [nodes.pool.submit(h.next_rendezvous) for h in (d, e)]
    infos = [f.result(timeout=WAIT) for f in futures]
    assert infos[0].rank == 0
    assert masters(infos) == {joined_address(nodes, b)}


def test_unreachable_etcd_is_a_connection_error_naming_it() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    params = RendezvousParameters(
        backend="etcd-v3", endpoint=f"127.0.0.1:{port}", run_id="nowhere", min_nodes=1,
        max_nodes=1, read_timeout="2", join_timeout="60", close_timeout="3",
    )
    handler = create_etcd_v3_rdzv_handler(params)
    started = time.monotonic()
    try:
        with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
            handler.next_round()
        assert time.monotonic() - started < 30  # read_timeout, not join_timeout
    finally:
        started = time.monotonic()
        assert handler.shutdown() is False  # could not close: etcd is unreachable
        assert time.monotonic() - started < 20  # about close_timeout


def test_a_node_that_lost_etcd_does_not_close_the_run_once_etcd_is_back(fresh_etcd: Any) -> None:
    """torch's launcher calls shutdown() when its agent fails, also on the
    RendezvousConnectionError of a node that lost etcd. When etcd answers again by then
    (the link healed), that shutdown must not close the run for the other nodes: the node
    leaves (its lease revoked: the others see a lost member) and the run stays open."""
    nodes = Nodes(fresh_etcd.get_endpoint())
    try:
        a, b = nodes.many(2, 1, 2, read_timeout="2")
        assert_group(results(nodes.start(a, b)), 2)
        lease = lease_of(a)
        fresh_etcd.stop(keep_data=True)
        with pytest.raises(RendezvousConnectionError):
            a.num_nodes_waiting()  # torch's agent exits on this
        fresh_etcd.start(timeout=30)
        started = time.monotonic()
        assert a.shutdown() is False  # did not close the run
        assert time.monotonic() - started < 5  # LEAVE_TIMEOUT, not close_timeout
        assert not b.is_closed()
        assert nodes.client.lease_time_to_live(lease) == -1
        # its group lost a member: re-form. b's own session ended too when etcd answered none of its
        # keep-alives for a TTL (the client's lease deadline), so b re-attaches and gives missing members
        # its outage grace (read_timeout + heartbeat) before it counts them lost
        deadline = time.monotonic() + 2 + 30 + 10
        while b.num_nodes_waiting() < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert b.num_nodes_waiting() >= 1
        res = results(nodes.start(b))
        assert [(r.round, r.world_size) for r in res] == [(2, 1)]
    finally:
        nodes.close()


# --------------------------------------------------------------------------- waits that end, keys that go


@pytest.mark.etcd_matrix
def test_a_candidate_beside_an_empty_round_sees_a_re_attached_member_leave(nodes: Nodes) -> None:
    """Round 1 is empty when b joins round 2 (a's lease expired: etcd lost it), so b watches
    ``ctl/`` alone. a re-attaches (round 1 holds a key again) and b's read at the end of its
    last call finds round 1 occupied: b must watch round 1 from then on, to see a leave it
    (here a's agent exits: its lease revoked, no join counter bump). It used to wait for its
    join_timeout."""
    (a,) = nodes.many(1, 1, 3)
    assert a.next_round().round == 1
    nodes.client.lease_revoke(lease_of(a))
    wait_count(nodes.client, nodes.join_prefix(1), 0)
    b = nodes.new(1, 3, last_call_timeout="2", join_timeout="120")
    (fb,) = nodes.start(b)
    wait_count(nodes.client, nodes.join_prefix(2), 1)
    assert a.num_nodes_waiting() >= 1  # re-attached (a node waits in round 2: restart at once)
    assert nodes.client.get(nodes.keys.join_key(1, a.node_id)) is not None  # round 2 not sealed yet
    time.sleep(3.0)  # b's last call ends; its read finds round 1 occupied
    assert not fb.done()
    assert a.leave() is True
    r = fb.result(timeout=WAIT)
    assert (r.round, r.rank, r.world_size) == (2, 0, 1)


@pytest.mark.etcd_matrix("3.6")
def test_a_close_seen_by_the_read_that_widens_the_watch_still_ends_the_wait(
        nodes: Nodes, monkeypatch: pytest.MonkeyPatch) -> None:
    """b joins round 2 beside an empty round 1 (ctl/ watch only). Before its read, a re-attaches
    (round 1 full again: b is kept out) and the run is closed. That one read shows both: b settles
    on the close (its event is on b's watch) and must not swap that watch for a wider one from
    now, whose catch-up only signals records newer than the read, or the close is never heard
    and, kept out (the join_timeout suspended), b waits for ever."""
    (a,) = nodes.many(1, 1, 1)
    assert a.next_round().round == 1
    nodes.client.lease_revoke(lease_of(a))
    wait_count(nodes.client, nodes.join_prefix(1), 0)
    real_read = protocol.read_round
    done: list[bool] = []

    def read_after_a_re_attach_and_a_close(*args: Any, **kwargs: Any) -> protocol.RoundRead:
        if not done:
            done.append(True)
            a.num_nodes_waiting()  # a re-attaches into round 1
            assert nodes.client.get(nodes.keys.join_key(1, a.node_id)) is not None
            a.set_closed()
        return real_read(*args, **kwargs)

    monkeypatch.setattr(protocol, "read_round", read_after_a_re_attach_and_a_close)
    b = nodes.new(1, 1, join_timeout="600")
    (fb,) = nodes.start(b)
    with pytest.raises(RendezvousGracefulExitError, match="closed while node .* waited for room in a full group"):
        fb.result(timeout=WAIT)  # as torch's handler answers a node on its redundancy list
    assert done


@pytest.mark.etcd_matrix
def test_a_round_sealed_over_is_not_resolved_as_ours(nodes: Nodes, monkeypatch: pytest.MonkeyPatch) -> None:
    """x's wait in round 1 ends without its outcome (its watch history was compacted) while
    round 1 was sealed with x, x's lease ended and the others re-formed round 2 without it.
    x must not take its rank of round 1 from the members record (that group is gone, and
    round 1's master is not in the sealed record x reads): it joins round 3."""
    x, a, b = nodes.many(3, 2, 3, last_call_timeout="30")
    real_wait = rounds.Participant._wait
    release = threading.Event()

    def wait(self: rounds.Participant, round_: int, outcome: Any, previous: Any, clock: Any,
             *args: Any, **kwargs: Any) -> Any:
        if self is not x._node or release.is_set():
            return real_wait(self, round_, outcome, previous, clock, *args, **kwargs)
        assert release.wait(WAIT)
        return rounds._Retry(None, clock)  # what the real wait returns on EtcdCompactedError

    monkeypatch.setattr(rounds.Participant, "_wait", wait)
    (fx,) = nodes.start(x)
    wait_count(nodes.client, nodes.join_prefix(1), 1)
    first = results(nodes.start(a, b))  # b fills round 1: sealed with x as rank 0
    assert sorted((r.round, r.rank, r.world_size) for r in first) == [(1, 1, 3), (1, 2, 3)]
    assert nodes.members(1)[0] == x.node_id
    nodes.client.lease_revoke(lease_of(x))
    res = results(nodes.start(a, b))  # round 2 without x
    assert [(r.round, r.world_size) for r in res] == [(2, 2), (2, 2)]
    release.set()
    wait_count(nodes.client, nodes.join_prefix(3), 1)
    res = results([fx, *nodes.start(a, b)])
    assert_group(res, 3)
    assert {r.round for r in res} == {3}
    assert res[0].rank == 0  # x joined round 3 first


def _broken_watch(kind: str, revision: int) -> type[Watch]:
    """A :class:`Watch` whose stream fails: before etcd confirms it, or in the answer that
    confirms it (etcd's way of refusing a watch, for instance without read permission) at
    ``revision``."""

    class Broken(Watch):
        async def _run(self) -> None:
            if kind == "after_confirm":
                self.created_revision = revision
                self._created.set()
                self._fail(EtcdPermissionDenied("injected: etcdserver: permission denied"))
            else:
                self._fail(EtcdConnectionError("injected: the watch stream failed before etcd confirmed it"))

    return Broken


@pytest.mark.etcd_matrix
@pytest.mark.parametrize("kind", ["before_confirm", "after_confirm"])
def test_a_watch_that_fails_leaves_no_join_key_behind(
    nodes: Nodes, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The control watch fails: no join goes out when it failed before etcd confirmed it
    (join/1/ and seq/1 stay empty); when it failed later, the join is withdrawn (with a bump
    of the join counter) before the error is raised. A live key would make a seal name a
    node that no longer waits."""
    (a,) = nodes.many(1, 2, 2)
    real_watch = nodes.client.watch

    def watch(key: bytes, range_end: bytes | None = None, **kwargs: Any) -> Watch:
        broken = _broken_watch(kind, nodes.client.range(b"/", count_only=True).revision)
        return broken(nodes.client.transport, key, range_end or b"", 0, False)

    monkeypatch.setattr(nodes.client, "watch", watch)
    with pytest.raises(RendezvousConnectionError, match="injected"):
        a.next_round()
    assert nodes.client.range(nodes.join_prefix(1), prefix=True, count_only=True).count == 0
    seq = nodes.client.get(nodes.keys.seq(1))
    if kind == "before_confirm":
        assert seq is None  # no join was sent
    else:
        assert seq is None or seq.version % 2 == 0  # each join withdrawn
    monkeypatch.setattr(nodes.client, "watch", real_watch)
    b = nodes.new(2, 2)
    assert_group(results(nodes.start(a, b)), 2)


@pytest.mark.etcd_matrix
def test_a_signal_right_after_the_join_applied_still_withdraws_it(
    nodes: Nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM reaches torchrun's agent (its handler raises SignalException) after the join
    Txn applied but before its answer was recorded; the agent skips shutdown(), the handler
    leaves at exit. That leave must withdraw the join with a bump of the join counter: a
    candidate's read taken before it, which names the node, can no longer seal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    (a,) = nodes.many(1, 2, 2)
    other = _fake_join(nodes, 1, "other", ttl=30)  # a live joiner: a is not the last node out
    real_join = protocol.join

    def join_then_signal(*args: Any, **kwargs: Any) -> protocol.JoinOutcome:
        real_join(*args, **kwargs)
        raise SignalException("Process got signal: 15", sigval=signal.SIGTERM)

    monkeypatch.setattr(protocol, "join", join_then_signal)
    with pytest.raises(SignalException):
        a.next_round()
    key = nodes.keys.join_key(1, a.node_id)
    assert nodes.client.get(key) is not None
    read = protocol.read_round(nodes.client, nodes.keys, 1)
    assert [j.node_id for j in read.joiners] == ["other", a.node_id]
    assert a.leave() is True
    assert nodes.client.get(key) is None
    run_lease = nodes.client.lease_grant(30)
    out = protocol.seal(nodes.client, nodes.keys, 1, Sealed(), read, run_lease, 2)
    assert not out.ok and out.read is not None and [j.node_id for j in out.read.joiners] == ["other"]
    nodes.client.lease_revoke(other)


# --------------------------------------------------------------------------- plumbing


def test_registered_with_torch(etcd_endpoint: str) -> None:
    params = RendezvousParameters(
        backend="etcd-v3", endpoint=etcd_endpoint, run_id="reg", min_nodes=1, max_nodes=1,
        key_prefix=f"/v3reg{time.monotonic_ns()}",
    )
    handler = get_rendezvous_handler(params)
    try:
        assert isinstance(handler, EtcdV3RendezvousHandler)
        assert handler.get_backend() == "etcd-v3" and handler.get_run_id() == "reg"
        assert handler.use_agent_store is False
    finally:
        handler.shutdown()
    assert create_etcd_v3_handler() is create_etcd_v3_rdzv_handler


@pytest.mark.parametrize(
    ("conf", "field", "value"),
    [
        ({}, "lease_ttl", DEFAULT_LEASE_TTL),
        ({"heartbeat": "4"}, "lease_ttl", 4),
        ({"keep_alive_interval": "2", "keep_alive_max_attempt": "4"}, "lease_ttl", 8),
        ({"join_timeout": "7.5"}, "join_timeout", 7.5),
        ({"last_call_timeout": "2"}, "last_call_timeout", 2.0),
        ({"key_prefix": "/custom/"}, "key_prefix", "/custom"),
        ({"state_ttl": "60"}, "state_ttl", 60),
        ({}, "fast_recovery", True),
        ({"fast_recovery": "false"}, "fast_recovery", False),
    ],
)
def test_settings(conf: dict[str, str], field: str, value: object) -> None:
    params = RendezvousParameters("etcd-v3", "localhost:2379", "r", 1, 2, **conf)
    settings, options = parse_v3_settings(params)
    assert getattr(settings, field) == value
    assert options.endpoints == "localhost:2379"


@pytest.mark.parametrize(
    ("conf", "named"),
    [
        ({"join_timeout": "soon"}, "join_timeout"),
        ({"last_call_timeout": "-1"}, "last_call_timeout"),
        ({"heartbeat": "0"}, "heartbeat"),
        ({"keep_alive_interval": "x"}, "keep_alive_interval"),
        ({"state_ttl": "1", "heartbeat": "5"}, "state_ttl"),
        ({"read_timeout": "0"}, "read_timeout"),
        ({"fast_recovery": "maybe"}, "fast_recovery"),
    ],
)
def test_bad_settings_name_the_key(conf: dict[str, str], named: str) -> None:
    params = RendezvousParameters("etcd-v3", "localhost:2379", "r", 1, 2, **conf)
    with pytest.raises(ValueError, match=named):
        parse_v3_settings(params)
