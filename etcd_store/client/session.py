"""Lease sessions: a lease kept alive by the client's keep-alive stream (etcd Go's ``concurrency.Session``).

Contract:

* ``Session(client, ttl)`` grants a lease (one LeaseGrant RPC; raises
  :class:`~etcd_store.errors.EtcdError` on failure). :meth:`Session.existing`
  keeps a lease granted elsewhere alive instead (no RPC).
* The client's :class:`~etcd_store.client.leases.KeepAlives` refreshes it every third of the
  TTL etcd reports (so an adopted lease keeps its own pace), or every ``interval`` seconds,
  over a stream shared by the client's sessions (:mod:`.leases`). Nothing blocks the caller.
* When etcd reports the lease gone (expired, or revoked by anyone), or answers none of its
  keep-alives for a whole TTL (etcd Go's lessor rule: surely expired, unless etcd had no
  leader all along), :attr:`lost` is set and ``on_lost`` runs once in the client's callback
  thread (:meth:`~.reactor.Reactor.offload`, never the stream loop: it may lock and make RPCs).
  :meth:`done` is set when refreshing stops for any reason (lost, closed, client closed,
  stream failed for good): check it before relying on the lease.
* :meth:`renewed_at`: when etcd answered recent keep-alives (the grant first), i.e. how
  fresh this client's view of etcd is.
* :meth:`close` stops refreshing and revokes the lease (deleting its keys) unless
  ``revoke_on_close=False`` or ``close(revoke=False)``. A context manager.

:func:`renewing_lease` is the one "lease gone: take a new lease, write again" loop.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from ..errors import EtcdError, EtcdLeaseNotFound, EtcdPermissionDenied
from .leases import KeepAlives, refresh_interval
from .reactor import started

log = logging.getLogger(__name__)

__all__ = ["Session", "renewing_lease"]

_T = TypeVar("_T")


class LeaseSource(Protocol):
    """What a :class:`Session` calls: grant, revoke, a keep-alive stream (an
    :class:`~etcd_store.client.EtcdClient` or its :class:`~.calls.LeaseCalls`)."""

    def lease_grant(self, ttl: int, *, lease_id: int = 0, timeout: float | None = None) -> int: ...

    def lease_revoke(self, lease_id: int, *, timeout: float | None = None) -> bool: ...

    def keep_alives(self) -> KeepAlives: ...


class Session:
    """A lease kept alive over the client's keep-alive stream until :meth:`close`.

    Args:
        client: the etcd client whose keep-alive stream refreshes the lease (an
            :class:`~etcd_store.client.EtcdClient`, or any :class:`LeaseSource`).
        ttl: seconds; the lease's TTL (at least 1).
        lease_id: the id to ask etcd for (0: etcd picks one).
        on_lost: called once, in the client's callback thread, when the lease is lost.
        interval: seconds between two keep-alives (at least 0.2); None: a third of the TTL.

    Attributes: ``id`` (also :attr:`lease_id`), ``ttl`` (as etcd last reported it),
    :attr:`lost` (a ``threading.Event``).

    :meth:`keep_also` refreshes other granted leases too (e.g. one shared by several
    processes): never revoked by :meth:`close`, dropped when gone or when this session
    ends. A lease kept by several sessions of one client is refreshed once per interval.
    """

    def __init__(
        self,
        client: LeaseSource,
        ttl: int,
        *,
        lease_id: int = 0,
        on_lost: Callable[[], None] | None = None,
        interval: float | None = None,
    ) -> None:
        if ttl < 1:
            raise ValueError(f"lease TTL must be at least 1 second, got {ttl}")
        granted = client.lease_grant(int(ttl), lease_id=lease_id)
        # Just granted at full TTL: first refresh one interval from now (so a burst of
        # grants, e.g. a rendezvous of many nodes, opens no stream at all).
        self._start(client, granted, int(ttl), on_lost, refresh_now=False, revoke_on_close=True,
                    interval=interval)

    @classmethod
    def existing(
        cls,
        client: LeaseSource,
        lease_id: int,
        *,
        ttl: int,
        refresh_now: bool = True,
        revoke_on_close: bool = False,
        on_lost: Callable[[], None] | None = None,
    ) -> Session:
        """Keep ``lease_id``, granted elsewhere, alive; no RPC here. ``ttl`` is assumed until etcd
        reports it; ``refresh_now`` (default) sends the first keep-alive at once (pass False for
        a lease granted a moment ago)."""
        if ttl < 1:
            raise ValueError(f"lease TTL must be at least 1 second, got {ttl}")
        session = cls.__new__(cls)
        session._start(client, lease_id, int(ttl), on_lost, refresh_now=refresh_now,
                       revoke_on_close=revoke_on_close)
        return session

    def _start(
        self,
        client: LeaseSource,
        lease_id: int,
        ttl: int,
        on_lost: Callable[[], None] | None,
        *,
        refresh_now: bool,
        revoke_on_close: bool,
        interval: float | None = None,
    ) -> None:
        self._client = client
        self.interval = refresh_interval(ttl) if interval is None else interval
        # when etcd answered (monotonic): the grant, then each keep-alive; a few TTLs' worth
        self._renewed: collections.deque[float] = collections.deque(maxlen=256)
        if not refresh_now:
            self._renewed.append(time.monotonic())
        self.id = lease_id
        self.ttl = ttl
        self.lost = threading.Event()
        self._done = threading.Event()
        self._on_lost = on_lost
        self._revoke_on_close = revoke_on_close
        self._closed = False
        #: Whether etcd itself said the lease is gone; False while alive or when :attr:`lost` was
        #: presumed from silence (it may live on: a leaderless etcd expires nothing, a restarted
        #: one extends leases).
        self.gone_at_etcd = False
        self._pid = os.getpid()
        self._also: frozenset[int] = frozenset()
        self._mux = client.keep_alives()
        self._mux.keep(self, lease_id, ttl, first_in=0.0 if refresh_now else self.interval, interval=interval)

    # ------------------------------------------------------------------ public

    @property
    def lease_id(self) -> int:
        return self.id

    def done(self) -> threading.Event:
        """Set once this session no longer refreshes its lease (lost or closed)."""
        return self._done

    def renewed_at(self) -> tuple[float, ...]:
        """When etcd granted or last renewed this lease (``time.monotonic()``, oldest first; the
        last 256). No RPC."""
        return tuple(self._renewed)

    def keep_also(self, lease_id: int) -> None:
        """Refresh ``lease_id`` too, first with this session's next keep-alive."""
        if lease_id != self.id and not self._done.is_set():
            self._also = self._also | {lease_id}
            self._mux.keep_with(self, self.id, lease_id)

    def also_kept(self) -> frozenset[int]:
        """The extra leases still being refreshed (see :meth:`keep_also`)."""
        return self._also

    def close(self, *, revoke: bool | None = None, timeout: float | None = None) -> None:
        """Stop refreshing; revoke the lease (one LeaseRevoke RPC) unless told not to.

        ``revoke=None``: the session's default (``True`` for a granted lease). Idempotent; a
        failed revoke is logged, not raised (the lease expires by itself). In a forked child it
        stops and revokes nothing: the lease and its keep-alives are the parent's.
        """
        first = not self._closed
        self._closed = True
        self._done.set()
        if os.getpid() != self._pid:
            return
        self._mux.drop(self)
        if revoke is None:
            revoke = self._revoke_on_close
        if first and revoke and not self.gone_at_etcd:
            try:
                self._client.lease_revoke(self.id, timeout=timeout)
            except EtcdError as e:
                log.warning("could not revoke lease %x: %s", self.id, e)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "lost" if self.lost.is_set() else "done" if self._done.is_set() else "alive"
        return f"Session(lease={self.id:x}, ttl={self.ttl}, {state})"

    # ------------------------------------------------------------------ told by the keep-alive stream

    def _learn_ttl(self, ttl: int) -> None:
        self.ttl = ttl
        self._renewed.append(time.monotonic())

    def _lease_lost(self, lease_id: int, primary: bool, confirmed: bool = True) -> None:
        if not primary:
            log.info("extra lease %x kept by lease %x is gone", lease_id, self.id)
            self._also = self._also - {lease_id}
            return
        if not self.lost.is_set():
            self.gone_at_etcd = confirmed
            self.lost.set()
            self._done.set()
            log.warning("lease %x is gone (expired or revoked)", self.id)
            if self._on_lost is not None:
                started_loop = started()
                if started_loop is not None:
                    started_loop.offload(self._on_lost)
                else:  # (not told by a stream: no loop in this process)
                    self._on_lost()

    def _stopped(self, reason: BaseException) -> None:
        # The stream logged why (once for all its sessions); a closed client is no news.
        log.debug("keep-alive of lease %x stopped: %s", self.id, reason)
        self._done.set()


