"""Nobody waits on the dead (issue 30, item 2), against a real etcd.

A node joins round T and dies (its client closes without revoking its lease: its keep-alives
stop and its join key stays until etcd expires the lease, as after SIGKILL). The lease TTL is
30 s here, so that a round formed well before it without the dead node can only come from an
eviction (each test also checks that the dead node's lease was still alive when its key went).

* Before the seal: the sealer judges the joiners it is about to name by eviction's rule and
  evicts the dead ones, fenced so that a seal prepared from an older read fails.
* Which joiners it judges, and when again (the last section: one test per rule, each failing when the
  line it names is changed).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.lost_replies import LostReplies, txn_puts_key
from helpers.nodes import ETCD_V3, Nodes, lease_of, until_silent

from etcd_rdzv.native import protocol
from etcd_rdzv.native.handler import EtcdV3RendezvousHandler
from etcd_rdzv.native.leases import SEAL_LOOKED, Pace
from etcd_rdzv.native.start import join_value
from etcd_store.client.testing import RpcCounter
from etcd_store.errors import EtcdError

pytestmark = pytest.mark.timeout(120)

TTL = 30  # "heartbeat": far longer than an eviction takes
CONF = {"join_timeout": "60", "last_call_timeout": "6", "close_timeout": "5", "heartbeat": str(TTL),
        "read_timeout": "10"}


class Run(Nodes):
    """etcd-v3 handlers of one run, each with its own client, in threads."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint, ETCD_V3, conf=CONF, name="v3d")


@pytest.fixture
def run(etcd_endpoint: str) -> Iterator[Run]:
    r = Run(etcd_endpoint)
    try:
        yield r
    finally:
        r.close()


def die(handler: EtcdV3RendezvousHandler) -> None:
    """The node's keep-alives stop and nothing is revoked (its process was SIGKILLed)."""
    handler._client.close()


def test_the_sealer_evicts_a_joiner_that_died_before_the_seal(run: Run) -> None:
    """c joins round 1 and dies; a and b join, and the last call (6 s) runs out with c silent for
    longer than its bound (4 s): the sealer evicts it and names a and b only (before: world 3, and
    torch's rank barrier waited on c until read_timeout)."""
    a, b, c = (run.new(2, 4) for _ in range(3))
    dying = run.start(c)
    run.until_joined(1, 1)
    dead_lease = lease_of(c)
    die(c)
    started = time.monotonic()
    res = [f.result(timeout=40) for f in run.start(a, b)]
    took = time.monotonic() - started
    print(f"[dead joiner] round {res[0].round} sealed with {res[0].world_size} in {took:.2f} s (TTL {TTL} s)")
    assert {(r.round, r.world_size) for r in res} == {(1, 2)}
    assert sorted(r.rank for r in res) == [0, 1]
    assert run.client.lease_time_to_live(dead_lease) > 0  # its key was evicted, not expired
    assert run.joined(1) == 2
    with pytest.raises(Exception):  # noqa: B017 - its client is closed: whatever it raised
        dying[0].result(timeout=10)


def test_a_live_joiner_is_not_evicted_before_the_seal(run: Run) -> None:
    """Joiners that renew are named, however long the last call lasted."""
    a, b, c = (run.new(2, 4) for _ in range(3))
    first = run.start(c)
    run.until_joined(1, 1)
    time.sleep(2.0)
    res = [f.result(timeout=40) for f in first + run.start(a, b)]
    assert {(r.round, r.world_size) for r in res} == {(1, 3)}


def test_an_eviction_fences_a_seal_prepared_from_an_older_read(run: Run) -> None:
    """The eviction Txn bumps the join counter, as a withdrawal does: a seal from the read taken
    before it fails its compare, so no seal names an evicted joiner; the Txn answers with a fresh
    read. The victim here is alive: it hears ``ctl/evicted`` name its key and joins again at once, so
    the round is sealed with all three (before: c waited without a key and was left out)."""
    a, b, c = (run.new(2, 4) for _ in range(3))
    waiting = run.start(a, b, c)
    run.until_joined(1, 3)
    keys, client = run.keys, run.client
    meta = protocol.read_meta(client, keys)
    old = protocol.read_round(client, keys, 1)
    victim = next(j for j in old.joiners if j.node_id == c.node_id)
    doomed = [(victim.key, victim.mod_revision, victim.lease, victim.create_revision)]
    out = protocol.evict_joiners(client, keys, 1, meta.sealed, doomed)
    assert out.ok and out.read is not None
    assert [j.node_id for j in out.read.joiners] == [j.node_id for j in old.joiners if j.node_id != c.node_id]
    run_lease = protocol.ensure_run_lease(client, keys, 60)
    assert not protocol.seal(client, keys, 1, meta.sealed, old, run_lease, 4).ok  # fenced
    again = protocol.evict_joiners(client, keys, 1, meta.sealed, doomed)
    assert not again.ok  # a replay fails its compares
    res = [f.result(timeout=20) for f in waiting]
    assert {(r.round, r.world_size) for r in res} == {(1, 3)}
    assert sorted(r.rank for r in res) == [0, 1, 2]
    rejoined = client.get(victim.key)
    assert rejoined is not None and rejoined.create_revision > victim.create_revision


