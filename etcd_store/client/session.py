"""Lease sessions: a lease plus ONE keep-alive stream (etcd Go's ``concurrency.Session``).

Contract:

* ``Session(client, ttl)`` grants a lease (one LeaseGrant RPC; raises
  :class:`~etcd_store.errors.EtcdError` on failure). :meth:`Session.existing`
  keeps a lease granted elsewhere alive instead (no RPC before its stream opens).
* A daemon thread refreshes the lease every third of its TTL over one keep-alive
  stream (the TTL etcd reports, so an adopted lease is refreshed at its own pace).
  A broken stream is reopened on the next reachable endpoint; nothing blocks the caller.
* When etcd reports the lease gone (expired, or revoked by anyone), :attr:`lost`
  is set and ``on_lost`` runs once, in the session's thread. :meth:`done` is set
  when the session stops refreshing for any reason (lost or closed). A session
  never declares its lease lost on its own while etcd cannot be reached.
* :meth:`close` stops the stream and revokes the lease (deleting its keys),
  unless the session was made with ``revoke_on_close=False`` or ``close(revoke=False)``.
  A context manager: ``with client.session(10) as s: ...``.

:func:`renewing_lease` is the one "lease gone: take a new lease, write again"
loop for writers whose lease can be replaced.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from etcd3.etcdrpc import rpc_pb2

from ..errors import EtcdError, EtcdLeaseNotFound
from .leases import LeaseCalls
from .transport import _details

log = logging.getLogger(__name__)

__all__ = ["Session", "renewing_lease"]

_T = TypeVar("_T")
#: The shortest pause between two keep-alives.
_MIN_INTERVAL = 0.2


class Session:
    """A lease kept alive over one keep-alive stream until :meth:`close`.

    Args:
        client: the etcd client whose endpoints carry the stream.
        ttl: seconds; the lease's TTL (at least 1).
        lease_id: the id to ask etcd for (0: etcd picks one).
        on_lost: called once, from the session's thread, when etcd reports the lease gone.

    Attributes: ``id`` (also :attr:`lease_id`), ``ttl`` (as etcd last reported it),
    :attr:`lost` (a ``threading.Event``; ``expired`` is the same event).

    :meth:`keep_also` adds other, already granted leases to the same stream (a
    lease shared by several processes); they are refreshed at the same pace,
    never revoked by :meth:`close`, and dropped when etcd reports them gone.
    """

    def __init__(
        self,
        client: LeaseCalls,
        ttl: int,
        *,
        lease_id: int = 0,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        if ttl < 1:
            raise ValueError(f"lease TTL must be at least 1 second, got {ttl}")
        granted = client.lease_grant(int(ttl), lease_id=lease_id)
        # Granted with its full TTL a moment ago: the stream opens when the first
        # refresh is due (a burst of grants, such as a rendezvous of many nodes,
        # then opens no streams at all).
        self._start(client, granted, int(ttl), on_lost, refresh_now=False, revoke_on_close=True)

    @classmethod
    def existing(
        cls,
        client: LeaseCalls,
        lease_id: int,
        *,
        ttl: int,
        refresh_now: bool = True,
        revoke_on_close: bool = False,
        on_lost: Callable[[], None] | None = None,
    ) -> Session:
        """Keep ``lease_id``, granted elsewhere, alive; no RPC here.

        ``ttl`` is the expected TTL until etcd reports the real one (with
        ``refresh_now``, the default, the first keep-alive goes out at once and
        tells it; pass ``refresh_now=False`` for a lease granted a moment ago).
        """
        if ttl < 1:
            raise ValueError(f"lease TTL must be at least 1 second, got {ttl}")
        session = cls.__new__(cls)
        session._start(client, lease_id, int(ttl), on_lost, refresh_now=refresh_now,
                       revoke_on_close=revoke_on_close)
        return session

    def _start(
        self,
        client: LeaseCalls,
        lease_id: int,
        ttl: int,
        on_lost: Callable[[], None] | None,
        *,
        refresh_now: bool,
        revoke_on_close: bool,
    ) -> None:
        self._client = client
        self.id = lease_id
        self.ttl = ttl
        self.lost = threading.Event()
        self._done = threading.Event()
        self._on_lost = on_lost
        self._revoke_on_close = revoke_on_close
        self._stop = threading.Event()
        self._wake = threading.Event()  # the interval changed, or stop
        self._call: Any = None
        self._also: frozenset[int] = frozenset()
        self._interval = max(ttl / 3.0, _MIN_INTERVAL)
        self._refresh_now = refresh_now
        self._thread = threading.Thread(target=self._run, name=f"etcd-lease-{lease_id:x}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public

    @property
    def lease_id(self) -> int:
        return self.id

    @property
    def expired(self) -> threading.Event:
        """The :attr:`lost` event (its former name)."""
        return self.lost

    def done(self) -> threading.Event:
        """Set once this session no longer refreshes its lease (lost or closed)."""
        return self._done

    def keep_also(self, lease_id: int) -> None:
        """Refresh ``lease_id`` too, on this stream, from the next keep-alive on."""
        if lease_id != self.id:
            self._also = self._also | {lease_id}

    def also_kept(self) -> frozenset[int]:
        """The extra leases still being refreshed (see :meth:`keep_also`)."""
        return self._also

    def close(self, *, revoke: bool | None = None, timeout: float | None = None) -> None:
        """Stop refreshing; revoke the lease (one LeaseRevoke RPC) unless told not to.

        ``revoke=None`` follows the session's default (``True`` for a granted lease).
        Idempotent; never raises for a revoke that fails (it is logged: the lease
        then expires by itself).
        """
        first = not self._stop.is_set()
        self._stop.set()
        self._wake.set()
        self._done.set()
        call = self._call
        if call is not None:
            call.cancel()
        if revoke is None:
            revoke = self._revoke_on_close
        if first and revoke and not self.lost.is_set():
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

    # ------------------------------------------------------------------ the keep-alive thread

    def _requests(self) -> Iterator[Any]:
        while True:
            yield rpc_pb2.LeaseKeepAliveRequest(ID=self.id)
            for extra in self._also:
                yield rpc_pb2.LeaseKeepAliveRequest(ID=extra)
            sent = time.monotonic()
            while (left := sent + self._interval - time.monotonic()) > 0:
                if self._wake.wait(left):
                    self._wake.clear()
                if self._stop.is_set():
                    return

    def _run(self) -> None:
        client = self._client
        try:
            if not self._refresh_now and self._stop.wait(self._interval):
                return
            while not self._stop.is_set():
                index, member = client._stream_member()
                try:
                    metadata = client._metadata(member, time.monotonic() + client.timeout)
                    self._call = member.stub("Lease").LeaseKeepAlive(self._requests(), metadata=metadata)
                    for resp in self._call:
                        if resp.ID != self.id:
                            if resp.TTL <= 0 and resp.ID in self._also:
                                log.info("extra lease %x kept by lease %x is gone", resp.ID, self.id)
                                self._also = self._also - {resp.ID}
                            continue
                        if resp.TTL <= 0:
                            self._lose()
                            return
                        self._learn_ttl(int(resp.TTL))
                    if self._stop.is_set():
                        return
                except grpc.RpcError as e:
                    if self._stop.is_set():
                        return
                    # A token etcd forgot (it restarted) is dropped: the next stream logs in again.
                    if isinstance(client._stream_error(member, e, "keep-alive"), EtcdLeaseNotFound):
                        self._lose()
                        return
                    log.info("keep-alive of lease %x lost %s: %s", self.id, member.endpoint, _details(e))
                except (EtcdError, ValueError) as e:  # auth refused, or the client was closed
                    log.warning("keep-alive of lease %x stopped: %s", self.id, e)
                    return
                if not self._reconnect(index):
                    return
        finally:
            self._done.set()

    def _reconnect(self, index: int) -> bool:
        """Wait for the next endpoint that is ready; False when stopped or the client closed."""
        client = self._client
        client._rotate_from(index)
        _, nxt = client._stream_member()
        while not (self._stop.is_set() or client._closed):
            if client._wait_ready(nxt, timeout=1.0):
                return True
            client._rotate_from(client._order()[0])
            _, nxt = client._stream_member()
        return False

    def _learn_ttl(self, ttl: int) -> None:
        interval = max(ttl / 3.0, _MIN_INTERVAL)
        self.ttl = ttl
        if interval != self._interval:
            self._interval = interval
            self._wake.set()

    def _lose(self) -> None:
        if not self.lost.is_set():
            self.lost.set()
            log.warning("lease %x is gone (expired or revoked)", self.id)
            if self._on_lost is not None:
                self._on_lost()


def renewing_lease(
    write: Callable[[int], _T],
    acquire: Callable[[], int],
    forget: Callable[[int], None],
    *,
    renewals: int = 3,
) -> _T:
    """``write(acquire())``; when etcd says that lease is gone, ``forget`` it and write again.

    The one "lease gone: renew, retry" loop. ``acquire()`` returns the lease to
    write with (granting or finding one when needed); ``forget(lease_id)`` drops
    a lease etcd no longer knows (it may raise instead, for a lease that cannot be
    replaced). After ``renewals`` new leases the :class:`EtcdLeaseNotFound` propagates.
    ``write`` must be safe to run again after it failed that way (etcd applied nothing).
    """
    lease_id = acquire()
    for _ in range(renewals):
        try:
            return write(lease_id)
        except EtcdLeaseNotFound:
            log.info("lease %x is gone; writing again with a new one", lease_id)
            forget(lease_id)
            lease_id = acquire()
    return write(lease_id)
