"""One wait of an ``etcd-v3`` node in a round: decide, act, until a signal ends it.

:class:`RoundWait` is the executor of the wait loop of
:meth:`Participant._wait <etcd_rdzv.native.rounds.Participant._wait>`: it holds the
round's :class:`RoundView`, the
:class:`~etcd_rdzv.native.barrier.Barrier` state and the watch it waits on; it asks
:func:`~etcd_rdzv.native.barrier.decide` (the pure decision) what to do and does it
(read the round, seal it, time out, or wait on the watch), and returns the
:class:`Signal` that ended the wait. What a signal means for
the node (its place, a retry, a closed run) is the participant's.

The synced-wait rule is the client's (:mod:`etcd_store.client.synced`): the watch opens
from now and etcd confirms it (:func:`~etcd_rdzv.native.leases.confirm`, the client's
:func:`~etcd_store.client.synced.confirmed`); the wait reads its events through a
:class:`~etcd_store.client.synced.SyncedWatch` whose read is the view's revision (the
join's, or the view's latest when the watch is widened); a gap between that revision and
the watch's start is covered by one read (:meth:`RoundWait.catch_up`, recorded with
``SyncedWatch.read_at``), and only events above the last such read reach the view.

Blocks: :meth:`RoundWait.run` until a signal, or ``join_timeout``. Raises
:class:`~etcd_rdzv.native.records.RoundTimeout`, ``ProtocolStateError`` and
``EtcdError`` subclasses; never cancels its watch (the participant does).

**The round view.** A node that joins round ``T`` watches the run's ``ctl/`` keys from "now", on a
watch that etcd confirmed before the join Txn was sent (so it starts below the join's
revision; its events at or below that revision are not folded in: the join's compares
saw that state). While it may have to tell when ``T - 1`` empties (a seal candidate,
or a node kept out by a full group), it watches the join keys of ``T - 1`` too
(:meth:`~etcd_rdzv.native.records.RunKeys.watch_range`), on a watch opened after the
join, whose gap one read covers (:meth:`RoundView.catch_up`). It never watches the
joins of its own round: it sees about one event per round (the ``sealed``
record, which names the members), plus one per departure from ``T - 1`` when it
watches those. :class:`RoundView` starts from the join's answer and folds
every event in order (no RPC, no clock), and takes in the reads of a seal
candidate (:meth:`RoundView.update`). Events that end the wait come back as a
:class:`Signal`. Raises :class:`~etcd_rdzv.native.records.ProtocolStateError`
on records the protocol never writes.

Two rules keep every revision counted once, and only the second is the view's own:

* **The synced rule** (the client's :class:`~etcd_store.client.synced.SyncedWatch`,
  applied by :class:`RoundWait`): the events a watch delivers at
  or below the last read that covered its gap (the join, or a catch-up read) never reach
  :meth:`RoundView.apply`. That read stands for every key the watch covers, control
  records included.
* **Absolute counts** (``counted_through``): a read of the round at revision X
  (:meth:`RoundView.update`: a seal candidate's, or a failed seal's answer) holds the
  number of join keys of ``T - 1`` at X, so join-key events at or below X are not
  counted again. It is not a synced read: the watch was confirmed long before it, and
  the wait does not take ``sealed``/``closed`` from it but waits for their events, so
  control events at or below X must still reach the view. Hence a revision of its own
  next to the synced watch's, for the counts only.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from etcd_store.client import EtcdClient, Event, Session, Watch, renewing_lease
from etcd_store.client.synced import SyncedWatch
from etcd_store.errors import EtcdError

from . import protocol, start
from .barrier import Barrier, Check, JoinCounts, Seal, TimeOut, WaitUntil, decide
from .leases import SEAL_LOOKED, Evictor, NodeLeases, confirm, describe, own_pace, suspects
from .protocol import CatchUp, RoundRead
from .records import Membership, RoundTimeout, RunKeys, Sealed
from .settings import V3Settings

log = logging.getLogger(__name__)

__all__ = ["RoundView", "RoundWait", "SealedMeanwhile", "Signal", "SignalKind", "open_watch", "join_counts",
           "watches_previous"]

# --------------------------------------------------------------------------- the round view

class SignalKind(enum.Enum):
    SEALED = "sealed"  # ctl/sealed changed: see Signal.sealed
    CLOSED = "closed"  # ctl/closed (or ctl/abort, written with or after it) appeared
    RESET = "reset"  # ctl/sealed vanished (the run lease expired)


@dataclass(frozen=True)
class Signal:
    kind: SignalKind
    sealed: Sealed = Sealed()

    @property
    def round(self) -> int:
        return self.sealed.round

    @property
    def membership(self) -> Membership | None:
        return self.sealed.membership


class RoundView:
    """What a node waiting in round ``T`` knows (see the module docstring).

    ``seq`` and ``create_revision``: this node's sequence number and key create
    revision in ``T`` (from its join; with the sealed record they give its rank).
    ``count``: join keys of ``T`` as of the join or the latest read;
    ``prev_count``: join keys left in ``T - 1`` (kept current by the watch when it
    covers them); ``changes``: how many times the view changed; ``read``: the
    latest read of the round, while nothing changed since (else None).
    """

    def __init__(
        self,
        keys: RunKeys,
        round_: int,
        node_id: str,
        seq: int,
        create_revision: int,
        count: int,
        prev_count: int,
        revision: int,
    ) -> None:
        self.keys = keys
        self.round = round_
        self.node_id = node_id
        self.seq = seq
        self.create_revision = create_revision
        self.count = count
        self.prev_count = prev_count
        self.revision = revision
        self.changes = 0
        self.read: RoundRead | None = None
        # Join-key events of the previous round at or below this revision are already counted:
        # the join's or a catch-up read's (the synced watch skips those anyway), or a later read
        # of the round (update) whose counts are absolute (see the module docstring).
        self.counted_through = revision

    @property
    def vacated(self) -> bool:
        """Whether no node remains in the previous round (so this one may be sealed)."""
        return self.prev_count <= 0

    def update(self, read: RoundRead) -> None:
        """Take in a read of the round (a candidate's, or a failed seal's answer).

        Its counts are absolute at its revision X: join-key events at or below X that the watch
        delivers later are already in them (skipped, and the read stays fresh). Control events
        are not skipped: the caller settles on what the read shows of ``sealed`` and ``closed``
        and waits for their events, which the watch delivers whatever their revision.
        """
        self.count, self.prev_count, self.read = read.count, read.prev_count, read
        self.revision = max(self.revision, read.revision)
        self.counted_through = max(self.counted_through, read.revision)
        self.changes += 1

    def catch_up(self, read: CatchUp, *, expect_sealed: bool) -> Signal | None:
        """Take in a read that covers the gap between the view's revision and the start of a
        watch opened after it (read, not watched: the wider watch opened after the join).

        A ``sealed`` or ``closed`` record written after the view's revision (the join's, or a
        later read's) gives its signal, as its event would have (a ``sealed`` record gone
        since, when the join saw one, is the RESET its delete would have given); the previous
        round's count is taken as read. The caller's synced watch skips the events at or
        below the read's revision from now on (``SyncedWatch.read_at``): the read holds them.
        """
        since = self.revision  # everything at or below it is in the view already
        self.prev_count = read.prev_count
        self.counted_through = max(self.counted_through, read.revision)
        self.revision = max(self.revision, read.revision)
        self.changes += 1
        self.read = None
        return self._caught(read, since, expect_sealed=expect_sealed)

    def _caught(self, read: CatchUp, since: int, *, expect_sealed: bool) -> Signal | None:
        control = {kv.key: kv for kv in read.control}
        for key in (self.keys.closed, self.keys.abort):
            closed = control.get(key)
            if closed is not None and closed.mod_revision > since:
                return self._control(Event("PUT", closed))
        sealed = control.get(self.keys.sealed)
        if sealed is None:
            return Signal(SignalKind.RESET) if expect_sealed else None
        return self._control(Event("PUT", sealed)) if sealed.mod_revision > since else None

    def apply(self, event: Event) -> Signal | None:
        """Fold one watch event into the view; a :class:`Signal` when it ends the wait.

        ``event`` is above the last synced read (the caller's
        :class:`~etcd_store.client.synced.SyncedWatch` skipped the others)."""
        kv = event.kv
        key = kv.key
        parsed = self.keys.parse_join_key(key)
        self.revision = max(self.revision, kv.mod_revision)
        if key in (self.keys.sealed, self.keys.closed, self.keys.abort):
            return self._control(event)
        if parsed is None or parsed[0] != self.round - 1:
            return None
        if kv.mod_revision <= self.counted_through:
            return None  # a later read of the round already counted it
        self.changes += 1
        self.read = None
        if event.type == "DELETE":
            self.prev_count -= 1
        elif kv.version == 1:
            self.prev_count += 1
        return None

    def _control(self, event: Event) -> Signal | None:
        kv = event.kv
        if kv.key == self.keys.sealed:
            if event.type == "DELETE":
                return Signal(SignalKind.RESET)
            return Signal(SignalKind.SEALED, Sealed.from_kv(kv))
        return Signal(SignalKind.CLOSED) if event.type == "PUT" else None


# --------------------------------------------------------------------------- the wait


class SealedMeanwhile(Exception):
    """``join_timeout`` passed, but the round was sealed before the node could withdraw its join:
    the node's place is to be read now, not awaited from the watch."""