def test_the_sealer_evicts_as_many_joiners_as_it_looks_at_in_one_txn(run: Run) -> None:
    """etcd's default ``--max-txn-ops`` (128) bounds a Txn's compares too. The eviction Txn of
    SEAL_LOOKED victims (1 + 2 x 63 compares) is taken; one more victim is refused. Before,
    SEAL_LOOKED was 64: a sealer whose 64 named joiners were all dead had its eviction refused and
    sealed them all in."""
    keys, client = run.keys, run.client
    meta = protocol.read_meta(client, keys)
    lease = client.lease_grant(TTL)
    for i in range(SEAL_LOOKED + 1):
        client.put(keys.join_prefix(1) + b"dead%03d" % i, b"{}", lease=lease)
    joiners = protocol.read_round(client, keys, 1).joiners
    victims = [(j.key, j.mod_revision, j.lease, j.create_revision) for j in joiners]
    assert len(victims) == SEAL_LOOKED + 1
    with pytest.raises(EtcdError, match="too many operations"):
        protocol.evict_joiners(client, keys, 1, meta.sealed, victims)
    out = protocol.evict_joiners(client, keys, 1, meta.sealed, victims[:SEAL_LOOKED])
    assert out.ok and out.read is not None
    assert [j.key for j in out.read.joiners] == [victims[-1][0]]


def test_a_member_named_dead_is_not_handed_to_the_live_ones(run: Run) -> None:
    """c joins and dies; its pace is slow (a renewal every 9 s), so its eviction bound is long and the
    seal that b's join makes at once (max 3) names it, deterministically. a and b are not handed that
    round: it never starts (c never confirms it), it is voided once c's key goes (its lease expires),
    and a and b re-form round 2 as a group of 2 within the lease TTL and a few seconds. Before the start
    barrier they were handed round 1 of 3, and torch's agents then waited in their rank barrier for c."""
    a, b = run.new(2, 3), run.new(2, 3)
    c = run.new(2, 3, renew_interval="9")
    run.start(c)
    run.until_joined(1, 1)
    die(c)
    died = time.monotonic()
    res = [f.result(timeout=TTL + 30) for f in run.join(a, b)]  # next_rendezvous, as torch's agent calls it
    took = time.monotonic() - died
    assert {r.world_size for r in res} == {2}, f"a and b were handed a world of {res[0].world_size}"
    assert sorted(r.rank for r in res) == [0, 1]
    assert took < TTL + 10, f"re-formed {took:.1f} s after the death"
    voided, started = run.client.get(run.keys.start(1)), run.client.get(run.keys.start(2))
    assert voided is not None and voided.value == b"void"
    assert started is not None and started.value == b"go"


# --------------------------------------------------------------------------- design claims, one test each

#: A sealer renewing every 0.1 s judges a joiner of this pace dead after 3 s of silence as etcd counts it:
#: max(2 x 0.1, 0.1 + 1 + MARGIN, (0.1 + MARGIN) + 0.1 + MARGIN) = 2.2 s, in etcd's whole seconds 3.
FAST = {"renew_interval": "0.1", "last_call_timeout": "0.2"}
DEAD_PACE = Pace(0.1, 1.0)
CONDEMNED = 3


def dead_join(run: Run, name: str, lease: int) -> bytes:
    """A node of pace :data:`DEAD_PACE` joins the open round with ``lease`` (which nobody renews) and dies:
    its join Txn is all it ever sends. Its join key."""
    sealed = protocol.read_meta(run.client, run.keys).sealed
    value = join_value("127.0.0.1", DEAD_PACE.fields())
    assert protocol.join(run.client, run.keys, name, value, lease, sealed).ok
    return bytes(run.keys.join_key(sealed.round + 1, name))


def sealer(run: Run, max_nodes: int, *interceptors: Any) -> EtcdV3RendezvousHandler:
    """A node that forms round 1 alone (so that its own renewals are steady for longer than any joiner
    of round 2 is silent) and then seals round 2 (``min_nodes`` 1)."""
    a: EtcdV3RendezvousHandler = run.intercepted(1, max_nodes, *interceptors, **FAST)
    res = run.start(a)[0].result(timeout=20)
    assert (res.round, res.world_size) == (1, 1)
    return a


