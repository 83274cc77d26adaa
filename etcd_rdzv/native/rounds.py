"""One node's part in the rounds of an ``etcd-v3`` run: join, wait, seal, close.

:class:`Participant` holds the last sealed record the node saw, its
:class:`~etcd_rdzv.native.barrier.Standing` and its :class:`~etcd_rdzv.native.leases.NodeLeases`,
and strings the Txns of :mod:`etcd_rdzv.native.protocol` together: :meth:`Participant.rendezvous`
joins rounds until one including this node is sealed; each wait is a
:class:`~etcd_rdzv.native.wait.RoundWait`, and the participant acts on the signal that ends it. A
lease etcd reports gone is replaced and the write resent (:func:`~etcd_store.client.renewing_lease`).
The handler (:mod:`etcd_rdzv.native.handler`) owns one.

Blocks: :meth:`~Participant.rendezvous` (until sealed, closed, or ``join_timeout``),
:meth:`~Participant.leave` and :meth:`~Participant.close_run` (until their deadline). Raises
``EtcdError`` subclasses, ``ProtocolStateError`` and the node's own
:class:`~etcd_rdzv.native.records.NodeError`; only the handler translates them to torch's.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

from etcd_store.client import EtcdClient, Session, Watch, renewing_lease
from etcd_store.errors import EtcdCompactedError, EtcdError

from . import protocol
from .barrier import (
    Admitted,
    Barrier,
    JoinDeadline,
    Joined,
    PreviousGroup,
    RoundResult,
    Standing,
    Undersized,
    resolved,
    verdict,
)
from .leases import Evictor, NodeLeases, confirm, observes, own_pace
from .records import (
    ClosedWhileKeptOut,
    NodeShutDown,
    ProtocolStateError,
    RoundTimeout,
    RunClosed,
    RunKeys,
    Sealed,
)
from .settings import V3Settings
from .start import join_value, start_round
from .telemetry import RoundObserver, SilentObserver
from .wait import (
    RoundView,
    RoundWait,
    SealedMeanwhile,
    Signal,
    SignalKind,
    join_counts,
    open_watch,
    watches_previous,
)

log = logging.getLogger(__name__)

__all__ = ["WITHDRAW_TIMEOUT", "Participant", "RoundResult"]

WITHDRAW_TIMEOUT = 2.0
"""Seconds a withdrawal may take when a wait ended with an error (raised after it)."""


@dataclass(frozen=True)
class _Retry:
    """Join again: from ``sealed`` when known, else after re-reading; ``clock`` as the wait left it."""

    sealed: Sealed | None
    clock: JoinDeadline


class Participant:
    """One node of the run (see the module docstring).

    ``leases`` (``session``, ``run_lease`` and ``shut_down`` read through to it) and ``standing`` are
    read by the handler. One :meth:`rendezvous` at a time; :meth:`stop` may be called from any thread.
    """

    def __init__(self, settings: V3Settings, client: EtcdClient, keys: RunKeys, node_id: str,
                 observer: RoundObserver | None = None) -> None:
        self._settings = settings
        self.observer = observer or SilentObserver()  # told of joins and lost leases
        self._client = client
        self._keys = keys
        self._node_id = node_id
        self.leases = NodeLeases(settings, client, keys, node_id, self.observer)
        self._sealed = Sealed()  # the latest ``ctl/sealed`` this node saw (a guess, checked by each join)
        self.standing = Standing()  # our joins and the round we are a member of

    @property
    def session(self) -> Session | None:
        """This node's lease session (:attr:`NodeLeases.session`)."""
        return self.leases.session

    @property
    def run_lease(self) -> int | None:
        """The run lease, None while not known (:attr:`NodeLeases.run_lease`)."""
        return self.leases.run_lease

    @property
    def shut_down(self) -> bool:
        """Whether the node was stopped for good (:meth:`stop`)."""
        return self.leases.shut_down

    # ------------------------------------------------------------------ stopping, leaving, closing

    def stop(self) -> Session | None:
        """Stop for good: cancel a wait's watch, forget the round; returns the session to close (no RPC)."""
        session = self.leases.stop()
        self.standing.forget()
        return session

    def leave(self, deadline: float) -> bool:
        """Stop for good and release this node's keys now, without closing the run.

        Withdraws a join from a round that may be unsealed (one Txn each,
        :func:`protocol.leave_if_unsealed`), then revokes the lease (its join key goes with it), every
        RPC bounded by ``deadline``. Whether etcd confirmed the revoke; never raises for etcd failures.
        """
        pending = self.standing.pending()  # the join in flight first
        session = self.stop()
        if session is None:
            return True
        withdrawn: set[bytes] = set()
        for joined in pending:
            if joined.key in withdrawn or time.monotonic() >= deadline:
                continue
            withdrawn.add(joined.key)
            # Bump the join counter so no seal prepared before names us (a bare revoke would not).
            try:
                protocol.leave_if_unsealed(self._client, self._keys, joined.round, joined.key,
                                           joined.under, timeout=deadline - time.monotonic())
            except EtcdError as e:
                log.info("node %s could not withdraw from round %d: %s", self._node_id, joined.round, e)
        return self.leases.revoke(session, deadline)

    def close_run(self, deadline: float, *, abort: bool = False) -> None:
        """:meth:`NodeLeases.close_run` (raises ``EtcdError`` subclasses)."""
        self.leases.close_run(deadline, abort=abort)

    def reattach(self) -> protocol.Occupancy | None:
        """Put our join key back into our round with a new lease, after an outage expired it.

        One LeaseGrant and one Txn (:func:`protocol.reattach`), which succeeds only if no round was sealed
        since ours and the run is open. The group's counts after it, or None when the node cannot
        re-attach (sealed over, closed, or seal revision unknown): its group is over. Raises
        ``EtcdError``, and :class:`~etcd_rdzv.native.records.NodeShutDown` once stopped.
        """
        st = self.standing
        joined, round_ = st.joined, st.member_round
        if round_ is None or not st.member_seal or joined is None or joined.round != round_:
            return None
        self.leases.renew()
        used: list[int] = []

        def put_back(lease: int) -> protocol.Occupancy | None:
            used.append(lease)
            return protocol.reattach(self._client, self._keys, round_, joined.key, st.join_value, lease,
                                     st.member_seal)

        # a lease refused by etcd (another user's key on it) is replaced once, as for a join
        occ = renewing_lease(put_back, lambda: self.leases.ensure()[0], self.leases.forget, renewals=1)
        if occ is None:
            log.warning("node %s cannot re-attach to round %d: a later round was sealed or the run "
                        "closed", self._node_id, round_)
        else:
            log.warning("node %s re-attached to round %d with a new lease %x after its lease ended",
                        self._node_id, round_, used[-1])
        return occ

    def _ensure_lease(self) -> int:
        """This node's lease; a new one forgets our join key (gone with the old lease). 0-1 LeaseGrant."""
        lease, new = self.leases.ensure()
        if new:
            self.standing.joined = None
        return lease

    def _learn(self, sealed: Sealed) -> None:
        """Remember the latest sealed record and help keep the run lease it names alive."""
        self._sealed = sealed
        self.leases.adopt_run_lease(sealed.run_lease)

    # ------------------------------------------------------------------ the rounds

    def rendezvous(self, clock: JoinDeadline) -> RoundResult:
        """Join rounds until one that includes us is sealed.

        The first join assumes the last sealed record this node saw; a stale guess costs one failed join,
        whose answer carries the current record. Raises :class:`~etcd_rdzv.native.records.RunClosed`
        (also :class:`ClosedWhileKeptOut`), ``RoundTimeout``, ``NodeShutDown``, ``ProtocolStateError``
        and ``EtcdError`` subclasses.
        """
        # one free port per next_round call; our pace, which observers of our group read (eviction)
        value = join_value(self._settings.node_addr, own_pace(self._settings, self._client.retry_policy.first_attempt).fields())
        prior = self.standing.begin(value, observes(self._settings, self.standing.member_rank))
        sealed: Sealed | None = self._sealed
        while True:
            if sealed is None:
                sealed = self._read_sealed()
            self._learn(sealed)
            resolved = self._resolve_unseen(sealed)
            if resolved is not None:
                return resolved
            step = self._join_and_wait(sealed, value, clock, prior)
            if isinstance(step, RoundResult):
                return step
            clock, sealed = step.clock, step.sealed

    def start(self, admitted: RoundResult) -> bool:
        """Confirm the round :meth:`rendezvous` admitted us to (:func:`~etcd_rdzv.native.start.start_round`):
        True once every member confirmed it, False when it was voided (a member left first; the next
        :meth:`rendezvous` re-joins). Waits at most ``max(join_timeout, 2 * lease_ttl)`` (a dead member's
        key goes within one TTL); then raises ``RoundTimeout`` after withdrawing."""
        wait = max(self._settings.join_timeout, 2.0 * self._settings.lease_ttl)
        joined = self.standing.joined
        created = joined.created if joined is not None and joined.round == admitted.round else 0
        fate = start_round(self._client, self._keys, admitted.round, admitted.world_size, self._node_id,
                           self.run_lease or 0, time.monotonic() + wait, created=created)
        if fate is None:
            self._withdraw()
            raise RoundTimeout(
                f"round {admitted.round} of {self._settings.run_id!r} was not confirmed by all of its "
                f"{admitted.world_size} members in time (node {self._node_id})"
            )
        return fate

    def _read_sealed(self) -> Sealed:
        """The current sealed record (one read-only Txn); ``RunClosed`` (after withdrawing) if closed."""
        meta = protocol.read_meta(self._client, self._keys)
        if meta.closed:
            self._withdraw()
            raise RunClosed(f"the rendezvous {self._settings.run_id!r} is closed")
        return meta.sealed

    def _resolve_unseen(self, sealed: Sealed) -> RoundResult | None:
        """Our place in the round we joined if it was sealed while we were not watching (:meth:`_resolve`)."""
        joined = self.standing.joined
        if joined is not None and joined.member is None and joined.round <= sealed.round:
            return self._resolve(joined.round, sealed)
        return None

    def _join_and_wait(self, sealed: Sealed, value: bytes, clock: JoinDeadline,
                       prior: PreviousGroup) -> RoundResult | _Retry:
        """Join round ``sealed.round + 1`` and wait in it (:meth:`_wait`).

        The control watch opens before the join and the join waits for etcd to confirm it, so the watch
        starts below the join's revision and needs no catch-up read.
        """
        keys, target = self._keys, sealed.round + 1
        with self._client.watch(*keys.watch_range(target, previous=False)) as ctl_watch:
            outcome = renewing_lease(
                functools.partial(self._join, sealed, value, ready=ctl_watch),
                self._ensure_lease, self.leases.forget,
            )
            if not outcome.ok:
                return self._join_failed(outcome, sealed, clock)
            key = keys.join_key(target, self._node_id)
            created = outcome.create_revision
            self.standing.joined, self.standing.joining = Joined(target, key, sealed, created=created), None
            log.debug("node %s joined round %d at revision %d (join %d of the round, %d present)",
                      self._node_id, target, outcome.revision, outcome.seq, outcome.count)
            self.observer.joined(target, outcome.count)
            follows = prior.round == target - 1
            recovering = self._settings.fast_recovery and follows
            waited = self._wait(target, outcome, sealed, clock, prior.world if recovering else None,
                                opened=ctl_watch, evicts=prior.evicts and follows)
        if isinstance(waited, RoundResult):
            self.standing.joined = Joined(target, key, sealed, member=True, created=created)
        return waited

    def _join_failed(self, outcome: protocol.JoinOutcome, sealed: Sealed, clock: JoinDeadline) -> _Retry:
        """A join whose fences failed: join again from the record its answer carries; ``RunClosed``
        (after withdrawing) if the run is closed."""
        if outcome.joined_anyway:
            # A lost answer hid a join that did apply; its round is sealed now.
            target = sealed.round + 1
            self.standing.joined = Joined(target, self._keys.join_key(target, self._node_id), sealed)
        self.standing.joining = None
        if outcome.closed:
            self._withdraw()
            raise RunClosed(f"the rendezvous {self._settings.run_id!r} is closed")
        return _Retry(outcome.sealed, clock)

    def _join(self, sealed: Sealed, value: bytes, lease: int, *, ready: Watch | None = None) -> protocol.JoinOutcome:
        """One join Txn with ``lease``, deleting our previous key; first waits (at most the client's
        timeout) for etcd to confirm ``ready``, and sends nothing if that watch failed.

        The join is recorded as in flight (``Standing.joining``) before it is sent, so a leave at exit
        between the Txn and recording its answer still withdraws it with a counter bump.
        """
        if ready is not None:
            confirm(self._client, ready, self._node_id, before_join=True)
        joined = self.standing.joined
        previous = joined.key if joined is not None else None
        target = sealed.round + 1
        self.standing.joining = Joined(target, self._keys.join_key(target, self._node_id), sealed)
        return protocol.join(
            self._client, self._keys, self._node_id, value, lease, sealed, previous_key=previous
        )

    def _wait(
        self,
        round_: int,
        outcome: protocol.JoinOutcome,
        previous: Sealed,
        clock: JoinDeadline,
        recover_size: int | None = None,
        opened: Watch | None = None,
        evicts: bool = False,
    ) -> RoundResult | _Retry:
        """Wait on the watch until round ``round_`` is sealed; seal it when due
        (:func:`~etcd_rdzv.native.barrier.decide`).

        ``recover_size``: the size of our group in the previous round (``fast_recovery``). ``opened``: a
        ``ctl/`` watch opened before the join, used if it suffices, else cancelled (owned either way).
        ``evicts``: we observe the previous round for dead members (:mod:`~etcd_rdzv.native.leases`). An
        etcd failure other than a lost lease, a cancelled watch or a compaction withdraws the join and
        is raised.
        """
        s = self._settings
        view = RoundView(self._keys, round_, outcome.seq, outcome.create_revision, outcome.count,
                         outcome.prev_count, outcome.revision)
        state = Barrier.start(clock, join_counts(view), s, recover_size)
        wide = watches_previous(state, view, s)
        watch = open_watch(self._client, self._keys, round_, wide, opened)
        session = self.leases.hold_watch(watch)
        if session is None:
            return self._lease_lost(previous, clock)
        evictor = Evictor(s, self._client, self._keys, round_, session) if evicts else None
        w = RoundWait(s, self._client, self._keys, self._node_id, self.leases, round_, previous, view, state,
                      watch, wide, session, evictor=evictor, give_up=self._withdraw_if_unsealed)
        try:
            signal = w.run()
            return self._on_signal(signal, view, w.state)
        except SealedMeanwhile:
            return self._timed_out_late(round_)
        except EtcdCompactedError:
            log.warning("node %s: watch history compacted; re-reading the rendezvous", self._node_id)
            return _Retry(None, w.state.clock)
        except EtcdError:
            retry = self._retry_after_error(w)
            if retry is None:
                self._withdraw_after_error()
                raise
            return retry
        except ProtocolStateError:
            self._withdraw_after_error()
            raise
        finally:
            self.leases.release_watch(w.watch)

    def _retry_after_error(self, w: RoundWait) -> _Retry | None:
        """After an etcd failure of the wait: join again if our lease ended or a stale lease's ``on_lost``
        cancelled the watch; None to raise it. ``NodeShutDown`` if the node was stopped."""
        if self.shut_down:
            raise NodeShutDown(f"the handler of node {self._node_id} was shut down") from None
        if w.session.lost.is_set() or w.session.done().is_set():  # our lease ended: the join key is gone
            return self._lease_lost(w.previous, w.state.clock)
        if w.watch.cancelled:  # cancelled by a stale lease's on_lost: our lease is fine, join again
            log.info("node %s: its watch was cancelled; joining again", self._node_id)
            return _Retry(w.previous, w.state.clock)
        return None

    def _withdraw_after_error(self) -> None:
        """Withdraw our join if the round is unsealed (fenced Txn with a counter bump, at most
        :data:`WITHDRAW_TIMEOUT`), so no seal names a node that no longer waits. Best effort: else the
        key goes with the lease, at the next join or at exit; if sealed meanwhile, the next rendezvous
        reads our place."""
        try:
            self._withdraw_if_unsealed(timeout=WITHDRAW_TIMEOUT)
        except EtcdError as e:
            log.info("node %s could not withdraw its join after an error: %s", self._node_id, e)

    def _lease_lost(self, previous: Sealed, clock: JoinDeadline) -> _Retry:
        """Our lease ended while we waited (the join key is gone): join again with a new one."""
        self.standing.joined = None
        self.leases.drop()
        return _Retry(previous, clock)

    def _on_signal(self, signal: Signal, view: RoundView, state: Barrier) -> RoundResult | _Retry:
        s = self._settings
        if signal.kind is SignalKind.CLOSED:
            self._withdraw()
            if join_counts(view).kept_out(s):
                raise ClosedWhileKeptOut(
                    f"the rendezvous {s.run_id!r} was closed while node {self._node_id} waited "
                    "for room in a full group"
                )
            raise RunClosed(f"the rendezvous {s.run_id!r} was closed")
        if signal.kind is SignalKind.EVICTED:
            # Our key was deleted before the seal while we lived (a stall longer than our eviction bound):
            # we hold no place in this round; join again now rather than wait without a key.
            log.warning("node %s: its join key of round %d was evicted before the seal (etcd heard no renewal "
                        "of its lease in time); joining again", self._node_id, view.round)
            self.standing.joined = None
            return _Retry(self._sealed, state.clock)
        if signal.kind is SignalKind.RESET or signal.round != view.round:
            return _Retry(None, state.clock)
        sealed = signal.sealed
        self._learn(sealed)
        if sealed.membership is None:
            raise ProtocolStateError(
                f"{self._keys.sealed.decode()} names no members for round {sealed.round}"
            )
        place = verdict(sealed.membership, view.seq, view.create_revision, s)
        if isinstance(place, Undersized):
            log.warning(
                "round %d of %r sealed with %d members (< min_nodes=%d): void, joining the next",
                view.round, s.run_id, place.world_size, s.min_nodes,
            )
        elif isinstance(place, Admitted):
            return self.standing.admit(view.round, place.rank, place.world_size, sealed, self._node_id)
        self.standing.mark_joined(False)
        if state.timing_out:
            self._withdraw()
            raise RoundTimeout(
                f"node {self._node_id} was not admitted to a round of {s.run_id!r} within "
                f"join_timeout={s.join_timeout:g} s"
            )
        return _Retry(sealed, state.clock)

    def _timed_out_late(self, round_: int) -> RoundResult:
        """``join_timeout`` passed but ``round_`` was sealed before we could withdraw: read our place now
        (one read Txn and one Range; the watch may hang on a mute member). ``RoundTimeout`` (withdrawn
        first) if we are no member."""
        sealed = protocol.read_meta(self._client, self._keys).sealed
        self._learn(sealed)
        place = self._resolve(round_, sealed)
        if place is not None:
            return place
        self._withdraw()
        raise RoundTimeout(
            f"node {self._node_id} was not admitted to a round of {self._settings.run_id!r} within "
            f"join_timeout={self._settings.join_timeout:g} s"
        )

    def _resolve(self, round_: int, sealed: Sealed) -> RoundResult | None:
        """Our place in ``round_``, sealed while we were not watching; None if not a member.

        Only while ``round_`` is the last sealed round (:func:`~etcd_rdzv.native.barrier.resolved`). The
        members record is written by the seal Txn itself. One Range (none when sealed over).
        """
        members = None
        if sealed.round == round_:
            members, _ = protocol.read_members(self._client, self._keys, round_)
        place = resolved(members, self._node_id, round_, sealed.round, self._settings)
        if place is None:
            return None
        self.standing.mark_joined(True)
        return self.standing.admit(round_, place.rank, place.world_size, sealed, self._node_id)

    def _withdraw(self) -> None:
        """Delete our join key (run closed, or we gave up). One DeleteRange, best effort (else it goes
        with our lease)."""
        joined, self.standing.joined = self.standing.joined, None
        self.standing.member_round = None
        if joined is not None:
            try:
                self._client.delete(joined.key)
            except EtcdError as e:
                log.info("node %s could not withdraw %r: %s", self._node_id, joined.key, e)

    def _withdraw_if_unsealed(self, timeout: float | None = None) -> bool:
        """Withdraw unless our round was sealed since we joined (:func:`protocol.leave_if_unsealed`)."""
        joined = self.standing.joined
        if joined is None:
            return True
        if protocol.leave_if_unsealed(
            self._client, self._keys, joined.round, joined.key, joined.under, timeout=timeout
        ):
            self.standing.joined = None
            return True
        return False
