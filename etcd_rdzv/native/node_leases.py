"""A node's leases in an ``etcd-v3`` run: its lease session, the run lease, leaving and closing.

:class:`NodeLeases` is the base of :class:`~etcd_rdzv.native.rounds.Participant`:
the node's lease :class:`~etcd_store.client.Session` (granted at its first join,
replaced when etcd reports it gone; it also keeps the run lease alive), the run
lease that holds the round records (created by the first sealer or closer),
:meth:`NodeLeases.leave` (revoke without closing the run), :meth:`NodeLeases.close_run`
(close, or abort: also stop the members that run), and :meth:`NodeLeases.reattach` (a member whose lease ended while its group runs).
It reads the round state that :class:`Participant` keeps (``_joined``,
``member_round``, ``member_seal``, ``_join_value``, ``_watch``).

Blocks: :meth:`~NodeLeases.leave` and :meth:`~NodeLeases.close_run` at most until
their deadline; the others make at most the RPCs their docstrings name.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from etcd_store.client import EtcdClient, Session, Watch, renewing_lease
from etcd_store.errors import EtcdError, EtcdTimeoutError

from . import protocol, queries
from .errors import NodeShutDown
from .keys import RunKeys
from .records import Sealed
from .settings import V3Settings
from .telemetry import RoundObserver

log = logging.getLogger(__name__)

__all__ = ["NodeLeases"]


@dataclass(frozen=True)
class _Joined:
    """The join key this node holds in ``round``.

    ``member``: True (member of the sealed round), False (the round was sealed
    without us: over ``max_nodes`` or void), None (not known: still waiting, or
    the wait ended with an error before the outcome was seen).
    """

    round: int
    key: bytes
    under: Sealed  # the sealed record the join was fenced on (round - 1 sealed at its revision)
    member: bool | None = None


class NodeLeases:
    """The lease part of one node of the run (see the module docstring)."""

    _settings: V3Settings
    _client: EtcdClient
    _keys: RunKeys
    _node_id: str
    _lock: threading.Lock
    observer: RoundObserver
    session: Session | None
    run_lease: int | None
    shut_down: bool
    _sealed: Sealed
    _joined: _Joined | None
    _joining: _Joined | None
    member_round: int | None
    member_seal: int
    _join_value: bytes
    _watch: Watch | None

    def _on_lease_lost(self) -> None:
        """``on_lost`` of this node's lease session: wake a waiting node (its key is gone)."""
        with self._lock:
            watch = self._watch
        if watch is not None:
            watch.cancel()

    def stop(self) -> Session | None:
        """Stop for good: cancel a wait's watch, forget the round; returns the lease session to close."""
        with self._lock:
            self.shut_down = True
            watch, self._watch = self._watch, None
            session, self.session = self.session, None
        if watch is not None:
            watch.cancel()
        self._joined = self._joining = None
        self.member_round = None
        return session

    def leave(self, deadline: float) -> bool:
        """Stop for good and release this node's keys now, without closing the run.

        Revokes the node's lease (one LeaseRevoke: its join key vanishes with it), every
        RPC bounded by ``deadline``. Returns whether etcd confirmed it.
        """
        # The join in flight first: a signal may have ended the process between its Txn and the
        # recording of its answer, so that the key exists though _joined does not name it.
        pending = [j for j in (self._joining, self._joined) if j is not None and not j.member]
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
        session.close(revoke=False)  # stop refreshing; the revoke below says whether it worked
        remaining = deadline - time.monotonic()
        if remaining <= 0 or session.lost.is_set():
            return session.lost.is_set()
        try:
            self._client.lease_revoke(session.id, timeout=remaining)
        except EtcdError as e:
            log.info("node %s could not revoke its lease %x: %s", self._node_id, session.id, e)
            return False
        return True

    # ------------------------------------------------------------------ leases and closing

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

        if renewing_lease(close, lambda: self._run_lease_or_create(left()), self._forget_run_lease,
                          renewals=1):
            log.info("node %s %s the rendezvous %r", self._node_id, "aborted" if abort else "closed",
                     self._settings.run_id)

    def check_not_shut_down(self) -> None:
        if self.shut_down:
            raise NodeShutDown(f"the handler of node {self._node_id} was shut down")

    def _ensure_lease(self) -> int:
        """This node's lease: a new session if there is none or it ended. 0-1 LeaseGrant."""
        with self._lock:
            self.check_not_shut_down()
            session = self.session
            if session is not None and not session.done().is_set():
                return session.id
            if session is not None:
                log.warning("node %s lost its lease; joining with a new one", self._node_id)
                self.observer.lease_lost()
            self._joined = None  # keys bound to the old lease are gone
            return self._new_session_locked().id

    def _new_session_locked(self) -> Session:
        """A new lease session for this node (one LeaseGrant), also keeping the run lease alive."""
        session = self._client.session(self._settings.lease_ttl, on_lost=self._on_lease_lost,
                                       interval=self._settings.renew_every)
        self.session = session
        if self.run_lease is not None:
            session.keep_also(self.run_lease)
        return session

    def reattach(self) -> queries.Occupancy | None:
        """Put our join key back into the round we are a member of, with a new lease.

        For a member whose lease ended (etcd was out of reach for longer than its TTL)
        while its group still runs: one LeaseGrant and one Txn
        (:func:`protocol.reattach`), which succeeds only if no round was sealed since
        ours and the run is open. Returns the group's counts after it, or None when
        the node cannot re-attach (sealed over, closed, or its round's seal revision
        is not known): its group is over. Raises ``EtcdError`` if etcd fails.
        """
        joined, round_ = self._joined, self.member_round
        if round_ is None or not self.member_seal or joined is None or joined.round != round_:
            return None
        with self._lock:
            self.check_not_shut_down()
            old = self.session
            session = self._new_session_locked()
        if old is not None:
            old.close(revoke=False)  # its lease is gone (our key went with it)
        self.observer.lease_lost()
        occ = protocol.reattach(self._client, self._keys, round_, joined.key, self._join_value,
                                session.id, self.member_seal)
        if occ is None:
            log.warning("node %s cannot re-attach to round %d: a later round was sealed or the run "
                        "closed", self._node_id, round_)
        else:
            log.warning("node %s re-attached to round %d with a new lease %x after its lease ended",
                        self._node_id, round_, session.id)
        return occ

    def _forget_lease(self, lease: int) -> None:
        """End the session of a lease etcd no longer knows, so the next join grants a new one."""
        session = self.session
        if session is not None and session.id == lease:
            session.close(revoke=False)

    def _drop_lease(self) -> None:
        """Our join key vanished with our lease: end its session (see :meth:`_forget_lease`)."""
        session = self.session
        if session is not None:
            self._forget_lease(session.id)

    def _learn(self, sealed: Sealed) -> None:
        """Remember the latest sealed record and help keep the run lease it names alive."""
        self._sealed = sealed
        if sealed.run_lease is not None:
            self._adopt_run_lease(sealed.run_lease)

    def _adopt_run_lease(self, lease: int) -> None:
        if lease != self.run_lease:
            self.run_lease = lease
            session = self.session
            if session is not None:
                session.keep_also(lease)

    def _run_lease_or_create(self, timeout: float | None = None) -> int:
        return self.run_lease if self.run_lease is not None else self._create_run_lease(timeout)

    def _forget_run_lease(self, lease: int) -> None:
        """The run lease expired (``run`` went with it): the next use creates a new one."""
        if self.run_lease == lease:
            self.run_lease = None

    def _create_run_lease(self, timeout: float | None = None) -> int:
        """The run lease of ``run``, created if absent (sealers and closers only)."""
        lease = protocol.ensure_run_lease(
            self._client, self._keys, self._settings.state_ttl, timeout=timeout
        )
        self._adopt_run_lease(lease)
        return lease