def test_the_sealer_evicts_at_most_63_joiners_in_one_txn(run: Run) -> None:
    """Claim (``min(max_nodes, 63)``, SEAL_LOOKED, native/wait.py; design "Dead joiners before the seal"):
    a sealer judges at most 63 joiners per read, so its eviction Txn (one compare on the sealed record and
    two per victim) stays within etcd's default --max-txn-ops (128). 64 dead joiners ahead of a live one
    (max_nodes 65, so a's join makes the round due at once): the first eviction deletes 63 of them in one
    revision, the 64th goes with the next read's, and the round is sealed with the live node alone (with
    64 judged at once, etcd refuses the Txn and the seal names them all)."""
    assert SEAL_LOOKED == 63
    a = sealer(run, SEAL_LOOKED + 2)
    dead = run.client.lease_grant(TTL)
    for i in range(SEAL_LOOKED + 1):
        dead_join(run, f"dead{i:03d}", dead)
    until_silent(run.client, dead, CONDEMNED)
    prefix = run.keys.join_prefix(2)
    with run.client.watch(prefix, prefix=True) as watch:
        res = run.start(a)[0].result(timeout=30)
        deletes: list[Any] = []
        deadline = time.monotonic() + 10.0
        while len(deletes) < SEAL_LOOKED + 1 and time.monotonic() < deadline:
            deletes += [ev for ev in watch.get(timeout=deadline - time.monotonic()) if ev.type == "DELETE"]
    assert (res.round, res.world_size, res.rank) == (2, 1, 0)
    per_txn = Counter(ev.kv.mod_revision for ev in deletes)
    assert [n for _, n in sorted(per_txn.items())] == [SEAL_LOOKED, 1]
    assert run.joined(2) == 1


def test_the_sealer_judges_no_joiner_beyond_max_nodes(run: Run) -> None:
    """Claim (``min(max_nodes, 63)``, native/wait.py): the sealer judges only the joiners it is about to
    name, the first ``max_nodes``. a (max_nodes 1) is about to seal round 2 when a dead node joins behind
    it: a's seal fails on the join, and the read in its answer, which holds the dead joiner beyond
    max_nodes, is sealed naming a alone without a LeaseTimeToLive: the dead key stays (kept out)."""
    counter, lost = RpcCounter(), LostReplies()
    a = sealer(run, 1, counter, lost)
    dead = run.client.lease_grant(TTL)
    until_silent(run.client, dead, CONDEMNED)
    late: list[bytes] = []
    rule = lost.meddle("KV/Txn", txn_puts_key(lambda k: k == run.keys.sealed),
                       lambda: late.append(dead_join(run, "late", dead)))
    counter.reset()
    res = run.start(a)[0].result(timeout=20)
    assert (res.round, res.world_size) == (2, 1)
    assert rule.fired == 1 and late
    assert counter.snapshot().get("Lease/LeaseTimeToLive", 0) == 0
    assert run.client.get(late[0]) is not None  # not evicted, although dead past its bound
    remaining, granted = run.client.lease_ttls(dead)
    assert granted - remaining - 1 >= CONDEMNED


def test_the_sealer_judges_again_the_joiners_of_an_evictions_fresh_read(run: Run) -> None:
    """Claim (native/wait.py, ``RoundWait.try_seal``: a read not judged yet is judged; design "Dead joiners
    before the seal": "a seal from that read judges its joiners again (one that moved into the first 63,
    or arrived since, is judged too)"). A dead joiner is ahead of a (max_nodes 2); another dead node joins
    just before a's eviction Txn. The Txn's answer is a read naming the newcomer: a judges it before
    sealing, evicts it too, and seals round 2 alone (without the second look it would seal it in)."""
    lost = LostReplies()
    a = sealer(run, 2, lost)
    dead = run.client.lease_grant(TTL)
    early = dead_join(run, "early", dead)
    until_silent(run.client, dead, CONDEMNED)
    late: list[bytes] = []
    rule = lost.meddle("KV/Txn", txn_puts_key(lambda k: k == early), lambda: late.append(dead_join(run, "late", dead)))
    res = run.start(a)[0].result(timeout=20)
    assert rule.fired == 1 and late
    assert (res.round, res.world_size) == (2, 1)
    assert run.client.get(early) is None and run.client.get(late[0]) is None
    assert run.client.lease_time_to_live(dead) > 0  # evicted, not expired
