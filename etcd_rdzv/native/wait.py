"""One wait of an ``etcd-v3`` node in a round: decide, act, until a signal ends it.

:class:`RoundWait` executes the wait loop of :meth:`Participant._wait
<etcd_rdzv.native.rounds.Participant._wait>`: it asks :func:`~etcd_rdzv.native.barrier.decide`
what to do, does it (read the round, seal it, time out, or wait on the watch) and returns the
:class:`Signal` that ended the wait; what that means for the node is the participant's. Blocks
until a signal or ``join_timeout``; raises :class:`~etcd_rdzv.native.records.RoundTimeout`,
``ProtocolStateError`` and ``EtcdError``; never cancels its watch (the participant does).

**The round view.** A node in round ``T`` watches ``ctl/`` on a watch confirmed before its join
Txn, and, while it may have to tell when ``T - 1`` empties (a candidate, or kept out by a full
group), the join keys of ``T - 1`` too, on a watch opened after the join. It never watches its own
round's joins: about one event per round (the ``sealed`` record naming the members), plus one per
departure from ``T - 1``. :class:`RoundView` folds them in order (no RPC, no clock).

Two rules count every revision once; only the second is the view's own:

* **The synced rule** (:class:`~etcd_store.client.synced.SyncedWatch`, :meth:`RoundWait.catch_up`):
  events at or below the last read that covered the watch's gap (the join, or a catch-up read)
  never reach :meth:`RoundView.apply`; that read stands for every key watched, control included.
* **Absolute counts** (``counted_through``): a later read of the round at X (:meth:`RoundView.update`)
  holds the count of ``T - 1`` at X, so join-key events at or below X are not counted again. Not a
  synced read: the wait takes ``sealed``/``closed`` from their events, so those still get through.
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
from .records import RoundTimeout, RunKeys, Sealed, decode_evicted
from .settings import V3Settings

log = logging.getLogger(__name__)

__all__ = ["RoundView", "RoundWait", "SealedMeanwhile", "Signal", "SignalKind", "open_watch", "join_counts",
           "watches_previous"]

# --------------------------------------------------------------------------- the round view

class SignalKind(enum.Enum):
    SEALED = "sealed"  # ctl/sealed changed: see Signal.sealed
    CLOSED = "closed"  # ctl/closed (or ctl/abort, written with or after it) appeared
    RESET = "reset"  # ctl/sealed vanished (the run lease expired)
    EVICTED = "evicted"  # ctl/evicted names this node's join key: it was deleted before the seal


@dataclass(frozen=True)
class Signal:
    kind: SignalKind
    sealed: Sealed = Sealed()

    @property
    def round(self) -> int:
        return self.sealed.round


class RoundView:
    """What a node waiting in round ``T`` knows (see the module docstring).

    ``seq``/``create_revision``: this node's join in ``T`` (with the sealed record, its rank);
    ``count``: join keys of ``T`` at the join or latest read; ``prev_count``: join keys left in
    ``T - 1``; ``changes``: how often the view changed; ``read``: the latest read while nothing
    changed since (else None).
    """

    def __init__(
        self,
        keys: RunKeys,
        round_: int,
        seq: int,
        create_revision: int,
        count: int,
        prev_count: int,
        revision: int,
    ) -> None:
        self.keys = keys
        self.round = round_
        self.seq = seq
        self.create_revision = create_revision
        self.count = count
        self.prev_count = prev_count
        self.revision = revision
        self.changes = 0
        self.read: RoundRead | None = None
        # Join-key events of T-1 at or below it are counted (absolute counts: module docstring).
        self.counted_through = revision

    @property
    def vacated(self) -> bool:
        """Whether no node remains in the previous round (so this one may be sealed)."""
        return self.prev_count <= 0

    def update(self, read: RoundRead) -> None:
        """Take in a read of the round (a candidate's, or a failed seal's answer).

        Its counts are absolute at its revision: later join-key events at or below it are skipped.
        Control events are not: the caller waits for the ``sealed``/``closed`` events the read shows.
        """
        self.count, self.prev_count, self.read = read.count, read.prev_count, read
        self.revision = max(self.revision, read.revision)
        self.counted_through = max(self.counted_through, read.revision)
        self.changes += 1

    def catch_up(self, read: CatchUp, *, expect_sealed: bool) -> Signal | None:
        """Take in a read covering the gap between the view's revision and a watch opened after it.

        A ``sealed`` or ``closed`` record newer than the view's revision gives its signal, as its event
        would have (a ``sealed`` record gone since the join saw it gives RESET); the previous round's
        count is taken as read. The caller's synced watch then skips events at or below the read.
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
        for key in (self.keys.closed, self.keys.abort, self.keys.evicted):
            closed = control.get(key)
            if closed is not None and closed.mod_revision > since:
                signal = self._control(Event("PUT", closed))
                if signal is not None:
                    return signal
        sealed = control.get(self.keys.sealed)
        if sealed is None:
            return Signal(SignalKind.RESET) if expect_sealed else None
        return self._control(Event("PUT", sealed)) if sealed.mod_revision > since else None

    def apply(self, event: Event) -> Signal | None:
        """Fold one watch event (above the last synced read) into the view; a :class:`Signal` if it ends
        the wait."""
        kv = event.kv
        key = kv.key
        parsed = self.keys.parse_join_key(key)
        self.revision = max(self.revision, kv.mod_revision)
        if key in (self.keys.sealed, self.keys.closed, self.keys.abort, self.keys.evicted):
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
        if kv.key == self.keys.evicted:
            return self._evicted(event)
        return Signal(SignalKind.CLOSED) if event.type == "PUT" else None

    def _evicted(self, event: Event) -> Signal | None:
        """EVICTED when the eviction names our join key of this round (by create revision: identity by
        etcd); a later join of ours has another create revision, so an older eviction never names it."""
        if event.type != "PUT":
            return None
        round_, created = decode_evicted(event.kv.value)
        if round_ == self.round and self.create_revision in created:
            return Signal(SignalKind.EVICTED)
        return None


