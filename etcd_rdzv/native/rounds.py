"""One node's part in the rounds of an ``etcd-v3`` run: join, wait, seal, close.

:class:`Participant` holds what a node knows of the run (the last sealed record it
saw), where it stands in the rounds (a :class:`~etcd_rdzv.native.barrier.Standing`:
the join it holds, the round it is a member of) and its leases (a
:class:`~etcd_rdzv.native.leases.NodeLeases`), which it holds and calls, and strings
the transactions of :mod:`etcd_rdzv.native.protocol` together:
:meth:`Participant.rendezvous` joins rounds until one that includes this node is
sealed; each wait on the watch of the run's ``ctl/`` keys is a
:class:`~etcd_rdzv.native.wait.RoundWait` (which acts on
:func:`~etcd_rdzv.native.barrier.decide`), and the participant acts on the signal
that ends it. A lease etcd reports gone is replaced and the write sent again, through
:func:`~etcd_store.client.renewing_lease`. The torch-facing handler
(:mod:`etcd_rdzv.native.handler`) owns one and translates its errors.

Blocks: :meth:`~Participant.rendezvous` (until sealed, closed, or
``join_timeout``), :meth:`~Participant.leave` and :meth:`~Participant.close_run`
(at most until their deadline).
Raises :class:`~etcd_store.errors.EtcdError` subclasses,
:class:`~etcd_rdzv.native.records.ProtocolStateError` and the node's own errors
(:class:`~etcd_rdzv.native.records.NodeError`: run closed, ``join_timeout``, shut down) where the
run's state decides the outcome; only the handler translates them to torch's.
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
"""Seconds the withdrawal of a join may take when a wait ended with an error (the error
is raised after it: a longer bound would only delay it)."""


@dataclass(frozen=True)
class _Retry:
    """Join again: from ``sealed`` when known, else after re-reading the run's records;
    ``clock`` is the ``join_timeout`` deadline as the wait left it."""

    sealed: Sealed | None
    clock: JoinDeadline


class Participant:
    """One node of the run: its place in the rounds (see the module docstring).

    ``leases`` (its :class:`~etcd_rdzv.native.leases.NodeLeases`; ``session``,
    ``run_lease`` and ``shut_down`` read through to it) and ``standing`` (its
    :class:`~etcd_rdzv.native.barrier.Standing`: the round this node is a member of, its
    size, rank 0's address from its sealed record) are read by the handler.
    One :meth:`rendezvous` at a time; :meth:`stop` may be called from any thread.
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
        """Stop for good: cancel a wait's watch, forget the round; returns the lease session to
        close (no RPC)."""
        session = self.leases.stop()
        self.standing.forget()
        return session

    def leave(self, deadline: float) -> bool:
        """Stop for good and release this node's keys now, without closing the run.

        Withdraws a join from a round that may be unsealed (one Txn each, see
        :func:`protocol.leave_if_unsealed`), then revokes the node's lease (one
        LeaseRevoke: its join key vanishes with it), every RPC bounded by ``deadline``.
        Returns whether etcd confirmed the revoke; never raises for etcd failures.
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
            # Waiting in a round that may be unsealed: withdraw with a bump of its join
            # counter, so that no seal prepared before names us (a bare revoke would not).
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
        """Put our join key back into the round we are a member of, with a new lease.

        For a member whose lease ended (etcd was out of reach for longer than its TTL)
        while its group still runs: one LeaseGrant and one Txn
        (:func:`protocol.reattach`), which succeeds only if no round was sealed since
        ours and the run is open. Returns the group's counts after it, or None when
        the node cannot re-attach (sealed over, closed, or its round's seal revision
        is not known): its group is over. A lease etcd refuses is replaced once
        (:func:`~etcd_store.client.renewing_lease`). Raises ``EtcdError`` if etcd fails and
        :class:`~etcd_rdzv.native.records.NodeShutDown` once stopped.
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
        """This node's lease (:meth:`NodeLeases.ensure`); a new one forgets our join key
        (it went with the old lease). 0-1 LeaseGrant."""
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

        The first join assumes the last sealed record this node saw; a stale guess
        costs one failed join, whose answer carries the current record. Raises
        :class:`~etcd_rdzv.native.records.RunClosed` (also :class:`ClosedWhileKeptOut`),
        :class:`~etcd_rdzv.native.records.RoundTimeout`,
        :class:`~etcd_rdzv.native.records.NodeShutDown`, ``ProtocolStateError`` and
        ``EtcdError`` subclasses.
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
        """Confirm the round :meth:`rendezvous` admitted us to and wait for its fate
        (:func:`~etcd_rdzv.native.start.start_round`): True once every member confirmed it, False
        when it was voided (a member left first: the next :meth:`rendezvous` re-joins as a member of
        it). Waits at most ``join_timeout``, and at least two lease TTLs (a dead member's key goes
        within one); raises :class:`~etcd_rdzv.native.records.RoundTimeout` (after withdrawing) when
        that passes undecided, and ``EtcdError`` subclasses."""
        wait = max(self._settings.join_timeout, 2.0 * self._settings.lease_ttl)
        fate = start_round(self._client, self._keys, admitted.round, admitted.world_size, self._node_id,
                           self.run_lease or 0, time.monotonic() + wait)
        if fate is None:
            self._withdraw()
            raise RoundTimeout(
                f"round {admitted.round} of {self._settings.run_id!r} was not confirmed by all of its "
                f"{admitted.world_size} members in time (node {self._node_id})"
            )
        return fate

    def _read_sealed(self) -> Sealed:
        """The run's current sealed record (one read-only Txn); raises
        :class:`~etcd_rdzv.native.records.RunClosed` (after withdrawing) if the run is closed."""
        meta = protocol.read_meta(self._client, self._keys)
        if meta.closed:
            self._withdraw()
            raise RunClosed(f"the rendezvous {self._settings.run_id!r} is closed")
        return meta.sealed

    def _resolve_unseen(self, sealed: Sealed) -> RoundResult | None:
        """Our place in the round we joined if it was sealed while we were not watching
        (watch lost, error): :meth:`_resolve`. None if not known to be sealed, or not ours."""
        joined = self.standing.joined
        if joined is not None and joined.member is None and joined.round <= sealed.round:
            return self._resolve(joined.round, sealed)
        return None

    def _join_and_wait(self, sealed: Sealed, value: bytes, clock: JoinDeadline,
                       prior: PreviousGroup) -> RoundResult | _Retry:
        """Join round ``sealed.round + 1`` and wait in it (:meth:`_wait`).

        The control watch opens before the join (while the lease is granted) and the join
        waits for etcd to confirm it, so the watch starts below the join's revision and no
        catch-up read is needed (see :meth:`RoundWait.catch_up
        <etcd_rdzv.native.wait.RoundWait.catch_up>`). A lease etcd reports gone is
        replaced and the join sent again (:func:`~etcd_store.client.renewing_lease`).
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
            self.standing.joined, self.standing.joining = Joined(target, key, sealed), None
            log.debug("node %s joined round %d at revision %d (join %d of the round, %d present)",
                      self._node_id, target, outcome.revision, outcome.seq, outcome.count)
            self.observer.joined(target, outcome.count)
            follows = prior.round == target - 1
            recovering = self._settings.fast_recovery and follows
            waited = self._wait(target, outcome, sealed, clock, prior.world if recovering else None,
                                opened=ctl_watch, evicts=prior.evicts and follows)
        if isinstance(waited, RoundResult):
            self.standing.joined = Joined(target, key, sealed, member=True)
        return waited

    def _join_failed(self, outcome: protocol.JoinOutcome, sealed: Sealed, clock: JoinDeadline) -> _Retry:
        """A join whose fences failed: join again from the record its answer carries; raises
        :class:`~etcd_rdzv.native.records.RunClosed` (after withdrawing) if the run is closed."""
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
        """One join Txn with ``lease``, leaving our previous key (if its lease is still ours);
        first waits (at most the client's timeout) for etcd to confirm the watch ``ready``,
        and sends nothing if that watch failed.

        The join is recorded as in flight (``Standing.joining``) before it is sent: a leave at exit
        (a signal may end the process between the Txn and the recording of its answer)
        withdraws it with a bump of the join counter, as it withdraws a recorded join."""
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
        """Wait on the watch until round ``round_`` is sealed; seal it when due.

        Acts on what :func:`~etcd_rdzv.native.barrier.decide` says (when a round
        is due is defined there); ``recover_size`` is the size of the group this
        node was a member of in the previous round (``fast_recovery``). The watch
        covers ``ctl/``, and the join keys of the previous round while this node
        must tell when it empties (a candidate, or kept out by a full group).
        ``opened``: a watch of ``ctl/`` alone, opened before the join; used when that
        range suffices, else cancelled (this method owns it either way). ``evicts``: this
        node was a member of the previous round, one of its observers, and evicts dead
        members of it while it waits (:mod:`~etcd_rdzv.native.leases`). An etcd failure
        that is not a lost lease, a cancelled watch or a compaction withdraws the join
        (:meth:`_withdraw_after_error`) and is raised.
        """
        s = self._settings
        view = RoundView(
            self._keys, round_, self._node_id, outcome.seq, outcome.create_revision, outcome.count,
            outcome.prev_count, outcome.revision,
        )
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
            return self._on_signal(signal, view, previous, w.state)
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
        """After an etcd failure of the wait: join again if it only means our lease ended
        (the join key is gone) or a stale lease's ``on_lost`` cancelled the watch; None if
        the failure is to be raised. Raises :class:`~etcd_rdzv.native.records.NodeShutDown`
        if the node was stopped (that cancelled the watch)."""
        if self.shut_down:
            raise NodeShutDown(f"the handler of node {self._node_id} was shut down") from None
        if w.session.lost.is_set() or w.session.done().is_set():  # our lease ended: the join key is gone
            return self._lease_lost(w.previous, w.state.clock)
        if w.watch.cancelled:  # cancelled by a stale lease's on_lost: our lease is fine, join again
            log.info("node %s: its watch was cancelled; joining again", self._node_id)
            return _Retry(w.previous, w.state.clock)
        return None

    def _withdraw_after_error(self) -> None:
        """The wait ends with an error: withdraw our join if the round is still unsealed (one
        fenced Txn with a bump of the join counter, at most :data:`WITHDRAW_TIMEOUT`), so that
        no seal names a node that no longer waits. Best effort: if etcd does not answer, the
        key goes with the lease, at the next join (it deletes it) or at exit (leave); if the
        round was sealed meanwhile, the next rendezvous reads our place in it."""
        try:
            self._withdraw_if_unsealed(timeout=WITHDRAW_TIMEOUT)
        except EtcdError as e:
            log.info("node %s could not withdraw its join after an error: %s", self._node_id, e)

    def _lease_lost(self, previous: Sealed, clock: JoinDeadline) -> _Retry:
        """Our lease ended while we waited: its join key is gone; join again with a new one."""
        self.standing.joined = None
        self.leases.drop()
        return _Retry(previous, clock)

    def _on_signal(self, signal: Signal, view: RoundView, previous: Sealed, state: Barrier) -> RoundResult | _Retry:
        s = self._settings
        if signal.kind is SignalKind.CLOSED:
            self._withdraw()
            if join_counts(view).kept_out(s):
                raise ClosedWhileKeptOut(
                    f"the rendezvous {s.run_id!r} was closed while node {self._node_id} waited "
                    "for room in a full group"
                )
            raise RunClosed(f"the rendezvous {s.run_id!r} was closed")
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
        """``join_timeout`` passed, but ``round_`` was sealed before we could withdraw: our place in
        it, read now (one read Txn and one Range), not awaited from the watch, which may hear nothing
        for long (a stream on a member that answers nothing). :class:`RoundTimeout` (withdrawn
        first) if we are no member of it."""
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

        Only while ``round_`` is the last sealed round (:func:`~etcd_rdzv.native.barrier.resolved`:
        a later seal found ``round_`` empty, so our group re-formed without us). The members
        record is written by the seal transaction itself. One Range (none when sealed over)."""
        members = None
        if sealed.round == round_:
            members, _ = protocol.read_members(self._client, self._keys, round_)
        place = resolved(members, self._node_id, round_, sealed.round, self._settings)
        if place is None:
            return None
        self.standing.mark_joined(True)
        return self.standing.admit(round_, place.rank, place.world_size, sealed, self._node_id)

    def _withdraw(self) -> None:
        """Delete our join key (the run is closed or we gave up). One DeleteRange,
        best effort: if it fails, the key goes with our lease at shutdown."""
        joined, self.standing.joined = self.standing.joined, None
        self.standing.member_round = None
        if joined is not None:
            try:
                self._client.delete(joined.key)
            except EtcdError as e:
                log.info("node %s could not withdraw %r: %s", self._node_id, joined.key, e)

    def _withdraw_if_unsealed(self, timeout: float | None = None) -> bool:
        """Withdraw from the round we wait in unless it was sealed since we joined (one Txn
        that also bumps the round's join counter, see :func:`protocol.leave_if_unsealed`)."""
        joined = self.standing.joined
        if joined is None:
            return True
        if protocol.leave_if_unsealed(
            self._client, self._keys, joined.round, joined.key, joined.under, timeout=timeout
        ):
            self.standing.joined = None
            return True
        return False
