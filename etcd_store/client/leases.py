"""``LeaseCalls``: the unary lease RPCs (grant, revoke, time-to-live) on top of the transport.

A base of :class:`~etcd_store.client.EtcdClient`, and all that a
:class:`~etcd_store.client.session.Session` needs besides the transport's streams,
so the session module depends on the lease calls and not on the whole client.
Each call is one RPC under the transport's retry policy.
"""

from __future__ import annotations

from etcd3.etcdrpc import rpc_pb2

from ..errors import EtcdLeaseNotFound, EtcdRequestError
from .transport import Transport

__all__ = ["LeaseCalls"]


class LeaseCalls(Transport):
    """The lease RPCs of a client (see :class:`~etcd_store.client.EtcdClient` for the constructor)."""

    def lease_grant(self, ttl: int, *, lease_id: int = 0, timeout: float | None = None) -> int:
        """Grant a lease of ``ttl`` seconds and return its id. One LeaseGrant RPC."""
        req = rpc_pb2.LeaseGrantRequest(TTL=int(ttl), ID=lease_id)
        resp = self._call("Lease", "LeaseGrant", req, timeout=timeout, what=f"grant lease ttl={ttl}")
        if resp.error:
            raise EtcdRequestError(f"etcd at {self.describe()} refused a lease: {resp.error}")
        return int(resp.ID)

    def lease_revoke(self, lease_id: int, *, timeout: float | None = None) -> bool:
        """Revoke a lease (its keys are deleted). False if it had expired already."""
        req = rpc_pb2.LeaseRevokeRequest(ID=lease_id)
        try:
            self._call("Lease", "LeaseRevoke", req, timeout=timeout, what=f"revoke lease {lease_id:x}")
        except EtcdLeaseNotFound:
            return False
        return True

    def lease_time_to_live(self, lease_id: int, *, keys: bool = False, timeout: float | None = None) -> int:
        """Seconds left on the lease, or -1 when it expired or never existed."""
        req = rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id, keys=keys)
        resp = self._call("Lease", "LeaseTimeToLive", req, timeout=timeout, what=f"lease {lease_id:x}")
        return int(resp.TTL)