# --------------------------------------------------------------------------- the wait


class SealedMeanwhile(Exception):
    """``join_timeout`` passed, but the round was sealed before the node could withdraw: read its place
    now."""


def join_counts(view: RoundView) -> JoinCounts:
    """What :func:`~etcd_rdzv.native.barrier.decide` needs of the view."""
    return JoinCounts(view.count, view.prev_count, view.changes, fresh=view.read is not None)


def _master_named(read: protocol.RoundRead) -> tuple[str, int] | None:
    """Rank 0's address and port for the sealed record, while the first joiner's port is recent."""
    return start.master_of(read.joiners[0].value, time.time())


def watches_previous(state: Barrier, view: RoundView, settings: V3Settings) -> bool:
    """Whether this node must watch the previous round's join keys: it may have to tell when that round
    empties (a candidate, or kept out by a full group) and it is not empty as far as it knows.
    Decided after the join and after each read (a member of it may re-attach after an outage).

    Never once the wait is settled: the record that settled it is on the ``ctl/`` watch already,
    and a wider watch from now would not deliver it.
    """
    if state.settled:
        return False
    return view.prev_count > 0 and (state.candidate or join_counts(view).kept_out(settings))


def open_watch(client: EtcdClient, keys: RunKeys, round_: int, wide: bool, opened: Watch | None) -> Watch:
    """The wait's watch from now: ``opened`` if it covers the needed range, else a new one (``opened``
    cancelled). No RPC but the watch's creation."""
    start, end = keys.watch_range(round_, previous=wide)
    if opened is not None and (opened.key, opened.range_end) == (start, end):
        return opened
    if opened is not None:
        opened.cancel()
    return client.watch(start, end)  # from now: a synced watcher (see RoundWait.catch_up)


