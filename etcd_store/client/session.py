"""Leases kept alive over one keep-alive stream."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from etcd3.etcdrpc import rpc_pb2

from ..errors import EtcdError
from .transport import _details

if TYPE_CHECKING:
    from .calls import EtcdClient

log = logging.getLogger(__name__)

__all__ = ["LeaseKeeper"]

# --------------------------------------------------------------------------- lease keeper


class LeaseKeeper:
    """A lease plus the thread that keeps it alive over one keep-alive stream.

    The lease is granted in the constructor (one LeaseGrant RPC; raises on
    failure). Keep-alives go out every ``ttl / 3`` seconds on one stream; a broken
    stream is reopened on the next endpoint. If etcd reports the lease gone
    (TTL 0), :attr:`expired` is set and ``on_expired`` runs once.
    :meth:`close` stops the thread and, by default, revokes the lease.

    :meth:`keep_also` adds another, already granted lease to the same stream (for
    instance a lease shared by several processes); it is refreshed at the same
    pace, is never revoked by :meth:`close`, and is dropped when etcd reports it gone.
    """

    def __init__(
        self,
        client: EtcdClient,
        ttl: int,
        *,
        on_expired: Callable[[], None] | None = None,
        lease_id: int = 0,
    ) -> None:
        if ttl < 1:
            raise ValueError(f"lease TTL must be at least 1 second, got {ttl}")
        self._client = client
        self.ttl = int(ttl)
        self.id = client.lease_grant(self.ttl, lease_id=lease_id)
        self.expired = threading.Event()
        self._on_expired = on_expired
        self._stop = threading.Event()
        self._call: Any = None
        self._also: frozenset[int] = frozenset()
        self._interval = max(self.ttl / 3.0, 0.2)  # between keep-alives
        self._thread = threading.Thread(target=self._run, name=f"etcd-lease-{self.id:x}", daemon=True)
        self._thread.start()

    def keep_also(self, lease_id: int) -> None:
        """Refresh ``lease_id`` too, on this stream, from the next keep-alive on."""
        if lease_id != self.id:
            self._also = self._also | {lease_id}

    def also_kept(self) -> frozenset[int]:
        """The extra leases still being refreshed (see :meth:`keep_also`)."""
        return self._also

    def _requests(self) -> Iterator[Any]:
        interval = self._interval
        request = rpc_pb2.LeaseKeepAliveRequest(ID=self.id)
        while True:
            yield request
            for extra in self._also:
                yield rpc_pb2.LeaseKeepAliveRequest(ID=extra)
            if self._stop.wait(interval):
                return

    def _run(self) -> None:
        client = self._client
        # The lease was granted with its full TTL a moment ago: the stream opens when
        # the first refresh is due, one interval later (a burst of grants, such as a
        # rendezvous of many nodes, then opens no streams at all). A reopened stream
        # refreshes at once.
        if self._stop.wait(self._interval):
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
                        self._expire()
                        return
                if self._stop.is_set():
                    return
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return
                log.info("keep-alive of lease %x lost %s: %s", self.id, member.endpoint, _details(e))
            except (EtcdError, ValueError) as e:
                log.warning("keep-alive of lease %x stopped: %s", self.id, e)
                return
            client._rotate_from(index)
            _, nxt = client._stream_member()
            for _ in itertools.count():
                if self._stop.is_set() or client._closed:
                    return
                if client._wait_ready(nxt, timeout=1.0):
                    break
                client._rotate_from(client._order()[0])
                _, nxt = client._stream_member()

    def _expire(self) -> None:
        if not self.expired.is_set():
            self.expired.set()
            log.warning("lease %x expired", self.id)
            if self._on_expired is not None:
                self._on_expired()

    def close(self, *, revoke: bool = True, timeout: float | None = None) -> None:
        """Stop keeping the lease alive; revoke it (deleting its keys) unless told not to."""
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        if revoke and not self.expired.is_set():
            try:
                self._client.lease_revoke(self.id, timeout=timeout)
            except EtcdError as e:
                log.warning("could not revoke lease %x: %s", self.id, e)

    def __enter__(self) -> LeaseKeeper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

