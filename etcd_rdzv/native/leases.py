"""The leases of an ``etcd-v3`` node: its own (:class:`NodeLeases`), the run's, and the dead members
of its old group, whose keys it evicts (:class:`Evictor`).

:class:`NodeLeases` is held by :class:`~etcd_rdzv.native.rounds.Participant` (as etcd's ``Mutex``
holds its ``Session``) and knows nothing of rounds: the node's lease session (granted at the first
join, replaced when etcd reports it gone; it also keeps the run lease alive), the run lease of the
round records (created by the first sealer or closer), whether the node stopped, and the wait's
watch, which it cancels when the lease ends or the node stops (that wakes the waiting node).
Raises :class:`~etcd_rdzv.native.records.NodeShutDown` once stopped (where named) and
``EtcdError`` subclasses. :func:`confirm` is the one wait for etcd to confirm a watch.

**Eviction** (docs/etcd-v3-design.md, "Eviction", has the full argument). A dead member of round
``T`` keeps its join key until its lease expires, and ``T + 1`` waits for it. So an observer (a
member of ``T`` of rank below :data:`OBSERVERS`, waiting in ``T + 1``; never a spare or new node)
looks at the leases of the keys left in ``T`` (one Range, one LeaseTimeToLive each, none while
more than :data:`MAX_LOOKED` are left; every half keep-alive interval, every interval while ``T``
is empty since a re-attach refills it) and deletes a suspect's key (one Txn fenced on its revision
and lease). The rule (:func:`to_evict`, pure): with the member's pace from its join value
(``renew`` ``i_m``, ``failover`` ``a_m``; the observer's own if absent), ``k`` = ``evict_misses``,
``M`` = :data:`MARGIN` and the observer's interval ``i_o``, evict when etcd's leader has not renewed
the member's lease for (:func:`condemned_after`)::

    L_m = max(k * i_m,  i_m + a_m + M,  g + i_m + M),   g = i_o + M

seconds, *and* the observer's own renewals came with no gap over ``g`` (:func:`tolerated`) for at
least as long. The second term covers a live member failing over from a mute etcd member; the
third means a slow etcd (which delays the observer's renewals too) evicts nobody. Etcd errors are
logged and end the look: eviction is an optimisation, the lease expires anyway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeGuard

from etcd_store.client import (
    EtcdClient,
    Session,
    Watch,
    compare_lease,
    compare_mod,
    op_delete,
    prefix_range_end,
    renewing_lease,
)
from etcd_store.client.leases import answer_bound
from etcd_store.client.synced import confirmed
from etcd_store.errors import EtcdError, EtcdTimeoutError

from . import protocol
from .records import NodeShutDown, RunKeys, join_doc
from .settings import V3Settings
from .telemetry import RoundObserver

log = logging.getLogger(__name__)

__all__ = ["MARGIN", "MAX_LOOKED", "OBSERVERS", "SEAL_LOOKED", "Evictor", "Keyed", "MemberLease", "NodeLeases",
           "Pace", "condemned_after", "confirm", "describe", "observes", "own_pace", "pace_in", "silent_for",
           "steady_for", "suspects", "to_evict", "tolerated"]

class NodeLeases:
    """The lease part of one node (see the module docstring).

    ``session`` (None before the first :meth:`ensure` and after :meth:`stop`), ``run_lease`` (None
    while unknown) and ``shut_down`` are read by the participant and the handler. Thread safe:
    :meth:`stop` and a lost lease's callback may run in any thread while the participant waits.
    """

    def __init__(self, settings: V3Settings, client: EtcdClient, keys: RunKeys, node_id: str,
                 observer: RoundObserver) -> None:
        self._settings = settings
        self._client = client
        self._keys = keys
        self._node_id = node_id
        self._observer = observer  # told of lost leases
        self._lock = threading.Lock()
        self.session: Session | None = None  # this node's lease; it also keeps the run lease alive
        self.run_lease: int | None = None
        self.shut_down = False
        self._watch: Watch | None = None  # the wait's watch, cancelled when the lease ends

    # ------------------------------------------------------------------ the node's lease

    def _on_lease_lost(self) -> None:
        """``on_lost`` of this node's lease session: wake a waiting node (its key is gone)."""
        with self._lock:
            watch = self._watch
        if watch is not None:
            watch.cancel()

    def check_not_shut_down(self) -> None:
        """Raises :class:`~etcd_rdzv.native.records.NodeShutDown` after :meth:`stop`."""
        if self.shut_down:
            raise NodeShutDown(f"the handler of node {self._node_id} was shut down")

    def stop(self) -> Session | None:
        """Stop for good: cancel the wait's watch; returns the lease session to close (no RPC)."""
        with self._lock:
            self.shut_down = True
            watch, self._watch = self._watch, None
            session, self.session = self.session, None
        if watch is not None:
            watch.cancel()
        return session

    def ensure(self) -> tuple[int, bool]:
        """This node's lease and whether it is new (keys bound to an ended one are gone). 0-1
        LeaseGrant; raises :class:`~etcd_rdzv.native.records.NodeShutDown` once stopped."""
        with self._lock:
            self.check_not_shut_down()
            session = self.session
            if session is not None and not session.done().is_set():
                return session.id, False
            if session is not None:
                log.warning("node %s lost its lease; joining with a new one", self._node_id)
                self._observer.lease_lost()
            return self._new_session_locked().id, True

    def renew(self) -> Session:
        """A new lease session in place of one etcd no longer holds (closed without a revoke). One
        LeaseGrant; raises :class:`~etcd_rdzv.native.records.NodeShutDown` once stopped."""
        with self._lock:
            self.check_not_shut_down()
            old = self.session
            session = self._new_session_locked()
        if old is not None:
            old.close(revoke=False)  # its lease is gone (our key went with it)
        self._observer.lease_lost()
        return session

    def _new_session_locked(self) -> Session:
        """A new lease session for this node (one LeaseGrant), also keeping the run lease alive."""
        session = self._client.session(self._settings.lease_ttl, on_lost=self._on_lease_lost,
                                       interval=self._settings.renew_every)
        self.session = session
        if self.run_lease is not None:
            session.keep_also(self.run_lease)
        return session

    def forget(self, lease: int) -> None:
        """End the session of a lease etcd no longer knows, so :meth:`ensure` grants a new one (no RPC)."""
        session = self.session
        if session is not None and session.id == lease:
            session.close(revoke=False)

    def drop(self) -> None:
        """The node's key vanished with its lease: end its session (see :meth:`forget`)."""
        session = self.session
        if session is not None:
            self.forget(session.id)

    def revoke(self, session: Session, deadline: float) -> bool:
        """Stop refreshing ``session`` and revoke its lease (one LeaseRevoke bounded by ``deadline``);
        whether etcd confirmed it or the lease had ended. Never raises for etcd failures."""
        session.close(revoke=False)  # stop refreshing; the revoke below says whether it worked
        remaining = deadline - time.monotonic()
        if remaining <= 0 or session.gone_at_etcd:  # (a lost presumed from silence is revoked all the same)
            return session.gone_at_etcd
        try:
            self._client.lease_revoke(session.id, timeout=remaining)
        except EtcdError as e:
            log.info("node %s could not revoke its lease %x: %s", self._node_id, session.id, e)
            return False
        return True

    # ------------------------------------------------------------------ the wait's watch

    def hold_watch(self, watch: Watch) -> Session | None:
        """Make ``watch`` the one :meth:`stop` and a lost lease cancel; returns the lease session it waits
        under. If the lease ended, ``watch`` is cancelled and None returned; once stopped, it is
        cancelled and :class:`~etcd_rdzv.native.records.NodeShutDown` raised."""
        with self._lock:
            session = self.session
            if self.shut_down or session is None or session.done().is_set():
                watch.cancel()
                self.check_not_shut_down()
                return None
            self._watch = watch
            return session

    def swap_watch(self, old: Watch, new: Watch, session: Session) -> None:
        """Hold ``new`` in place of ``old`` (cancelled); ``new`` is cancelled too if the node stopped or
        ``session`` ended meanwhile."""
        with self._lock:
            if self._watch is old:
                self._watch = new
            stale = self.shut_down or session.done().is_set()
        old.cancel()
        if stale:
            new.cancel()

    def release_watch(self, watch: Watch) -> None:
        """The wait on ``watch`` ended: cancel it and hold it no more."""
        with self._lock:
            if self._watch is watch:
                self._watch = None
        watch.cancel()

    # ------------------------------------------------------------------ the run lease

    def adopt_run_lease(self, lease: int | None) -> None:
        """The run lease a sealed record names: keep it alive with this node's lease."""
        if lease is not None and lease != self.run_lease:
            self.run_lease = lease
            session = self.session
            if session is not None:
                session.keep_also(lease)

    def run_lease_or_create(self, timeout: float | None = None) -> int:
        """The run lease, created if not known (sealers and closers only): 0-2 RPCs."""
        if self.run_lease is not None:
            return self.run_lease
        lease = protocol.ensure_run_lease(self._client, self._keys, self._settings.state_ttl, timeout=timeout)
        self.adopt_run_lease(lease)
        return lease

    def forget_run_lease(self, lease: int) -> None:
        """The run lease expired (``run`` went with it): the next use creates a new one."""
        if self.run_lease == lease:
            self.run_lease = None

    def close_run(self, deadline: float, *, abort: bool = False) -> None:
        """Close the run (:func:`protocol.close`), or with ``abort`` also stop every agent
        (:func:`protocol.abort`). Every RPC bounded by ``deadline``: raises ``EtcdTimeoutError`` when it
        passes, other ``EtcdError`` subclasses when etcd fails."""
        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EtcdTimeoutError(f"close_timeout={self._settings.close_timeout:g} s passed")
            return remaining

        def close(lease: int) -> bool:
            if abort:
                out = protocol.abort(self._client, self._keys, lease, timeout=left())
                return out.closed or out.aborted
            return protocol.close(self._client, self._keys, lease, timeout=left())

        if renewing_lease(close, lambda: self.run_lease_or_create(left()), self.forget_run_lease,
                          renewals=1):
            log.info("node %s %s the rendezvous %r", self._node_id, "aborted" if abort else "closed",
                     self._settings.run_id)


