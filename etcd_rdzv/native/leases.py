"""The leases of an ``etcd-v3`` node: its own (:class:`NodeLeases`), the run's, and the
dead members of its old group, whose keys it evicts (:class:`Evictor`).

:class:`NodeLeases` is an object that :class:`~etcd_rdzv.native.rounds.Participant`
holds and calls (as etcd's ``Mutex`` holds its ``Session``); it knows nothing of
rounds. It keeps the node's lease :class:`~etcd_store.client.Session` (granted at the
first join, replaced when etcd reports it gone; it also keeps the run lease alive),
the run lease that holds the round records (created by the first sealer or closer),
whether the node was stopped for good, and the watch of the wait in progress, which
it cancels when the lease ends or the node stops (that wakes the waiting node).
:meth:`NodeLeases.close_run` closes the run (or aborts it: also stops the members
that run).

Blocks: :meth:`~NodeLeases.close_run` and :meth:`~NodeLeases.revoke` at most until
their deadline; the others make at most the RPCs their docstrings name. Raises
:class:`~etcd_rdzv.native.records.NodeShutDown` once stopped (where named) and
:class:`~etcd_store.errors.EtcdError` subclasses when etcd fails.

:func:`confirm` is the one wait for etcd to confirm a watch before the node relies on it
(the join's control watch, the wait's, the start's).

**Eviction.** A member of round ``T`` that calls ``next_rendezvous`` (its group failed: a worker failed, or
``num_nodes_waiting()`` said so) joins ``T + 1``, leaving ``T`` in the same transaction.
A member that died without leaving still holds its join key in ``T`` until its lease expires
(``lease_ttl``, 15 s by default), and until then ``T + 1`` waits for it. While a survivor waits
in ``T + 1`` it looks at the leases of the keys left in ``T`` (one Range, one LeaseTimeToLive
each, every half keep-alive interval; every interval while ``T`` is empty, since a member that
re-attaches refills it) and deletes the join key of a member
whose lease is **suspect** (one Txn fenced on that key's revision and lease). The rule, its
false-positive bound and why it is safe are in docs/etcd-v3-design.md ("Eviction").

**The rule** (:func:`to_evict`, pure): each member says in its join value how often it renews
(``renew``: ``i_m``) and how long its client's keep-alive stream may hear nothing before it
moves to another etcd member (``failover``: ``a_m``, :func:`~etcd_store.client.leases.answer_bound`);
a value without them (an older version) is taken to carry the observer's own. With ``k`` the
misses (``evict_misses``), :data:`MARGIN` ``M`` and the observer's own pace ``i_o``, a member is
evicted when etcd's leader counts at least (:func:`condemned_after`)::

    L_m = max(k * i_m,  i_m + a_m + M,  g + i_m + M),   g = i_o + M

seconds since it last renewed the member's lease (``granted - remaining - 1``: ``remaining`` is
in whole seconds), *and* the observer's own renewals were answered with no gap over ``g`` (the
silence it tolerates in itself, :func:`tolerated`) for at least that long, the last one at most
``g`` ago. A live member whose stream sits on an etcd member that stopped answering is silent
for up to ``i_m + a_m`` (its last renewal, the next one unanswered, the move) plus the
reconnect: the second term. If etcd, not the member, is slow by ``D``, the member is silent at
most ``D + i_m`` and the observer's own renewals see a gap of at least ``D``: the third term
keeps ``M`` between the two, so nobody is evicted; after an etcd outage the observer evicts
nobody who went silent before it could renew again.

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
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

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
from .records import NodeShutDown, RunKeys, load_json
from .settings import V3Settings
from .telemetry import RoundObserver

log = logging.getLogger(__name__)

__all__ = ["MARGIN", "MAX_LOOKED", "OBSERVERS", "SEAL_LOOKED", "Evictor", "Keyed", "MemberLease", "NodeLeases",
           "Pace", "condemned_after", "confirm", "describe", "observes", "own_pace", "pace_in", "silent_for",
           "steady_for", "suspects", "to_evict", "tolerated"]

class NodeLeases:
    """The lease part of one node of the run (see the module docstring).

    ``session`` (this node's lease; None before the first :meth:`ensure` and after
    :meth:`stop`), ``run_lease`` (None while not known) and ``shut_down`` are read by
    the participant and the handler. Thread safe: :meth:`stop` and a lost lease's
    callback may run in any thread while the participant waits.
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
        """This node's lease and whether it is new (a new session if there is none or it
        ended: keys bound to an old lease are gone). 0-1 LeaseGrant; raises
        :class:`~etcd_rdzv.native.records.NodeShutDown` once stopped."""
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
        """A new lease session in place of the current one, whose lease etcd no longer holds
        (closed without a revoke). One LeaseGrant; raises
        :class:`~etcd_rdzv.native.records.NodeShutDown` once stopped."""
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
        """End the session of a lease etcd no longer knows, so the next :meth:`ensure` grants
        a new one (no RPC)."""
        session = self.session
        if session is not None and session.id == lease:
            session.close(revoke=False)

    def drop(self) -> None:
        """The node's key vanished with its lease: end its session (see :meth:`forget`)."""
        session = self.session
        if session is not None:
            self.forget(session.id)

    def revoke(self, session: Session, deadline: float) -> bool:
        """Stop refreshing ``session`` (from :meth:`stop`) and revoke its lease (one
        LeaseRevoke bounded by ``deadline``); whether etcd confirmed it, or the lease had
        ended already. Never raises for etcd failures."""
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
        """Make ``watch`` the one :meth:`stop` and a lost lease cancel; the lease it waits
        under. If the lease ended already, ``watch`` is cancelled and None returned; once
        stopped, it is cancelled and :class:`~etcd_rdzv.native.records.NodeShutDown` raised."""
        with self._lock:
            session = self.session
            if self.shut_down or session is None or session.done().is_set():
                watch.cancel()
                self.check_not_shut_down()
                return None
            self._watch = watch
            return session

    def swap_watch(self, old: Watch, new: Watch, session: Session) -> None:
        """Hold ``new`` in place of ``old`` (cancelled); ``new`` is cancelled too if the node
        stopped or ``session`` ended meanwhile (the wait then ends as a cancelled watch ends it)."""
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
        """Close the run (:func:`protocol.close`: no new round; members that run keep running),
        or with ``abort`` also stop every agent now (:func:`protocol.abort`). Every RPC
        bounded by ``deadline``: raises ``EtcdTimeoutError`` when it passes, other
        ``EtcdError`` subclasses when etcd fails."""
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
    """Wait for etcd to confirm ``watch``, by the client's rule
    (:func:`~etcd_store.client.synced.confirmed`): ``WatchNotConfirmed`` (an
    ``EtcdTimeoutError``) after the client's timeout; a watch that failed before etcd
    confirmed it raises its error here. With ``before_join`` (the
    control watch, opened before the join), one look at what it delivered so far also
    catches a refusal in the confirming answer itself (etcd refuses a watch, for instance
    without read permission, with a "created" answer that also cancels it): its events
    so far precede the join, and the view would skip them anyway. A failure that comes
    later still raises from the wait, which then withdraws the join.
    """
    confirmed(watch, client.timeout, f"the watch of node {node_id} (etcd at {client.describe()})")
    if before_join:
        watch.get(timeout=0)


