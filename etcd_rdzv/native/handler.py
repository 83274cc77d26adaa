"""``EtcdV3RendezvousHandler``: torch's ``RendezvousHandler`` contract on etcd v3 primitives.

One node = one handler = one lease (TTL ``lease_ttl``) refreshed over one
keep-alive stream. Joining a round is one transaction that puts a join key
bound to that lease; waiting is a watch on the run's ``ctl/`` keys that starts
right after the join's revision; sealing a round is one transaction fenced by
the ``sealed`` record's mod revision and by "the previous round is empty".
No node rewrites anything while a job runs: liveness is the lease alone.
See :mod:`etcd_rdzv.native.protocol` and the README's design note.

Cost of an uncontended ``next_rendezvous`` (node already holding its lease): one
read-only Txn, one join Txn, one watch; one seal Txn for one node per round;
plus the store bootstrap: one Txn for rank 0 (it publishes MASTER_ADDR/PORT in
the round's store), nothing for the others (the sealed record names rank 0's
address and port; the sealer reads rank 0's join key first, one Range, unless it
is rank 0).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from etcd_store.client import EtcdClient, Session, Watch, renewing_lease
from etcd_store.errors import EtcdCompactedError, EtcdError, EtcdTimeoutError

from . import bootstrap, protocol, queries
from .barrier import Admitted, Barrier, JoinClock, Seal, Tally, TimeOut, Void, decide, verdict
from .bootstrap import bootstrap_info, join_value
from .keys import RunKeys
from .records import ProtocolStateError, Sealed
from .settings import V3Settings
from .view import RoundView, Signal, SignalKind

if TYPE_CHECKING:
    from etcd_store import EtcdStore

log = logging.getLogger(__name__)

__all__ = ["BACKEND_NAME", "EtcdV3RendezvousHandler", "RoundResult"]

BACKEND_NAME = "etcd-v3"

_local_ids = itertools.count()


@dataclass(frozen=True)
class RoundResult:
    """The outcome of the barrier for one node: its place in a sealed round.

    ``seal_revision`` is the revision at which the round was sealed (the same
    for every member; 0 when it was learnt from the members record).
    """

    round: int
    rank: int
    world_size: int
    seal_revision: int
    node_id: str


@dataclass(frozen=True)
class _Joined:
    """The join key this node holds in ``round``.

    ``member``: True (member of the sealed round), False (the round was sealed
    without us: over ``max_nodes`` or void), None (not known: still waiting, or
    the wait ended with an error before the outcome was seen).
    """

    round: int
    key: bytes
    member: bool | None = None


@dataclass(frozen=True)
class _Retry:
    """Join again: from ``sealed`` when known, else after re-reading the run's records;
    ``clock`` is the ``join_timeout`` deadline as the wait left it."""

    sealed: Sealed | None
    clock: JoinClock


def _tally(view: RoundView) -> Tally:
    return Tally(view.count, view.before, view.prev_count, view.changes)


def _failed_on_master_alone(res: protocol.SealOutcome, previous: Sealed) -> bool:
    """Whether a failed seal's answer shows every condition but ``master``'s held."""
    return res.sealed.revision == previous.revision and not res.closed and res.prev_count == 0


class EtcdV3RendezvousHandler(RendezvousHandler):
    """A rendezvous over etcd v3 leases, transactions and watches (``--rdzv-backend=etcd-v3``).

    Args:
        settings: the rendezvous settings (:func:`~etcd_rdzv.conf.parse_v3_settings`).
        client: the etcd client. Several handlers may share one; each keeps its own
            lease, watch and keep-alive stream on it.
        owns_client: close ``client`` in :meth:`shutdown`.

    Thread safety: one ``next_rendezvous`` runs at a time per handler; the other
    methods may be called from any thread, also while it blocks.
    """

    def __init__(self, settings: V3Settings, client: EtcdClient, *, owns_client: bool = False) -> None:
        self._settings = settings
        self._client = client
        self._owns_client = owns_client
        self._keys = RunKeys.for_run(settings.key_prefix, settings.run_id)
        addr = settings.node_addr.replace("/", "_")
        self._node_id = f"{addr}_{os.getpid()}_{next(_local_ids)}_{uuid.uuid4().hex[:6]}"
        self._rdzv_lock = threading.Lock()
        self._lock = threading.Lock()
        self._session: Session | None = None  # this node's lease; it also keeps the run lease alive
        self._run_lease: int | None = None
        self._sealed = Sealed()  # the latest ``ctl/sealed`` this node saw (a guess, checked by each join)
        self._joined: _Joined | None = None
        self._member_round: int | None = None
        self._member_world = 0
        self._round_master: tuple[str, int] | None = None  # from the sealed record of our round
        self._watch: Watch | None = None
        self._shut_down = False
        self._store: EtcdStore | None = None
        self.last_round: RoundResult | None = None

    # ------------------------------------------------------------------ torch API

    def get_backend(self) -> str:
        """``"etcd-v3"``."""
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        """False: workers bootstrap from ``MASTER_ADDR``/``MASTER_PORT`` published per round."""
        return False

    @property
    def settings(self) -> V3Settings:
        return self._settings

    @property
    def node_id(self) -> str:
        """This handler's node id (the last part of its join keys)."""
        return self._node_id

    @property
    def keys(self) -> RunKeys:
        return self._keys

    def get_run_id(self) -> str:
        return self._settings.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """Block until this node is a member of a sealed round; see :meth:`next_round`.

        Then returns the round's ``EtcdStore`` (prefix ``rounds/<T>/store/``) and
        ``bootstrap_store_info`` built in that store (rank 0 publishes
        ``MASTER_ADDR`` and a free port of its own host, every round).
        """
        result = self.next_round()
        store = self._round_store(result.round)
        try:
            bootstrap = bootstrap_info(
                self._client, self._keys, result.round, result.rank, result.seal_revision, store,
                self._round_master, self._node_id, self._settings.node_addr,
            )
        except Exception as e:
            raise RendezvousConnectionError(
                f"Round {result.round} of the rendezvous {self._settings.run_id!r} was sealed, "
                f"but exchanging MASTER_ADDR/MASTER_PORT through its store failed: {e}"
            ) from e
        return RendezvousInfo(store, result.rank, result.world_size, bootstrap)

    def next_round(self) -> RoundResult:
        """The barrier of :meth:`next_rendezvous`, without the store (tests, benchmarks).

        Leaves the node's current round (if any) and blocks until a round that
        includes it is sealed. Raises ``RendezvousClosedError`` (run closed),
        ``RendezvousTimeoutError`` (``join_timeout``), ``RendezvousConnectionError``
        (etcd unreachable within ``read_timeout``), ``RendezvousStateError``
        (records this protocol never writes), ``RendezvousGracefulExitError``
        (closed while kept out by a full group).
        """
        with self._rdzv_lock:
            self._check_not_shut_down()
            clock = JoinClock.start(self._settings.join_timeout, time.monotonic())
            try:
                result = self._rendezvous(clock)
            except EtcdTimeoutError as e:
                raise RendezvousConnectionError(f"etcd did not answer in time: {e}") from e
            except EtcdError as e:
                if self._shut_down:
                    raise RendezvousClosedError("the handler was shut down") from e
                raise RendezvousConnectionError(str(e)) from e
            except ProtocolStateError as e:
                raise RendezvousStateError(f"rendezvous {self._settings.run_id!r}: {e}") from e
            self.last_round = result
            log.info(
                "node %s joined round %d of %r as rank %d of %d",
                self._node_id, result.round, self._settings.run_id, result.rank, result.world_size,
            )
            return result

    def is_closed(self) -> bool:
        """Whether the run is closed. One Range (none after :meth:`shutdown`, which closed it)."""
        if self._shut_down:
            return True
        try:
            return queries.is_closed(self._client, self._keys)
        except EtcdError as e:
            raise RendezvousConnectionError(str(e)) from e

    def set_closed(self) -> None:
        """Close the run for every node: a one-time put of ``ctl/closed``. One Txn
        (plus a Range, or a LeaseGrant and a Txn, if this node does not know the run lease yet).

        Raises ``RendezvousTimeoutError`` if etcd does not confirm within
        ``close_timeout`` (all calls together), ``RendezvousConnectionError`` on other
        etcd failures. A no-op after :meth:`shutdown` (which closed the run).
        """
        if self._shut_down:
            return
        self._close_run(time.monotonic() + self._settings.close_timeout)

    def _close_run(self, deadline: float) -> None:
        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EtcdTimeoutError(f"close_timeout={self._settings.close_timeout:g} s passed")
            return remaining

        def close(lease: int) -> bool:
            return protocol.close(self._client, self._keys, lease, timeout=left())

        try:
            if renewing_lease(close, lambda: self._run_lease_or_create(left()), self._forget_run_lease,
                              renewals=1):
                log.info("node %s closed the rendezvous %r", self._node_id, self._settings.run_id)
        except EtcdTimeoutError as e:
            raise RendezvousTimeoutError(f"closing the rendezvous timed out: {e}") from e
        except EtcdError as e:
            raise RendezvousConnectionError(str(e)) from e

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join the round after ours (one read-only Txn, no scan of keys).

        torch's agent calls this every monitor interval while its workers are
        healthy and re-rendezvous when it is positive. Returns:

        * at least 1 when the run is closed (so the agent re-rendezvous and learns it);
        * 0 while our round is full and intact (newcomers could not be admitted:
          torch's redundancy list);
        * the number of nodes joined in the next round otherwise;
        * at least 1 when our group lost a member (it died: its lease expired, or it
          left to re-join) or this node's own lease expired: the group is broken,
          so re-rendezvous now instead of waiting for the workers' collective timeout.
        """
        if self._shut_down:
            return 0
        member_round, world_size = self._member_round, self._member_world
        try:
            round_ = member_round
            if round_ is None:
                round_ = queries.read_meta(self._client, self._keys).sealed.round
            occ = queries.count_waiting(self._client, self._keys, round_)
        except EtcdError as e:
            raise RendezvousConnectionError(str(e)) from e
        if occ.closed:
            # torch's agent polls only this while its workers run: a positive count
            # makes it stop them and call next_rendezvous(), which raises
            # RendezvousClosedError, so a run closed from outside ends every agent.
            return max(occ.waiting, 1)
        if member_round is not None:
            session = self._session
            if session is None or session.done().is_set() or occ.active < world_size:
                return max(occ.waiting, 1)
        return occ.waiting if occ.active < self._settings.max_nodes else 0

    def shutdown(self) -> bool:
        """Close the run (as torch's handlers do), revoke this node's lease, release resources.

        Revoking the lease deletes this node's join keys at once. The last node to
        leave also deletes the rounds' stores. Returns False if closing failed
        (then the lease is left to expire). Takes at most about ``close_timeout``.
        """
        if self._shut_down:
            return True
        deadline = time.monotonic() + self._settings.close_timeout
        ok = True
        try:
            self._close_run(deadline)
        except RendezvousError as e:
            log.warning("node %s could not close the rendezvous %r: %s", self._node_id,
                        self._settings.run_id, e)
            ok = False
        with self._lock:
            self._shut_down = True
            watch, self._watch = self._watch, None
            session, self._session = self._session, None
        if watch is not None:
            watch.cancel()
        self._close_store()
        self._joined = None
        self._member_round = None
        if ok:  # etcd answers: release our keys now, and the rounds' records if we are last
            if session is not None:
                session.close(revoke=True, timeout=max(deadline - time.monotonic(), 1.0))
            try:
                protocol.remove_round_records_if_idle(
                    self._client, self._keys, timeout=max(deadline - time.monotonic(), 1.0)
                )
            except EtcdError as e:
                log.info("could not remove the round records of %r: %s", self._settings.run_id, e)
        elif session is not None:  # unreachable: our keys go when the lease expires
            session.close(revoke=False)
        if self._owns_client:
            self._client.close()
        return ok

    # ------------------------------------------------------------------ leases

    def _check_not_shut_down(self) -> None:
        if self._shut_down:
            raise RendezvousClosedError(f"the handler of node {self._node_id} was shut down")

    def _ensure_lease(self) -> int:
        """This node's lease: a new session if there is none or it ended. 0-1 LeaseGrant."""
        with self._lock:
            self._check_not_shut_down()
            session = self._session
            if session is not None and not session.done().is_set():
                return session.id
            if session is not None:
                log.warning("node %s lost its lease; joining with a new one", self._node_id)
            session = self._client.session(self._settings.lease_ttl)
            self._session = session
            self._joined = None  # keys bound to the old lease are gone
            if self._run_lease is not None:
                session.keep_also(self._run_lease)
            return session.id

    def _forget_lease(self, lease: int) -> None:
        """End the session of a lease etcd no longer knows, so the next join grants a new one."""
        session = self._session
        if session is not None and session.id == lease:
            session.close(revoke=False)

    def _drop_lease(self) -> None:
        """Our join key vanished with our lease: end its session (see :meth:`_forget_lease`)."""
        session = self._session
        if session is not None:
            self._forget_lease(session.id)

    def _learn(self, sealed: Sealed) -> None:
        """Remember the latest sealed record and help keep the run lease it names alive."""
        self._sealed = sealed
        if sealed.run_lease is not None:
            self._adopt_run_lease(sealed.run_lease)

    def _adopt_run_lease(self, lease: int) -> None:
        if lease != self._run_lease:
            self._run_lease = lease
            session = self._session
            if session is not None:
                session.keep_also(lease)

    def _run_lease_or_create(self, timeout: float | None = None) -> int:
        return self._run_lease if self._run_lease is not None else self._create_run_lease(timeout)

    def _forget_run_lease(self, lease: int) -> None:
        """The run lease expired (``ctl/run`` went with it): the next use creates a new one."""
        if self._run_lease == lease:
            self._run_lease = None

    def _create_run_lease(self, timeout: float | None = None) -> int:
        """The run lease of ``ctl/run``, created if absent (sealers and closers only)."""
        lease = protocol.ensure_run_lease(
            self._client, self._keys, self._settings.state_ttl, timeout=timeout
        )
        self._adopt_run_lease(lease)
        return lease

    # ------------------------------------------------------------------ the barrier

    def _rendezvous(self, clock: JoinClock) -> RoundResult:
        """Join rounds until one that includes us is sealed.

        The first join assumes the last sealed record this node saw; a stale guess
        costs one failed join, whose answer carries the current record.
        """
        keys, client = self._keys, self._client
        value = join_value(self._settings.node_addr)  # one free port per next_round call
        # The group this node leaves: a round that only re-forms it may skip the last call.
        prior_round, prior_world = self._member_round, self._member_world
        self._member_round = None
        self._round_master = None
        sealed = self._sealed
        fresh_read = False
        while True:
            if fresh_read:
                meta = queries.read_meta(client, keys)
                if meta.closed:
                    self._withdraw()
                    raise RendezvousClosedError(f"the rendezvous {self._settings.run_id!r} is closed")
                sealed, fresh_read = meta.sealed, False
            self._learn(sealed)
            joined = self._joined
            if joined is not None and joined.member is None and joined.round <= sealed.round:
                # Our round was sealed while we were not watching (watch lost, error).
                resolved = self._resolve(joined.round, sealed)
                if resolved is not None:
                    return resolved
            outcome = renewing_lease(
                functools.partial(self._join, sealed, value), self._ensure_lease, self._forget_lease
            )
            if not outcome.ok:
                if outcome.joined_anyway:
                    # A lost answer hid a join that did apply; its round is sealed now.
                    target = sealed.round + 1
                    self._joined = _Joined(target, keys.join_key(target, self._node_id))
                if outcome.closed:
                    self._withdraw()
                    raise RendezvousClosedError(f"the rendezvous {self._settings.run_id!r} is closed")
                sealed = outcome.sealed
                continue
            target = sealed.round + 1
            key = keys.join_key(target, self._node_id)
            self._joined = _Joined(target, key)
            log.debug("node %s joined round %d at revision %d", self._node_id, target, outcome.revision)
            recovering = self._settings.fast_recovery and prior_round == target - 1
            waited = self._wait(target, outcome, sealed, clock, value, prior_world if recovering else None)
            if isinstance(waited, RoundResult):
                self._joined = _Joined(target, key, member=True)
                return waited
            clock = waited.clock
            if waited.sealed is None:
                fresh_read = True
            else:
                sealed = waited.sealed

    def _join(self, sealed: Sealed, value: bytes, lease: int) -> protocol.JoinOutcome:
        """One join Txn with ``lease``, leaving our previous key (if its lease is still ours)."""
        previous = self._joined.key if self._joined is not None else None
        return protocol.join(
            self._client, self._keys, self._node_id, value, lease, sealed, previous_key=previous
        )

    def _wait(
        self,
        round_: int,
        outcome: protocol.JoinOutcome,
        previous: Sealed,
        clock: JoinClock,
        value: bytes,
        recover_size: int | None = None,
    ) -> RoundResult | _Retry:
        """Wait on the ``ctl/`` watch until round ``round_`` is sealed; seal it when due.

        Acts on what :func:`~etcd_rdzv.native.barrier.decide` says (when a round
        is due is defined there); ``recover_size`` is the size of the group this
        node was a member of in the previous round (``fast_recovery``).
        """
        s = self._settings
        view = RoundView(
            self._keys, round_, self._node_id, outcome.create_revision, outcome.before,
            outcome.prev_count, outcome.revision,
        )
        view.after.update(outcome.after)
        watch = self._client.watch(self._keys.ctl, self._keys.ctl_end, start_revision=outcome.revision + 1)
        with self._lock:
            if self._shut_down:
                watch.cancel()
                raise RendezvousClosedError(f"the handler of node {self._node_id} was shut down")
            self._watch = watch
        state = Barrier.start(clock, _tally(view), s, recover_size)
        try:
            while True:
                state, action = decide(state, _tally(view), s, time.monotonic())
                if isinstance(action, Seal):
                    state = state.sealed(self._try_seal(round_, previous, view, value))
                    continue
                if isinstance(action, TimeOut):
                    if self._withdraw_if_unsealed(previous):
                        raise RendezvousTimeoutError(
                            f"node {self._node_id}: round {round_} of the rendezvous "
                            f"{s.run_id!r} was not sealed within join_timeout={s.join_timeout:g} s "
                            f"({view.count} of min_nodes={s.min_nodes} joined"
                            f"{'' if view.vacated else ', previous round still running'})"
                        )
                    state = state.timed_out_late()  # sealed meanwhile: its event is on the way
                    continue
                timeout = None if action.at is None else max(action.at - time.monotonic(), 0.0)
                for event in watch.get(timeout=timeout):
                    signal = view.apply(event)
                    if signal is not None:
                        return self._on_signal(signal, view, previous, state)
        except EtcdCompactedError:
            log.warning("node %s: watch history compacted; re-reading the rendezvous", self._node_id)
            return _Retry(None, state.clock)
        except EtcdError:
            if self._shut_down:
                raise RendezvousClosedError(f"the handler of node {self._node_id} was shut down") from None
            raise
        finally:
            with self._lock:
                if self._watch is watch:
                    self._watch = None
            watch.cancel()

    def _try_seal(self, round_: int, previous: Sealed, view: RoundView, value: bytes) -> bool:
        """One seal attempt (and the run lease, the first time); whether we sealed.

        The sealed record also names rank 0's address and port (see
        :func:`~etcd_rdzv.native.bootstrap.master_of`), so that no member has to read them after the seal.
        """
        master = bootstrap.master_of(self._client, self._keys, view, self._node_id, value)

        def seal(lease: int) -> protocol.SealOutcome:
            res = protocol.seal(self._client, self._keys, round_, previous, lease, master=master)
            if not res.ok and master is not None and _failed_on_master_alone(res, previous):
                # Rank 0's key changed since we read it: seal without naming it.
                res = protocol.seal(self._client, self._keys, round_, previous, lease)
            return res

        res = renewing_lease(seal, self._run_lease_or_create, self._forget_run_lease, renewals=1)
        if res.ok:
            log.debug("node %s sealed round %d at revision %d", self._node_id, round_, res.revision)
        return res.ok

    def _on_signal(self, signal: Signal, view: RoundView, previous: Sealed, state: Barrier) -> RoundResult | _Retry:
        s = self._settings
        tally = _tally(view)
        if signal.kind is SignalKind.CLOSED:
            self._withdraw()
            if tally.kept_out(s):
                raise RendezvousGracefulExitError(
                    f"the rendezvous {s.run_id!r} was closed while node {self._node_id} waited "
                    "for room in a full group"
                )
            raise RendezvousClosedError(f"the rendezvous {s.run_id!r} was closed")
        if signal.kind is SignalKind.LOST:
            self._joined = None
            self._drop_lease()
            return _Retry(previous, state.clock)
        if signal.kind is SignalKind.RESET or signal.round != view.round:
            return _Retry(None, state.clock)
        sealed = Sealed(signal.round, signal.revision, signal.run_lease, signal.master)
        self._learn(sealed)
        if state.sealed_by_me:
            self._record_members(view, sealed)
        place = verdict(tally, s)
        if isinstance(place, Void):
            log.warning(
                "round %d of %r sealed with %d joiners (< min_nodes=%d): void, joining the next",
                view.round, s.run_id, place.world_size, s.min_nodes,
            )
        elif isinstance(place, Admitted):
            self._member_round, self._member_world = view.round, place.world_size
            self._round_master = signal.master
            return RoundResult(view.round, place.rank, place.world_size, signal.revision, self._node_id)
        self._joined = _Joined(view.round, self._keys.join_key(view.round, self._node_id), member=False)
        if state.timing_out:
            self._withdraw()
            raise RendezvousTimeoutError(
                f"node {self._node_id} was not admitted to a round of {s.run_id!r} within "
                f"join_timeout={s.join_timeout:g} s"
            )
        return _Retry(sealed, state.clock)

    def _record_members(self, view: RoundView, sealed: Sealed) -> None:
        """Write the members record of a round we sealed (for resync and inspection)."""
        s = self._settings
        try:
            if view.before == 0:
                members = [self._node_id, *view.members_after_us()][: s.max_nodes]
            else:
                members = queries.snapshot_members(
                    self._client, self._keys, view.round, sealed.revision, s.max_nodes
                )
            run_lease = self._run_lease
            if run_lease is not None:
                protocol.write_members(self._client, self._keys, view.round, members, run_lease)
        except EtcdError as e:
            log.warning("could not record the members of round %d: %s", view.round, e)

    def _resolve(self, round_: int, sealed: Sealed) -> RoundResult | None:
        """Our place in ``round_``, sealed while we were not watching; None if not a member."""
        s = self._settings
        members, _ = queries.read_members(self._client, self._keys, round_)
        if members is None:
            if sealed.round != round_:
                # A later round was sealed, so ours was vacated: our key is gone (lease
                # expired), and whatever group we were in has been replaced.
                return None
            members = queries.snapshot_members(
                self._client, self._keys, round_, sealed.revision, s.max_nodes
            )
        if len(members) < s.min_nodes or self._node_id not in members:
            return None
        self._member_round, self._member_world = round_, len(members)
        self._joined = _Joined(round_, self._keys.join_key(round_, self._node_id), member=True)
        revision = sealed.revision if sealed.round == round_ else 0
        return RoundResult(round_, members.index(self._node_id), len(members), revision, self._node_id)

    def _withdraw(self) -> None:
        """Delete our join key (the run is closed or we gave up). One DeleteRange,
        best effort: if it fails, the key goes with our lease at shutdown."""
        joined, self._joined = self._joined, None
        self._member_round = None
        if joined is not None:
            try:
                self._client.delete(joined.key)
            except EtcdError as e:
                log.info("node %s could not withdraw %r: %s", self._node_id, joined.key, e)

    def _withdraw_if_unsealed(self, previous: Sealed) -> bool:
        joined = self._joined
        if joined is None:
            return True
        if protocol.leave_if_unsealed(self._client, self._keys, joined.key, previous):
            self._joined = None
            return True
        return False

    # ------------------------------------------------------------------ the store

    def _round_store(self, round_: int) -> EtcdStore:
        """The round's ``EtcdStore``; the store of our previous round is closed.

        Its keys are bound to the run lease (they go when a later seal deletes old
        rounds, when the last node leaves, or with the run lease); without a known
        run lease the store keeps a namespace lease of TTL ``state_ttl`` instead."""
        from etcd_store import EtcdStore

        self._close_store()
        try:
            # The round's keys ride on the run lease, which every node keeps alive
            # already: opening the store costs no RPC and no keep-alive of its own.
            store = EtcdStore(
                self._client,
                prefix=self._keys.store_prefix(round_),
                timeout=timedelta(seconds=self._client.timeout),
                lease_ttl=max(self._settings.state_ttl, 2),
                lease=self._run_lease,
            )
        except Exception as e:
            raise RendezvousConnectionError(
                f"cannot open the store of round {round_} of {self._settings.run_id!r}: {e}"
            ) from e
        self._store = store
        return store

    def _close_store(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.close()

    def __repr__(self) -> str:
        return f"EtcdV3RendezvousHandler(run_id={self._settings.run_id!r}, node={self._node_id!r})"