def join_counts(view: RoundView) -> JoinCounts:
    """What :func:`~etcd_rdzv.native.barrier.decide` needs of the view."""
    return JoinCounts(view.count, view.prev_count, view.changes, fresh=view.read is not None)


def _master_named(read: protocol.RoundRead) -> tuple[str, int] | None:
    """Rank 0's address and port for the sealed record: from the first joiner's value, while
    its port is recent (:func:`~etcd_rdzv.native.start.master_of`)."""
    return start.master_of(read.joiners[0].value, time.time())


def watches_previous(state: Barrier, view: RoundView, settings: V3Settings) -> bool:
    """Whether this node must watch the previous round's join keys: it may have to tell
    when that round empties (a candidate still trying, or kept out by a full group) and,
    as far as it knows, it is not empty. Decided after the join and again after each read
    of the round: a member of the previous round may re-attach after an outage.

    Never once the wait is settled: a read showed the round sealed or the run closed, and
    that record's event is on the watch the node has (``ctl/``); a wider watch from now would
    not deliver it, and its catch-up signals only records newer than that read."""
    if state.settled:
        return False
    return view.prev_count > 0 and (state.candidate or join_counts(view).kept_out(settings))


def open_watch(client: EtcdClient, keys: RunKeys, round_: int, wide: bool, opened: Watch | None) -> Watch:
    """The wait's watch from now: ``opened`` if it covers the range the wait needs
    (:meth:`~etcd_rdzv.native.records.RunKeys.watch_range`), else a new one (``opened``
    cancelled). No RPC but the watch's creation."""
    start, end = keys.watch_range(round_, previous=wide)
    if opened is not None and (opened.key, opened.range_end) == (start, end):
        return opened
    if opened is not None:
        opened.cancel()
    return client.watch(start, end)  # from now: a synced watcher (see RoundWait.catch_up)