# --------------------------------------------------------------------------- eviction

OBSERVERS = 4
"""The members of ranks ``0 .. OBSERVERS - 1`` of a failed group look for dead members."""

MAX_LOOKED = 16
"""A look reads the leases of at most this many keys left in the previous round (else none)."""

SEAL_LOOKED = 63
"""A sealer reads the leases of at most this many of the joiners it is about to name (the first
ones in rank order): a larger round's dead joiners are found after the seal instead. 63 keeps the
eviction Txn within etcd's default ``--max-txn-ops`` (128), which bounds its compares too: one on
the sealed record plus two per victim (:func:`~etcd_rdzv.native.protocol.evict_joiners`)."""


MARGIN = 1.0
"""Seconds of slack on both sides of the rule (:func:`condemned_after`, :func:`tolerated`): what
a healthy member's renewal may take beyond its own failover bound (the reconnect to a ready
etcd member, milliseconds, but up to 1 s when the client waits for a member that is not ready;
the renewal's forward to the leader; the leader's hold of a renewal until it has applied every
committed entry, up to about 1 s under a burst of writes; the host's scheduling), and what a
healthy observer's own renewal answers may come later than its interval."""


@dataclass(frozen=True)
class Pace:
    """How a node renews its lease: every ``renew`` seconds, and its keep-alive stream moves to
    another etcd member after hearing nothing for ``failover`` seconds (its answer bound)."""

    renew: float
    failover: float

    def fields(self) -> dict[str, float]:
        """What the join value carries (:func:`pace_in` reads it back)."""
        return {"renew": round(self.renew, 3), "failover": round(self.failover, 3)}


def own_pace(settings: V3Settings, first_attempt: float) -> Pace:
    """This node's :class:`Pace`: ``renew_every``, and its client's answer bound for a lease of
    ``lease_ttl`` (:func:`~etcd_store.client.leases.answer_bound` of a third of the TTL and the
    client's ``first_attempt``: an upper bound, since a shorter lease on the stream only shortens it)."""
    return Pace(settings.renew_every, answer_bound(settings.lease_ttl / 3.0, first_attempt))