def renewing_lease(
    write: Callable[[int], _T],
    acquire: Callable[[], int],
    forget: Callable[[int], None],
    *,
    renewals: int = 3,
) -> _T:
    """``write(acquire())``; when etcd says that lease is gone, or refuses it, ``forget`` it and write again.

    ``acquire()`` returns the lease to write with (granting or finding one); ``forget(lease_id)``
    drops a lease etcd no longer knows (or raises, if it cannot be replaced). After ``renewals``
    new leases :class:`EtcdLeaseNotFound` propagates. ``write`` must be safe to rerun after
    failing that way (etcd applied nothing).

    **A refused lease.** etcd lets a put attach a lease only if its user may write every key
    already on it (``checkLeasePuts``), and any user can list lease ids (``LeaseLeases``) and
    attach a key of its own to one holding none of ours yet, making our writes with it fail
    ``PERMISSION_DENIED``. So a call's first :class:`~etcd_store.errors.EtcdPermissionDenied`
    (from ``write``, or ``acquire`` whose first write anchors a new lease) is taken as a refused
    lease: forgotten (not revoked: that needs the same permission), a new one acquired, the
    write resent; a second propagates (the key itself is denied; one extra LeaseGrant, expiring
    unused). If ``forget`` raises, the denial propagates.
    """
    denied = False
    renewed = 0
    lease_id = 0
    while True:
        try:
            if not lease_id:
                lease_id = acquire()
            return write(lease_id)
        except EtcdLeaseNotFound:
            if renewed >= renewals or not lease_id:
                raise
            renewed += 1
            log.info("lease %x is gone; writing again with a new one", lease_id)
            forget(lease_id)
            lease_id = 0
        except EtcdPermissionDenied as e:
            if denied:
                raise
            denied = True
            if lease_id:
                log.warning("a write with lease %x was refused (%s): another etcd user may have attached a "
                            "key to it; writing again with a new lease", lease_id, e)
                try:
                    forget(lease_id)
                except EtcdError:
                    raise e from None
            lease_id = 0