class RoundWait:
    """One wait in ``round_`` (see the module docstring); one :meth:`run` per instance.

    ``state`` and ``watch`` are current after :meth:`run` returns or raises (the wait may widen its
    watch; the participant cancels the one it ends with). ``give_up()`` withdraws the join unless
    the round was sealed meanwhile, and says whether it did.
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
        """The wait loop: catch up, then decide and :meth:`act` until a signal ends the wait."""
        signal = self.catch_up()
        while signal is None:
            if not self.wide and watches_previous(self.state, self.view, self._settings):
                # T-1 occupied again (a member re-attached after an outage): watch its departures.
                self.widen()
                signal = self.catch_up()
                if signal is not None:
                    break
            self.state, action = decide(self.state, join_counts(self.view), self._settings, time.monotonic())
            signal = self.act(action)
        return signal

    def act(self, action: Check | Seal | TimeOut | WaitUntil) -> Signal | None:
        """Carry out one decision: read the round, try to seal, time out (raises
        :class:`~etcd_rdzv.native.records.RoundTimeout` after withdrawing, or :class:`SealedMeanwhile`),
        or wait on the watch until ``action.at``; the signal that ends the wait, if one came."""
        if isinstance(action, Check):
            self.state = self._fold(protocol.read_round(self._client, self._keys, self.round))
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
            # Sealed meanwhile: read the place now (the watch's stream may hang on a mute member).
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
        """Replace the watch by one of ``ctl/`` and the previous round's join keys, from now.

        The caller covers the gap (:meth:`catch_up`), sound because the read that asked for the wider
        watch showed the control records unchanged. If the lease ended or the node was shut down
        meanwhile, the new watch is cancelled too and the wait ends as on any cancelled watch.
        """
        wide = self._client.watch(*self._keys.watch_range(self.round, previous=True))
        self._leases.swap_watch(self.watch, wide, self.session)
        self.watch, self.wide = wide, True

    def catch_up(self) -> Signal | None:
        """Cover the gap between the view's revision and the watch's start; a signal if that ended the wait.

        The watch opens from "now": etcd holds back events for a watcher starting in the past until its
        100 ms catch-up tick, but delivers at once from the current revision. etcd confirms the revision
        W it starts after (the ``ctl/`` watch before the join Txn, so W < the join's J). If W <= the
        view's revision nothing is missing; else one read-only Txn at R >= W (``ctl/`` and the count of
        ``T - 1``, O(1) bytes) covers it and watch events at or below R are skipped. Every revision after
        the join is seen once, by the read or the watch: no lost wake-up.
        """
        confirm(self._client, self.watch, self._node_id)
        synced = self._synced = SyncedWatch(self.watch, self.view.revision)
        if not synced.behind:
            return None
        read = protocol.catch_up(self._client, self._keys, self.round)
        synced.read_at(read.revision)
        return self.view.catch_up(read, expect_sealed=self.previous.revision > 0)

    def evict_dead_joiners(self, read: protocol.RoundRead) -> Barrier | None:
        """Before a seal: evict the joiners of ``read`` dead by :func:`~etcd_rdzv.native.leases.to_evict`.

        One LeaseTimeToLive per joiner to be named (at most :data:`~etcd_rdzv.native.leases.SEAL_LOOKED`),
        and one Txn (:func:`protocol.evict_joiners`) if any is condemned. None when nobody was (seal with
        ``read``); else the state after that Txn's fresh read. An etcd error ends the look and the seal
        goes on: a dead member named is found after the seal.
        """
        s = self._settings
        if s.evict_misses <= 0:
            return None
        own = own_pace(s, self._client.retry_policy.first_attempt)
        named = read.joiners[: min(s.max_nodes, SEAL_LOOKED)]
        try:
            renewed, now, condemned = suspects(self._client, named, self.session, own, s.evict_misses)
            if not condemned:
                return None
            created = {j.key: j.create_revision for j in named}
            out = protocol.evict_joiners(self._client, self._keys, self.round, self.previous,
                                         [(m.key, m.mod_revision, m.lease, created[m.key]) for m in condemned])
        except EtcdError as e:
            log.info("node %s: could not look at the leases of round %d's joiners: %s", self._node_id, self.round, e)
            return None
        for member in condemned:
            log.warning("round %d: %s joiner %s before the seal: %s", self.round,
                        "evicted" if out.ok else "could not evict", member.key.decode(errors="replace"),
                        describe(member, own, s.evict_misses, renewed, now))
        assert out.read is not None
        return self._fold(out.read)

    def try_seal(self) -> Barrier:
        """One seal attempt with the view's fresh read (and the run lease, the first time).

        The sealed record names rank 0's address and port (:func:`_master_named`), so no member reads
        them after the seal. A failed attempt's answer is a fresh read, folded into the view.
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
        return self._fold(res.read)

    def _fold(self, read: RoundRead) -> Barrier:
        """Take ``read`` into the view; the state settled if it shows the round sealed by someone or the
        run closed (the record's event is on the way)."""
        self.view.update(read)
        if read.sealed.revision != self.previous.revision or read.closed:
            return self.state.settle()
        return self.state
