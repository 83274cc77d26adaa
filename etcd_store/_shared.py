"""What an :class:`~etcd_store.EtcdStore` and its clones share: the client, the namespace
lease and a reference count; the last store to let go closes the lease (and the client, if
the store built it)."""

from __future__ import annotations

import logging
import threading

from ._namespace_lease import StoreLease
from .client import EtcdClient

log = logging.getLogger(__name__)


class Shared:
    """The client and lease of a store and its clones, with a reference count."""

    def __init__(self, client: EtcdClient, owns_client: bool, lease: StoreLease) -> None:
        self.client = client
        self.owns_client = owns_client
        self.lease = lease
        self._refs = 0
        self._lock = threading.Lock()

    def acquire(self) -> None:
        with self._lock:
            self._refs += 1

    def release(self) -> None:
        """Drop one reference; the last one stops the lease's keep-alive and closes an owned client."""
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            self.lease.close()
            if self.owns_client:
                self.client.close()