def confirm(client: EtcdClient, watch: Watch, node_id: str, *, before_join: bool = False) -> None:
    """Wait for etcd to confirm ``watch`` (:func:`~etcd_store.client.synced.confirmed`): raises
    ``WatchNotConfirmed`` (an ``EtcdTimeoutError``) after the client's timeout, or the error of a watch
    that failed first. With ``before_join`` one look at what it delivered also catches a refusal in the
    confirming answer itself (e.g. no read permission: "created" and cancelled at once); a later
    failure raises from the wait, which then withdraws the join."""
    confirmed(watch, client.timeout, f"the watch of node {node_id} (etcd at {client.describe()})")
    if before_join:
        watch.get(timeout=0)


# --------------------------------------------------------------------------- eviction

OBSERVERS = 4
"""The members of ranks ``0 .. OBSERVERS - 1`` of a failed group look for dead members."""

MAX_LOOKED = 16
"""A look reads the leases of at most this many keys left in the previous round (else none)."""

SEAL_LOOKED = 63
"""A sealer reads the leases of at most this many joiners it is about to name (the first in rank
order; a larger round's dead are found after the seal). 63 keeps the eviction Txn within etcd's
default ``--max-txn-ops`` (128): one compare on the sealed record plus two per victim."""


MARGIN = 1.0
"""Seconds of slack on both sides of the rule: what a healthy member's renewal may take beyond its
failover bound (a reconnect, up to 1 s to a member that is not ready; the forward to the leader;
the leader holding a renewal until it applied every committed entry, about 1 s under a write
burst; scheduling), and how late a healthy observer's own renewal answers may come."""


