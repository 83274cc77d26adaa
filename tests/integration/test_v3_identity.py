"""Identity by etcd: a live etcd-v3 node never acts on a membership etcd no longer backs (real etcd).

A joiner whose lease is fine can still lose its key before the seal: a sealer that heard no renewal of
it within its eviction bound (a stall of a few seconds on its path to etcd) evicts it. Each scenario
below failed before ``ctl/evicted``, the create-revision fence of the compact membership record and the
start barrier's own-ack rule (docs/etcd-v3-design.md, "Identity by etcd"):

* the evicted node was never told: it waited without a key, and after the last node out deleted
  ``seq/`` and two newcomers sealed round 1 with the compact record, it read its old sequence number
  into that record and took rank 0 beside the newcomer of rank 0;
* with ``min_nodes`` 2, the eviction left the other joiner alone below ``min_nodes``: both live nodes
  waited out ``join_timeout`` and raised ``RendezvousTimeoutError``.

The eviction is the sealer's own Txn (:func:`protocol.evict_joiners`), sent by the test at the moment a
sealer reaching its last call would have sent it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.lost_replies import LostReplies, txn_puts_key
from helpers.nodes import ETCD_V3, Nodes

from etcd_rdzv.native import protocol

pytestmark = [pytest.mark.timeout(120), pytest.mark.etcd_matrix("3.4")]

CONF = {"join_timeout": "60", "last_call_timeout": "3", "close_timeout": "5", "heartbeat": "30",
        "read_timeout": "10"}


class Run(Nodes):
    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint, ETCD_V3, conf=CONF, name="v3id")

    def evict(self, handler: Any, round_: int = 1) -> None:
        """The sealer's eviction Txn on ``handler``'s join key of ``round_`` (the node is alive)."""
        meta = protocol.read_meta(self.client, self.keys)
        read = protocol.read_round(self.client, self.keys, round_)
        [victim] = [j for j in read.joiners if j.node_id == handler.node_id]
        out = protocol.evict_joiners(self.client, self.keys, round_, meta.sealed,
                                     [(victim.key, victim.mod_revision, victim.lease, victim.create_revision)])
        assert out.ok

    def until_fate(self, round_: int, timeout: float) -> None:
        """Return once ``round_``'s start is decided, or after ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.client.get(self.keys.start(round_)) is None and time.monotonic() < deadline:
            time.sleep(0.02)


@pytest.fixture
def run(etcd_endpoint: str) -> Iterator[Run]:
    r = Run(etcd_endpoint)
    try:
        yield r
    finally:
        r.close()


def _held_acks(run: Run) -> LostReplies:
    """An interceptor that holds the node's ack of round 1 until round 1's fate is decided (at most 5 s):
    the order in which a node that believed itself a member met the others' go."""
    held = LostReplies()
    held.meddle("KV/Txn", txn_puts_key(lambda key: key.startswith(run.keys.acks_prefix(1))),
                lambda: run.until_fate(1, 5.0))
    return held


def _evicted_then_last_out_then_newcomers(run: Run, a: Any) -> tuple[list[Any], list[Any]]:
    """a waits in round 1 and is evicted alive; the last node out deletes ``seq/``; c and d join."""
    first = run.join(a)
    run.until_joined(1, 1)
    run.evict(a)
    protocol.remove_round_records_if_idle(run.client, run.keys)
    c, d = run.new(2, 3), run.new(2, 3)
    return first, [c, d]


def test_an_evicted_live_joiner_is_told_and_joins_again(run: Run) -> None:
    """a hears ``ctl/evicted`` name its key and joins again at once: a, c and d form one group of 3
    with distinct ranks (before: a and c both got rank 0 of a round of 2)."""
    a = run.intercepted(2, 3, _held_acks(run))
    first, (c, d) = _evicted_then_last_out_then_newcomers(run, a)
    infos = [f.result(timeout=30) for f in first + run.join(c, d)]
    assert sorted(i.rank for i in infos) == [0, 1, 2], [(i.rank, i.world_size) for i in infos]
    assert {i.world_size for i in infos} == {3}


def test_a_joiner_that_never_hears_its_eviction_takes_no_rank_in_a_round_that_does_not_name_it(
        run: Run) -> None:
    """a never hears ``ctl/evicted`` (its key names are those of a node that does not know the record:
    it watches the range, but an event on that key means nothing to it): c and d seal round 1 with the compact
    record while a still holds sequence number 1 of the deleted ``seq/1``. a is no member (its create
    revision is older than the record's first), joins round 2, and c and d, asked again as torch's
    agents would (a waits), form round 2 with it. Before: a returned rank 0 of round 1 beside c."""
    keys = run.keys
    a = run.intercepted(2, 3, _held_acks(run))
    a._keys.__dict__["evicted"] = keys.ctl + b"not-heard"  # RunKeys.evicted is a cached_property
    first, (c, d) = _evicted_then_last_out_then_newcomers(run, a)
    round1 = [f.result(timeout=30) for f in run.join(c, d)]
    assert sorted(i.rank for i in round1) == [0, 1] and {i.world_size for i in round1} == {2}
    sealed = protocol.read_meta(run.client, keys).sealed
    assert sealed.membership is not None and sealed.membership.joins == 2  # the compact record
    assert not first[0].done() or first[0].result().world_size != 2, "a was handed round 1"
    run.until_joined(2, 1)
    assert c.num_nodes_waiting() == 1 and d.num_nodes_waiting() == 1
    infos = [f.result(timeout=30) for f in first + run.join(c, d)]
    assert sorted(i.rank for i in infos) == [0, 1, 2] and {i.world_size for i in infos} == {3}
    assert set(run.members(protocol.read_meta(run.client, keys).sealed.round)) == {
        a.node_id, c.node_id, d.node_id}


def test_an_evicted_joiner_and_the_one_left_below_min_nodes_form_a_group(run: Run) -> None:
    """min 2, max 3: a and b join, a is evicted alive, b is left alone below ``min_nodes``. a joins
    again at once and the two form a group within the last call (3 s) and a few seconds. Before, nothing
    told a: both waited out ``join_timeout`` (20 s here) and raised RendezvousTimeoutError."""
    a, b = run.new(2, 3, join_timeout="20"), run.new(2, 3, join_timeout="20")
    futures = run.start(a, b)
    run.until_joined(1, 2)
    evicted = time.monotonic()
    run.evict(a)
    res = [f.result(timeout=15) for f in futures]
    took = time.monotonic() - evicted
    assert {(r.round, r.world_size) for r in res} == {(1, 2)}
    assert sorted(r.rank for r in res) == [0, 1]
    assert took < 10, f"formed {took:.1f} s after the eviction"
