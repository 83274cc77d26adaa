"""The lease that every key of an :class:`~etcd_store.EtcdStore` namespace is attached to.

Rule: one lease per namespace, recorded under ``ns\\0lease`` (itself attached to
the lease). The first store of a namespace grants it and records it with a
create-if-absent transaction (safe to resend: a resend that finds its own lease id
recorded knows it was applied); every later store, in any process, adopts the
recorded lease. Every live store keeps it alive with a
:class:`~etcd_store.client.Session` (the client's keep-alive stream, a refresh every third
of the TTL its creator granted) and never revokes it. When no live store is left
(jobs finished, crashed or were killed), nobody refreshes the lease: etcd
deletes it ``ttl`` seconds later, and with it every key of the namespace.

If the lease expired while a store was still alive (its process was cut off
from etcd for longer than ``ttl``), the store forgets it (its session reports it
lost, or a write fails with :class:`~etcd_store.errors.EtcdLeaseNotFound`); the
next write creates (or adopts) a new namespace lease and is retried
(:meth:`StoreLease.attached`). Keys written under the expired lease are gone by then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from .client import EtcdClient, Session, TxnResult, compare_create, op_get, op_put, renewing_lease
from .errors import EtcdError, EtcdLeaseNotFound, EtcdPermissionDenied

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class StoreLease:
    """What a store attaches its writes to: :meth:`current`, :meth:`forget`, :meth:`attached`."""

    def current(self, timeout: float) -> int:
        raise NotImplementedError

    def forget(self, lease_id: int) -> None:
        """etcd no longer knows ``lease_id``: stop using it (or raise if it cannot be replaced)."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def attached(self, write: Callable[[int], _T], timeout: float) -> _T:
        """``write(lease_id)``; if etcd lost the lease, renew it and run ``write`` again."""
        return renewing_lease(write, lambda: self.current(timeout), self.forget)


class NamespaceLease(StoreLease):
    """Finds or creates the namespace lease and keeps it alive until :meth:`close`.

    :meth:`current` costs no RPC once the lease is known; finding it costs one
    Range (adopting) or Range + LeaseGrant + Txn (creating).
    """

    def __init__(self, client: EtcdClient, lease_key: bytes, ttl: int) -> None:
        if int(ttl) < 2:
            raise ValueError(f"EtcdStore lease_ttl must be at least 2 seconds, got {ttl}")
        self._client = client
        self._key = lease_key
        self.ttl = int(ttl)
        self._lock = threading.Lock()
        self._id = 0
        self._session: Session | None = None
        self._closed = False

    def current(self, timeout: float) -> int:
        """The lease id to attach writes to, finding or creating it if needed. A lease whose session
        ended (lost, or its keep-alive stream failed for good) is forgotten first: nobody would
        refresh it, and keys attached to it would vanish."""
        lease_id, session = self._id, self._session
        if lease_id and (session is None or not session.done().is_set()):
            return lease_id
        if lease_id and not self._closed:
            self.forget(lease_id)
        with self._lock:
            if not self._id:
                lease_id, adopted = self._find_or_create(timeout)
                self._id = lease_id
                if not self._closed:
                    # An adopted lease is refreshed at once (its TTL is its creator's);
                    # one we just granted when a third of its TTL has passed.
                    self._session = Session.existing(
                        self._client, lease_id, ttl=self.ttl, refresh_now=adopted,
                        on_lost=lambda: self.forget(lease_id),
                    )
            return self._id

    def forget(self, lease_id: int) -> None:
        with self._lock:
            if self._id != lease_id:
                return
            log.warning(
                "namespace lease %x of %r is gone while in use; keys written under it are gone",
                lease_id, self._key,
            )
            self._id = 0
            session, self._session = self._session, None
        if session is not None:
            session.close()

    def close(self) -> None:
        """Stop keeping the lease alive (it is not revoked: other users may still need it)."""
        with self._lock:
            self._closed = True
            session, self._session = self._session, None
        if session is not None:
            session.close()

    def _find_or_create(self, timeout: float) -> tuple[int, bool]:
        """The recorded lease, or a new one recorded by us; and whether it was adopted. A lease etcd
        refuses to attach (``PERMISSION_DENIED`` on the record) is left and another granted, once."""
        client = self._client
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(deadline - time.monotonic(), 0.001)

        refused = False
        while True:
            kv = client.get(self._key, timeout=left())
            if kv is not None:
                return int(kv.value), True
            granted = self._grant(left())
            try:
                result = self._record(granted, left())
            except EtcdPermissionDenied:
                # etcd refused the lease (another user attached a key to it before our record:
                # see renewing_lease), or the record key itself (then again with the next lease)
                if refused:
                    raise
                refused = True
                log.warning("namespace lease %x of %r was refused; taking another", granted, self._key)
                continue
            theirs = result.responses[0]
            recorded = theirs.kvs[0].value if getattr(theirs, "kvs", None) else None  # type: ignore[union-attr]
            if result.succeeded or recorded == str(granted).encode():
                # (A failed compare showing our own id: the client resent our Txn after a lost reply.)
                log.debug("created namespace lease %x for %r", granted, self._key)
                return granted, False
            # Another store created it first: adopt theirs, drop ours.
            try:
                client.lease_revoke(granted, timeout=left())
            except EtcdError as e:
                log.debug("could not revoke unused lease %x: %s", granted, e)
            if recorded is not None:
                return int(recorded), True
            # It vanished again (expired in between): try once more.

    def _grant(self, timeout: float) -> int:
        """A new lease (its id drawn at random by the client, so a grant resent after a lost reply
        cannot leave a second lease behind)."""
        return self._client.lease_grant(self.ttl, timeout=timeout)

    def _record(self, granted: int, timeout: float) -> TxnResult:
        """One Txn: record ``granted`` as the namespace lease if none is; else read the record."""
        return self._client.txn(
            [compare_create(self._key, "==", 0)],
            [op_put(self._key, str(granted).encode(), lease=granted)],
            [op_get(self._key)],
            timeout=timeout,
            idempotent=True,
        )


class GivenLease(StoreLease):
    """A lease the caller owns and keeps alive (``EtcdStore(lease=...)``): no RPC here.

    Writes are attached to it; if etcd no longer knows it, the write fails with
    :class:`~etcd_store.errors.EtcdLeaseNotFound` (the store cannot renew a lease
    it does not own).
    """

    def __init__(self, lease_id: int) -> None:
        if not isinstance(lease_id, int) or isinstance(lease_id, bool) or lease_id <= 0:
            raise ValueError(f"EtcdStore lease must be a positive lease id, got {lease_id!r}")
        self._id = lease_id

    def current(self, timeout: float) -> int:
        return self._id

    def forget(self, lease_id: int) -> None:
        raise EtcdLeaseNotFound(
            f"lease {lease_id:x}, given to this EtcdStore, is gone (expired or revoked)"
        )