@dataclass(frozen=True)
class Pace:
    """How a node renews its lease: every ``renew`` seconds; its stream moves to another etcd member after
    hearing nothing for ``failover`` seconds."""

    renew: float
    failover: float

    def fields(self) -> dict[str, float]:
        """What the join value carries (:func:`pace_in` reads it back)."""
        return {"renew": round(self.renew, 3), "failover": round(self.failover, 3)}


def own_pace(settings: V3Settings, first_attempt: float) -> Pace:
    """This node's :class:`Pace`: ``renew_every`` and the client's answer bound for a third of
    ``lease_ttl`` (an upper bound: a shorter lease on the stream only shortens it)."""
    return Pace(settings.renew_every, answer_bound(settings.lease_ttl / 3.0, first_attempt))


def pace_in(value: bytes, default: Pace) -> Pace:
    """The :class:`Pace` a join value names; ``default`` (the observer's) if it names none or is malformed."""
    doc = join_doc(value)
    renew, failover = doc.get("renew"), doc.get("failover")
    if _seconds(renew) and _seconds(failover):
        return Pace(float(renew), float(failover))
    return default


def _seconds(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e6


def tolerated(own: Pace) -> float:
    """The longest gap between its own renewal answers after which the observer still counts itself
    steady: its interval plus :data:`MARGIN`."""
    return own.renew + MARGIN


def condemned_after(member: Pace, own: Pace, misses: int) -> float:
    """The silence that condemns a member of pace ``member``: ``L_m`` of the module docstring."""
    return max(misses * member.renew, member.renew + member.failover + MARGIN,
               tolerated(own) + member.renew + MARGIN)


def observes(settings: V3Settings, rank: int) -> bool:
    """Whether the member of ``rank`` in a failed group looks for dead members of it."""
    return settings.evict_misses > 0 and rank < OBSERVERS


@dataclass(frozen=True)
class MemberLease:
    """A join key left in the previous round and its lease as etcd's leader reported it:
    ``remaining`` whole seconds (-1: gone), ``granted`` TTL, ``pace`` from its join value."""

    key: bytes
    mod_revision: int
    lease: int
    remaining: int
    granted: int
    pace: Pace | None = None  # from its join value; None: the observer's own


def silent_for(member: MemberLease) -> float:
    """A lower bound of the seconds since etcd last renewed ``member``'s lease; negative right after a
    renewal or a leader change (a new leader extends every lease)."""
    return float(member.granted - member.remaining - 1)


def steady_for(renewed_at: Sequence[float], now: float, limit: float) -> float:
    """How long the observer's own renewals (answer times, oldest first) came with no gap over
    ``limit``, the last at most ``limit`` ago; 0 otherwise."""
    if not renewed_at or now - renewed_at[-1] > limit:
        return 0.0
    start = renewed_at[-1]
    for earlier in reversed(renewed_at[:-1]):
        if start - earlier > limit:
            break
        start = earlier
    return now - start


def to_evict(members: Sequence[MemberLease], renewed_at: Sequence[float], now: float, own: Pace,
             misses: int, read_for: float = 0.0) -> list[MemberLease]:
    """The members to evict by the module docstring's rule (none when ``misses`` is 0). ``read_for``: the
    seconds the lease reads took, ending at ``now`` (the silence was counted within them)."""
    if misses <= 0:
        return []
    steady = steady_for(renewed_at, now, tolerated(own))
    if steady <= 0.0:
        return []
    return [m for m in members
            if m.remaining >= 0
            and condemned_after(m.pace or own, own, misses) <= silent_for(m) <= steady - read_for]


class Keyed(Protocol):
    """A join key as a read found it: an etcd ``KeyValue`` or a :class:`~etcd_rdzv.native.records.Joiner`."""

    @property
    def key(self) -> bytes: ...

    @property
    def mod_revision(self) -> int: ...

    @property
    def lease(self) -> int: ...

    @property
    def value(self) -> bytes: ...


LOOKS_AT_ONCE = 16
"""LeaseTimeToLive calls one look keeps in flight (a sealer names at most :data:`SEAL_LOOKED` joiners)."""


def suspects(client: EtcdClient, kvs: Sequence[Keyed], session: Session, own: Pace,
             misses: int) -> tuple[tuple[float, ...], float, list[MemberLease]]:
    """One look at the leases of ``kvs`` (one LeaseTimeToLive each; none for our own lease or none) and
    :func:`to_evict`'s verdict: ``(renewed_at, now, condemned)``. The reads go out side by side
    (:data:`LOOKS_AT_ONCE` in flight): the look costs about one round trip, not one per joiner, which
    keeps the window between a sealer's read and its seal short. Our renewals are read after the lease
    reads (etcd must still be answering us). Raises ``EtcdError`` subclasses."""
    started = time.monotonic()
    looked = [kv for kv in kvs if kv.lease and kv.lease != session.id]
    if len(looked) > 1:
        with ThreadPoolExecutor(min(len(looked), LOOKS_AT_ONCE), thread_name_prefix="lease-look") as pool:
            ttls = list(pool.map(lambda kv: client.lease_ttls(kv.lease), looked))
    else:
        ttls = [client.lease_ttls(kv.lease) for kv in looked]
    members = [MemberLease(kv.key, kv.mod_revision, kv.lease, *ttl, pace=pace_in(kv.value, own))
               for kv, ttl in zip(looked, ttls, strict=True)]
    now = time.monotonic()
    renewed = session.renewed_at()
    return renewed, now, to_evict(members, renewed, now, own, misses, now - started)


def describe(member: MemberLease, own: Pace, misses: int, renewed: Sequence[float], now: float) -> str:
    """Why ``member`` is condemned, for the log: its silence, its bound, the observer's steadiness."""
    pace = member.pace or own
    return (f"etcd has not renewed its lease {member.lease:x} for {silent_for(member):.0f} s or more (its "
            f"bound: {condemned_after(pace, own, misses):.1f} s at a renewal every {pace.renew:.1f} s, "
            f"failover {pace.failover:.1f} s; ours: renewed steadily for "
            f"{steady_for(renewed, now, tolerated(own)):.1f} s)")


class Evictor:
    """The evictions of one wait in ``round_`` by a member of ``round_ - 1``; ``session`` is its own."""

    def __init__(self, settings: V3Settings, client: EtcdClient, keys: RunKeys, round_: int,
                 session: Session) -> None:
        self._settings = settings
        self._own = own_pace(settings, client.retry_policy.first_attempt)
        self._client = client
        self._keys = keys
        self._round = round_
        self._session = session
        self._period = settings.renew_every / 2.0
        self._next = 0.0  # the first look is at once
        self.evicted: list[bytes] = []

    def poll(self, timeout: float | None) -> float | None:
        """Look and evict if a look is due; returns ``timeout`` (None: none) shortened to the next look
        (half an interval, or one while the round is empty: a re-attached member may die after all)."""
        now = time.monotonic()
        if now >= self._next:
            empty = self._look()
            now = time.monotonic()
            self._next = now + (self._settings.renew_every if empty else self._period)
        wait = self._next - now
        return wait if timeout is None else min(timeout, wait)

    def _look(self) -> bool:
        """One look (see the module docstring); whether the previous round was empty."""
        client = self._client
        prefix = self._keys.join_prefix(self._round - 1)
        try:
            kvs = client.range(prefix, prefix_range_end(prefix), limit=MAX_LOOKED + 1).kvs
            if not kvs or len(kvs) > MAX_LOOKED:
                return not kvs
            renewed, now, condemned = suspects(client, kvs, self._session, self._own, self._settings.evict_misses)
            for member in condemned:
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
        log.warning("round %d: %s %s: %s", self._round, "evicted" if res.succeeded else "could not evict",
                    member.key.decode(errors="replace"),
                    describe(member, self._own, self._settings.evict_misses, renewed, now))
