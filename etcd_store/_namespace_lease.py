"""The lease that every key of an :class:`~etcd_store.EtcdStore` namespace is attached to.

Rule: one lease per namespace, recorded under ``ns\\0lease`` (itself attached to
the lease). The first store of a namespace grants it and records it with a
create-if-absent transaction; every later store, in any process, adopts the
recorded lease. Every live store keeps it alive (a keep-alive every third of
the lease's TTL, the TTL its creator granted). When no live store is left (jobs finished, crashed or were killed),
nobody refreshes the lease: etcd deletes it ``ttl`` seconds later, and with it
every key of the namespace.

If the lease expired while a store was still alive (its process was cut off
from etcd for longer than ``ttl``), the next write reports the lease missing;
the store then creates (or adopts) a new namespace lease and retries the write.
Keys written under the expired lease are gone by then.
"""

from __future__ import annotations

import logging
import threading
import time

from .client import EtcdClient, compare_create, op_get, op_put
from .errors import EtcdError, EtcdLeaseNotFound

log = logging.getLogger(__name__)


def is_lease_missing(err: BaseException) -> bool:
    """Whether ``err`` is etcd saying the lease named by a write does not exist."""
    return isinstance(err, EtcdLeaseNotFound)


class NamespaceLease:
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
        self._adopted = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ public

    def current(self, timeout: float) -> int:
        """The lease id to attach writes to, finding or creating it if needed."""
        lease_id = self._id
        if lease_id:
            return lease_id
        with self._lock:
            if not self._id:
                self._id = self._find_or_create(timeout)
                self._start_keeper()
            return self._id

    def lost(self, lease_id: int, timeout: float) -> int:
        """Report that etcd no longer knows ``lease_id``; returns the lease to use now."""
        with self._lock:
            if self._id == lease_id:
                log.warning(
                    "namespace lease %x of %r expired while in use; keys written under it are gone",
                    lease_id, self._key,
                )
                self._id = 0
        return self.current(timeout)

    def close(self) -> None:
        """Stop keeping the lease alive (it is not revoked: other users may still need it)."""
        self._stop.set()

    # ------------------------------------------------------------------ internals

    def _find_or_create(self, timeout: float) -> int:
        client = self._client
        deadline = time.monotonic() + timeout
        while True:
            remaining = max(deadline - time.monotonic(), 0.001)
            kv = client.get(self._key, timeout=remaining)
            if kv is not None:
                self._adopted = True
                return int(kv.value)
            granted = client.lease_grant(self.ttl, timeout=remaining)
            result = client.txn(
                [compare_create(self._key, "==", 0)],
                [op_put(self._key, str(granted).encode(), lease=granted)],
                [op_get(self._key)],
                timeout=max(deadline - time.monotonic(), 0.001),
                idempotent=True,
            )
            if result.succeeded:
                log.debug("created namespace lease %x for %r", granted, self._key)
                self._adopted = False
                return granted
            # Another store created it first: adopt theirs, drop ours.
            try:
                client.lease_revoke(granted, timeout=max(deadline - time.monotonic(), 0.001))
            except EtcdError as e:
                log.debug("could not revoke unused lease %x: %s", granted, e)
            theirs = result.responses[0]
            if getattr(theirs, "kvs", None):
                self._adopted = True
                return int(theirs.kvs[0].value)  # type: ignore[union-attr]
            # It vanished again (expired in between): try once more.

    def _start_keeper(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._keep_alive, name=f"etcd-store-lease-{self._key!r}", daemon=True
            )
            self._thread.start()

    def _keep_alive(self) -> None:
        # The lease's TTL is the one its creator granted, which may differ from ours:
        # refresh at once to learn it, then every third of it.
        interval = max(self.ttl / 3.0, 0.5)
        pause = 0.0 if self._adopted else interval
        while not self._stop.wait(pause):
            lease_id = self._id
            if not lease_id:
                pause = interval
                continue
            try:
                ttl = self._client.keep_alive_once(lease_id, timeout=max(interval, 1.0))
            except EtcdError as e:
                # etcd unreachable: try again soon, the lease still has time left.
                log.info("keep-alive of namespace lease %x failed: %s", lease_id, e)
                pause = min(interval, 1.0)
                continue
            if ttl > 0:
                interval = max(ttl / 3.0, 0.5)
                pause = interval
            elif not self._stop.is_set():
                try:
                    self.lost(lease_id, timeout=max(interval, 1.0))
                except EtcdError as e:
                    log.info("could not renew namespace lease of %r: %s", self._key, e)
                    pause = min(interval, 1.0)


class GivenLease:
    """A lease the caller owns and keeps alive (``EtcdStore(lease=...)``): no RPC here.

    Writes are attached to it; if etcd no longer knows it, the write fails with
    that error (the store cannot renew a lease it does not own).
    """

    def __init__(self, lease_id: int) -> None:
        if not isinstance(lease_id, int) or isinstance(lease_id, bool) or lease_id <= 0:
            raise ValueError(f"EtcdStore lease must be a positive lease id, got {lease_id!r}")
        self._id = lease_id

    def current(self, timeout: float) -> int:
        return self._id

    def lost(self, lease_id: int, timeout: float) -> int:
        raise EtcdLeaseNotFound(f"lease {lease_id:x}, given to this EtcdStore, is gone (expired or revoked)")

    def close(self) -> None:
        pass