class RoundWait:
    """One wait in ``round_`` (see the module docstring); one :meth:`run` per instance.

    ``state`` and ``watch`` are current after :meth:`run` returns or raises (the wait may
    widen its watch: the participant cancels the one it ends with). ``give_up(timeout)``
    withdraws the node's join unless the round was sealed meanwhile (whether it did).
    """

    def __init__(self, settings: V3Settings, client: EtcdClient, keys: RunKeys, node_id: str,
                 leases: NodeLeases, round_: int, previous: Sealed, view: RoundView, state: Barrier,
                 watch: Watch, wide: bool, session: Session, *, evictor: Evictor | None,
                 give_up: Callable[[], bool]) -> None:
        self._settings = settings
        self._client = client
        self._keys = keys
        self._node_id = node_id
        self._leases = leases
        self.round = round_
        self.previous = previous
        self.view = view
        self.state = state
        self.watch = watch
        self.session = session
        self.wide = wide  # the watch also covers the previous round's join keys
        self._evictor = evictor
        self._give_up = give_up
        self._synced: SyncedWatch | None = None  # self.watch, once confirmed (catch_up)
        self._looked_at = -1  # the revision of the last read whose joiners' leases we judged

    def run(self) -> Signal:
        """The wait loop: catch up, then decide (:func:`~etcd_rdzv.native.barrier.decide`) and
        act (:meth:`act`) until a signal ends the wait; that signal."""
        signal = self.catch_up()
        while signal is None:
            if not self.wide and watches_previous(self.state, self.view, self._settings):
                # A read found the previous round occupied again (a member re-attached
                # after an outage): watch its departures from now on.
                self.widen()
                signal = self.catch_up()
                if signal is not None:
                    break
            self.state, action = decide(self.state, join_counts(self.view), self._settings, time.monotonic())
            signal = self.act(action)
        return signal

    def act(self, action: Check | Seal | TimeOut | WaitUntil) -> Signal | None:
        """Carry out one decision of the wait: read the round, try to seal it, time out
        (raises :class:`~etcd_rdzv.native.records.RoundTimeout` after withdrawing, or
        :class:`SealedMeanwhile` when the round was sealed meanwhile), or wait on the watch until ``action.at``; the signal
        that ends the wait, if one came."""
        if isinstance(action, Check):
            read = protocol.read_round(self._client, self._keys, self.round)
            self.view.update(read)
            if read.sealed.revision != self.previous.revision or read.closed:
                self.state = self.state.settle()  # its event is on the way
            return None
        if isinstance(action, Seal):
            self.state = self.try_seal()
            return None
        if isinstance(action, TimeOut):
            if self._give_up():
                s, view = self._settings, self.view
                raise RoundTimeout(
                    f"node {self._node_id}: round {self.round} of the rendezvous "
                    f"{s.run_id!r} was not sealed within join_timeout={s.join_timeout:g} s "
                    f"({view.count} of min_nodes={s.min_nodes} joined when last known"
                    f"{'' if view.vacated else ', previous round still running'})"
                )
            # Sealed meanwhile: the participant reads its place at once (its watch may hear nothing
            # for long: a stream on a member that answers nothing).
            raise SealedMeanwhile(self.round)
        timeout = None if action.at is None else max(action.at - time.monotonic(), 0.0)
        if self._evictor is not None:
            timeout = self._evictor.poll(timeout)  # a dead member of our group leaves in seconds
        synced = self._synced
        assert synced is not None, "catch_up() confirms every watch before the wait reads it"
        for event in synced.get(timeout=timeout):
            signal = self.view.apply(event)
            if signal is not None:
                return signal
        return None

    def widen(self) -> None:
        """A watch of ``ctl/`` and the previous round's join keys, from now, in place of
        the current one (cancelled). The caller catches up on the gap (:meth:`catch_up`), which
        is sound because everything at or below the view's revision is in the view: the read
        that asked for the wider watch showed the control records unchanged. If the lease
        ended or the node was shut down meanwhile, the new watch is cancelled too, and the
        wait ends the way a cancelled watch ends it."""
        wide = self._client.watch(*self._keys.watch_range(self.round, previous=True))
        self._leases.swap_watch(self.watch, wide, self.session)
        self.watch, self.wide = wide, True

    def catch_up(self) -> Signal | None:
        """Read what happened between our join and the watch's start; a signal if that ended the wait.

        The watch opens from "now", because etcd holds back events for a watcher whose start
        revision is already in the past until its 100 ms catch-up tick, while a watcher that starts
        at the current revision gets them at once. etcd confirms the watch with the revision W it
        starts after. The ``ctl/`` watch is confirmed before the join Txn is sent, so W is below
        the join's revision J; events up to J are skipped (the join's compares saw that state).
        A node that must also watch the previous round opens that watch after the join. If
        W <= J the watch covers everything after the join; else one read-only Txn at a revision
        R >= W (ctl/ and the count of round T-1, O(1) bytes) covers the gap, and watch events
        at or below R are skipped. So every revision after the join is seen once, by the read
        or by the watch: no lost wake-up. This is the client's synced rule
        (:class:`~etcd_store.client.synced.SyncedWatch`, ``behind`` and ``read_at``) with the
        view's revision as the caller's read: J at the start, the view's latest revision for a
        widened watch (everything at or below it is in the view, see :meth:`widen`).
        """
        confirm(self._client, self.watch, self._node_id)
        synced = self._synced = SyncedWatch(self.watch, self.view.revision)
        if not synced.behind:
            return None
        read = protocol.catch_up(self._client, self._keys, self.round)
        synced.read_at(read.revision)
        return self.view.catch_up(read, expect_sealed=self.previous.revision > 0)

    def evict_dead_joiners(self, read: protocol.RoundRead) -> Barrier | None:
        """Before a seal: evict the joiners of ``read`` that are dead by eviction's rule (one
        LeaseTimeToLive per joiner to be named, at most :data:`~etcd_rdzv.native.leases.SEAL_LOOKED`;
        then, if any is condemned, one Txn, :func:`protocol.evict_joiners`). None when nobody was
        condemned (seal with ``read``); else the state after taking in the fresh read that Txn
        returned (the wait decides again on it, and a seal from that read looks at the leases again:
        joiners that moved into the named window or arrived since the look are judged too, and a
        Txn that failed on one key evicted none of the others). Needs ``evict_misses`` > 0 and our own renewals steady
        (:func:`~etcd_rdzv.native.leases.to_evict`); an etcd error ends the look (the seal goes on:
        a dead member named is found after the seal)."""
        s = self._settings
        if s.evict_misses <= 0:
            return None
        own = own_pace(s, self._client.retry_policy.first_attempt)
        named = read.joiners[: min(s.max_nodes, SEAL_LOOKED)]
        try:
            renewed, now, condemned = suspects(self._client, named, self.session, own, s.evict_misses)
            if not condemned:
                return None
            out = protocol.evict_joiners(self._client, self._keys, self.round, self.previous,
                                         [(m.key, m.mod_revision, m.lease) for m in condemned])
        except EtcdError as e:
            log.info("node %s: could not look at the leases of round %d's joiners: %s", self._node_id, self.round, e)
            return None
        for member in condemned:
            log.warning("round %d: %s joiner %s before the seal: %s", self.round,
                        "evicted" if out.ok else "could not evict", member.key.decode(errors="replace"),
                        describe(member, own, s.evict_misses, renewed, now))
        assert out.read is not None
        self.view.update(out.read)
        if out.read.sealed.revision != self.previous.revision or out.read.closed:
            return self.state.settle()
        return self.state

    def try_seal(self) -> Barrier:
        """One seal attempt with the view's fresh read (and the run lease, the first time).

        The sealed record also names rank 0's address and port (from its join value,
        :func:`_master_named`), so that no member has to read them after the seal. A failed attempt's answer is a fresh read, folded
        into the view.
        """
        view, state, previous, round_ = self.view, self.state, self.previous, self.round
        read = view.read
        assert read is not None
        s = self._settings
        if read.count < s.min_nodes:
            return state  # not due on what we read: decide() will say so
        if read.revision != self._looked_at:
            self._looked_at = read.revision
            evicted = self.evict_dead_joiners(read)
            if evicted is not None:
                return evicted
        named = _master_named(read)

        def seal(lease: int) -> protocol.SealOutcome:
            return protocol.seal(self._client, self._keys, round_, previous, read, lease, s.max_nodes,
                                 master=named)

        res = renewing_lease(seal, self._leases.run_lease_or_create, self._leases.forget_run_lease, renewals=1)
        if res.ok:
            log.debug("node %s sealed round %d at revision %d", self._node_id, round_, res.revision)
            return state.sealed(True)
        assert res.read is not None
        view.update(res.read)
        if res.read.sealed.revision != previous.revision or res.read.closed:
            return state.settle()
        return state
