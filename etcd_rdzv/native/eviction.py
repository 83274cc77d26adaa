"""Suspicion-based eviction: a survivor of a failed group removes a member that is dead, in seconds.

A member of round ``T`` that calls ``next_rendezvous`` (its group failed: a worker failed, or
``num_nodes_waiting()`` said so) joins ``T + 1``, leaving ``T`` in the same transaction.
A member that died without leaving still holds its join key in ``T`` until its lease expires
(``lease_ttl``, 15 s by default), and until then ``T + 1`` waits for it. While a survivor waits
in ``T + 1`` it looks at the leases of the keys left in ``T`` (one Range, one LeaseTimeToLive
each, every half keep-alive interval, until ``T`` is empty) and deletes the join key of a member
whose lease is **suspect** (one Txn fenced on that key's revision and lease). The rule, its
false-positive bound and why it is safe are in docs/etcd-v3-design.md ("Eviction").

**The rule** (:func:`to_evict`, pure): with ``i`` the keep-alive interval and ``k`` the misses
(``evict_misses``), a member is evicted when etcd's leader counts at least ``k * i`` seconds
since it last renewed the member's lease (``granted - remaining - 1``: ``remaining`` is in
whole seconds), *and* the observer's own lease has been renewed without a gap over ``k * i``
for at least that long, up to a renewal less than ``k * i`` ago. If etcd, not the member, is
slow, the observer's own renewals are late too and nobody is evicted; after an etcd outage
the observer evicts nobody who went silent before it could renew again.

Only a member of ``T`` evicts (:class:`Evictor` is made for one that was): a node waiting
outside a running group (a spare, a new node) never removes members of that group. So that a
large group re-forming costs etcd little, only the members of ranks below :data:`OBSERVERS` in
``T`` look (:func:`observes`), and a look reads no lease while more than :data:`MAX_LOOKED`
keys are left in ``T`` (live members are still leaving; if that many died, their leases expire).

Blocks: :meth:`Evictor.poll` makes at most one Range, one LeaseTimeToLive per key left in the
previous round and one Txn per eviction, each bounded by the client's timeout; etcd errors
are logged and end the look (eviction is an optimisation: the lease expires anyway).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from etcd_store.client import EtcdClient, Session, compare_lease, compare_mod, op_delete, prefix_range_end
from etcd_store.errors import EtcdError

from .keys import RunKeys
from .settings import V3Settings

log = logging.getLogger(__name__)

__all__ = ["MAX_LOOKED", "OBSERVERS", "Evictor", "MemberLease", "observes", "silent_for", "steady_for", "to_evict"]

OBSERVERS = 4
"""The members of ranks ``0 .. OBSERVERS - 1`` of a failed group look for dead members."""

MAX_LOOKED = 16
"""A look reads the leases of at most this many keys left in the previous round (else none)."""


def observes(settings: V3Settings, rank: int) -> bool:
    """Whether the member of ``rank`` in a failed group looks for dead members of it."""
    return settings.evict_misses > 0 and rank < OBSERVERS


@dataclass(frozen=True)
class MemberLease:
    """A join key left in the previous round and its lease as etcd's leader reported it:
    ``remaining`` whole seconds (-1: gone), ``granted`` its TTL."""

    key: bytes
    mod_revision: int
    lease: int
    remaining: int
    granted: int


def silent_for(member: MemberLease) -> float:
    """A lower bound of the seconds since etcd last renewed ``member``'s lease (its TTL minus
    what is left, minus 1 for the whole seconds etcd reports); negative right after a renewal
    or a leader change (a new leader extends every lease)."""
    return float(member.granted - member.remaining - 1)


def steady_for(renewed_at: Sequence[float], now: float, limit: float) -> float:
    """How long the observer's own renewals (answer times, oldest first) have come with no gap
    over ``limit`` seconds, the last one at most ``limit`` ago; 0 when the last one is older."""
    if not renewed_at or now - renewed_at[-1] > limit:
        return 0.0
    start = renewed_at[-1]
    for earlier in reversed(renewed_at[:-1]):
        if start - earlier > limit:
            break
        start = earlier
    return now - start


def to_evict(members: Sequence[MemberLease], renewed_at: Sequence[float], now: float, interval: float,
             misses: int, read_for: float = 0.0) -> list[MemberLease]:
    """The members to evict (see the module docstring): none when ``misses`` is 0 or the
    observer's own renewals are late at ``now``; else those whose lease etcd has not renewed for
    at least ``misses * interval`` seconds, while the observer's were renewed steadily for as long
    (plus ``read_for``, the seconds the reads took that ended just before ``now``: the silence
    was counted at some moment within them)."""
    if misses <= 0:
        return []
    limit = misses * interval
    steady = steady_for(renewed_at, now, limit)
    if steady <= 0.0:
        return []
    return [m for m in members if m.remaining >= 0 and limit <= silent_for(m) <= steady - read_for]


class Evictor:
    """The evictions of one wait in ``round_`` by a member of ``round_ - 1`` (see the module
    docstring); ``session`` is the observer's own lease session."""

    def __init__(self, settings: V3Settings, client: EtcdClient, keys: RunKeys, round_: int,
                 session: Session) -> None:
        self._settings = settings
        self._client = client
        self._keys = keys
        self._round = round_
        self._session = session
        self._period = settings.renew_every / 2.0
        self._next = 0.0  # the first look is at once
        self.evicted: list[bytes] = []

    def poll(self, timeout: float | None) -> float | None:
        """Look at the previous round's leases if a look is due, and evict; returns ``timeout``
        (seconds, None: none) shortened to the next look (unchanged once the round was empty)."""
        now = time.monotonic()
        if now >= self._next:
            empty = self._look()
            now = time.monotonic()
            self._next = float("inf") if empty else now + self._period
        if self._next == float("inf"):
            return timeout
        wait = self._next - now
        return wait if timeout is None else min(timeout, wait)

    def _look(self) -> bool:
        """One look (see the module docstring); whether the previous round was empty."""
        client, s = self._client, self._settings
        prefix = self._keys.join_prefix(self._round - 1)
        try:
            kvs = client.range(prefix, prefix_range_end(prefix), limit=MAX_LOOKED + 1).kvs
            if not kvs or len(kvs) > MAX_LOOKED:
                return not kvs
            started = time.monotonic()
            members = [MemberLease(kv.key, kv.mod_revision, kv.lease, *client.lease_ttls(kv.lease))
                       for kv in kvs if kv.lease and kv.lease != self._session.id]
            now = time.monotonic()
            renewed = self._session.renewed_at()  # after the reads: etcd must still be answering us
            for member in to_evict(members, renewed, now, s.renew_every, s.evict_misses, now - started):
                self._evict(member, renewed, now)
        except EtcdError as e:
            log.info("round %d: could not look at the leases of round %d: %s", self._round, self._round - 1, e)
        return False

    def _evict(self, member: MemberLease, renewed: Sequence[float], now: float) -> None:
        """Delete ``member``'s join key unless it changed since we read it (one Txn)."""
        res = self._client.txn(
            [compare_mod(member.key, "==", member.mod_revision), compare_lease(member.key, "==", member.lease)],
            [op_delete(member.key)],
        )
        if res.succeeded:
            self.evicted.append(member.key)
        limit = self._settings.evict_misses * self._settings.renew_every
        log.warning("round %d: %s %s: etcd has not renewed its lease %x for %.0f s or more (ours: "
                    "renewed steadily for %.1f s)", self._round, "evicted" if res.succeeded else "could not evict",
                    member.key.decode(errors="replace"), member.lease, silent_for(member),
                    steady_for(renewed, now, limit))
