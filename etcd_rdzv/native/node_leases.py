"""A node's leases in an ``etcd-v3`` run: its lease session, the run lease, and closing the run.

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
:class:`~etcd_rdzv.native.errors.NodeShutDown` once stopped (where named) and
:class:`~etcd_store.errors.EtcdError` subclasses when etcd fails.
"""

from __future__ import annotations

import logging
import threading
import time

from etcd_store.client import EtcdClient, Session, Watch, renewing_lease
from etcd_store.errors import EtcdError, EtcdTimeoutError

from . import protocol
from .errors import NodeShutDown
from .keys import RunKeys
from .settings import V3Settings
from .telemetry import RoundObserver

log = logging.getLogger(__name__)

__all__ = ["NodeLeases"]


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
        """Raises :class:`~etcd_rdzv.native.errors.NodeShutDown` after :meth:`stop`."""
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
        :class:`~etcd_rdzv.native.errors.NodeShutDown` once stopped."""
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
        :class:`~etcd_rdzv.native.errors.NodeShutDown` once stopped."""
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
        stopped, it is cancelled and :class:`~etcd_rdzv.native.errors.NodeShutDown` raised."""
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