def pace_in(value: bytes, default: Pace) -> Pace:
    """The :class:`Pace` a join value names; ``default`` (the observer's own) for a value without
    one (written by an older version) or a malformed one."""
    try:
        doc = load_json(value)
    except ValueError:
        return default
    if not isinstance(doc, dict):
        return default
    renew, failover = doc.get("renew"), doc.get("failover")
    if not (_seconds(renew) and _seconds(failover)):
        return default
    assert isinstance(renew, (int, float)) and isinstance(failover, (int, float))
    return Pace(float(renew), float(failover))


def _seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e6


def tolerated(own: Pace) -> float:
    """The longest gap between two of its own renewal answers after which the observer still
    counts itself steady: its interval plus :data:`MARGIN` (a healthy stream answers each renewal
    within milliseconds; etcd's leader may hold one up to about a second)."""
    return own.renew + MARGIN


def condemned_after(member: Pace, own: Pace, misses: int) -> float:
    """The silence (seconds since etcd last renewed the lease) that condemns a member of pace
    ``member`` (see the module docstring): ``misses`` of its renewals, its client's failover
    (``renew + failover``) plus :data:`MARGIN`, and the observer's own tolerance
    (:func:`tolerated`) plus the member's interval plus :data:`MARGIN`, whichever is longest."""
    return max(misses * member.renew, member.renew + member.failover + MARGIN,
               tolerated(own) + member.renew + MARGIN)


def observes(settings: V3Settings, rank: int) -> bool:
    """Whether the member of ``rank`` in a failed group looks for dead members of it."""
    return settings.evict_misses > 0 and rank < OBSERVERS


@dataclass(frozen=True)
class MemberLease:
    """A join key left in the previous round and its lease as etcd's leader reported it:
    ``remaining`` whole seconds (-1: gone), ``granted`` its TTL, ``pace`` the one its join value
    names (:func:`pace_in`)."""

    key: bytes
    mod_revision: int
    lease: int
    remaining: int
    granted: int
    pace: Pace | None = None  # from its join value; None: the observer's own


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


def to_evict(members: Sequence[MemberLease], renewed_at: Sequence[float], now: float, own: Pace,
             misses: int, read_for: float = 0.0) -> list[MemberLease]:
    """The members to evict (see the module docstring): none when ``misses`` is 0; else those
    whose lease etcd has not renewed for at least :func:`condemned_after` seconds (at their own
    pace, the observer's ``own`` for a member whose value names none), while the observer's own
    renewals were answered with no gap over :func:`tolerated` for as long (plus ``read_for``, the
    seconds the reads took that ended just before ``now``: the silence was counted at some moment
    within them)."""
    if misses <= 0:
        return []
    steady = steady_for(renewed_at, now, tolerated(own))
    if steady <= 0.0:
        return []
    return [m for m in members
            if m.remaining >= 0
            and condemned_after(m.pace or own, own, misses) <= silent_for(m) <= steady - read_for]


class Keyed(Protocol):
    """A join key as a read found it: an etcd ``KeyValue``, or a
    :class:`~etcd_rdzv.native.records.Joiner` of a round read."""

    @property
    def key(self) -> bytes: ...

    @property
    def mod_revision(self) -> int: ...

    @property
    def lease(self) -> int: ...

    @property
    def value(self) -> bytes: ...


def suspects(client: EtcdClient, kvs: Sequence[Keyed], session: Session, own: Pace,
             misses: int) -> tuple[tuple[float, ...], float, list[MemberLease]]:
    """One look at the leases of ``kvs`` (one LeaseTimeToLive each; none for a key of ``session``'s
    own lease or of none) and the verdict of :func:`to_evict` on them: ``(renewed_at, now, condemned)``,
    the observer's renewal times and the moment of the verdict (for the log) with the members to
    evict. The observer's renewals are read after the lease reads: etcd must still be answering it.
    Raises ``EtcdError`` subclasses."""
    started = time.monotonic()
    members = [MemberLease(kv.key, kv.mod_revision, kv.lease, *client.lease_ttls(kv.lease),
                           pace=pace_in(kv.value, own))
               for kv in kvs if kv.lease and kv.lease != session.id]
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
    """The evictions of one wait in ``round_`` by a member of ``round_ - 1`` (see the module
    docstring); ``session`` is the observer's own lease session."""

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
        """Look at the previous round's leases if a look is due, and evict; returns ``timeout``
        (seconds, None: none) shortened to the next look: in half an interval, or in one while
        the round is empty (a member that re-attaches refills it, and may die after all)."""
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
