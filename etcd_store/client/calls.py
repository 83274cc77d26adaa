"""``EtcdClient``: the etcd v3 calls (KV, transactions, leases, watches, status).

Each unary method is one RPC in the healthy, uncontended case and runs under
the :class:`~etcd_store.client.transport.Transport`'s single retry policy: a
deadline (``timeout``, retries included), per-attempt deadlines with failover
for requests that are safe to resend, and :mod:`etcd_store.errors` exceptions
for every failure. Streams (:class:`~etcd_store.client.Watch`, lease sessions)
reconnect by themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from etcd3.etcdrpc import rpc_pb2

from .kv import (
    DeleteResult,
    KeyValue,
    MemberStatus,
    PutResult,
    RangeResult,
    TxnResult,
    _delete_result,
    _put_result,
    _range_request,
    _range_result,
    prefix_range_end,
    show_key,
)
from .leases import LeaseCalls

if TYPE_CHECKING:
    from .session import Session
    from .watch import Watch

__all__ = ["EtcdClient"]


class EtcdClient(LeaseCalls):
    """A thread-safe etcd v3 client over one or more endpoints.

    Args:
        endpoints: ``"h1:2379,h2:2379"``, ``http(s)://`` URLs, or a list of those.
        timeout: the default deadline in seconds of every call (retries included).
        ca_cert, cert, key: TLS files (CA bundle; client certificate and key). Giving
            any of them turns TLS on for endpoints written without a scheme (an
            ``http://`` endpoint then is a ``ValueError``, as are endpoints mixing schemes
            or carrying ``user:password@``).
        user, password: etcd user credentials. The token is fetched on first use and
            fetched again when etcd says it is no longer valid. A password with a
            plain-text endpoint is a ``ValueError`` unless ``allow_insecure_auth``
            (then a warning is logged); a password sent to an etcd with auth disabled
            logs a warning once per client.
        interceptors: gRPC client interceptors (for instance an :class:`RpcCounter`).
        connect_timeout: seconds (default 5) a client that never reached etcd keeps
            retrying when every endpoint refuses the connection (nothing listening,
            unknown host); then the call raises :class:`EtcdConnectionError` instead of
            waiting out ``timeout``. Once any member answered, calls ride out outages
            until their own deadline.
        allow_insecure_auth: accept sending ``password`` over plain text (see above).

    Calls fail over to the next endpoint when one is unreachable. Every failure
    surfaces as an :class:`~etcd_store.errors.EtcdError` that names the endpoints.
    """

    # ---------------------------------------------------------------- KV

    def range(
        self,
        key: bytes,
        range_end: bytes | None = None,
        *,
        prefix: bool = False,
        keys_only: bool = False,
        count_only: bool = False,
        limit: int = 0,
        revision: int = 0,
        serializable: bool = False,
        sort_by: str | None = None,
        descending: bool = False,
        timeout: float | None = None,
    ) -> RangeResult:
        """Read a key, a range, or a prefix. One Range RPC.

        ``sort_by`` (``"key"``, ``"version"``, ``"create"``, ``"mod"``, ``"value"``)
        orders the keys etcd returns (ascending unless ``descending``); with
        ``limit`` that picks, say, the earliest-created key of a prefix.
        """
        req = _range_request(
            key, range_end, prefix, keys_only, count_only, limit, revision, serializable,
            sort_by, descending,
        )
        resp = self._call("KV", "Range", req, timeout=timeout, what=f"read {show_key(key)}")
        return _range_result(resp)

    def get(self, key: bytes, *, timeout: float | None = None) -> KeyValue | None:
        """The key's value and revisions, or None. One Range RPC."""
        result = self.range(key, timeout=timeout)
        return result.kvs[0] if result.kvs else None

    def put(
        self,
        key: bytes,
        value: bytes,
        *,
        lease: int = 0,
        prev_kv: bool = False,
        timeout: float | None = None,
    ) -> PutResult:
        """Write a key. One Put RPC (retried on another endpoint only when safe)."""
        req = rpc_pb2.PutRequest(key=key, value=value, lease=lease, prev_kv=prev_kv)
        resp = self._call("KV", "Put", req, timeout=timeout, what=f"write {show_key(key)}")
        return _put_result(resp)

    def delete(
        self,
        key: bytes,
        range_end: bytes | None = None,
        *,
        prefix: bool = False,
        prev_kv: bool = False,
        timeout: float | None = None,
    ) -> DeleteResult:
        """Delete a key, a range or a prefix. One DeleteRange RPC."""
        end = prefix_range_end(key) if prefix else range_end
        req = rpc_pb2.DeleteRangeRequest(key=key, range_end=end or b"", prev_kv=prev_kv)
        resp = self._call("KV", "DeleteRange", req, timeout=timeout, what=f"delete {show_key(key)}")
        return _delete_result(resp)

    def txn(
        self,
        compare: Sequence[Any],
        success: Sequence[Any] = (),
        failure: Sequence[Any] = (),
        *,
        timeout: float | None = None,
        idempotent: bool = False,
    ) -> TxnResult:
        """Run ``if all(compare) then success else failure`` atomically. One Txn RPC.

        With ``idempotent=False`` (the default) a txn whose outcome is unknown (the
        connection broke after sending) is not replayed; the caller gets
        :class:`EtcdConnectionError` and decides.
        """
        req = rpc_pb2.TxnRequest(compare=list(compare), success=list(success), failure=list(failure))
        what = "transaction on " + ", ".join(show_key(c.key) for c in compare[:3]) if compare else "txn"
        resp = self._call("KV", "Txn", req, timeout=timeout, what=what, idempotent=idempotent)
        results: list[RangeResult | PutResult | DeleteResult] = []
        for r in resp.responses:
            kind = r.WhichOneof("response")
            if kind == "response_range":
                results.append(_range_result(r.response_range))
            elif kind == "response_put":
                results.append(_put_result(r.response_put))
            elif kind == "response_delete_range":
                results.append(_delete_result(r.response_delete_range))
        return TxnResult(resp.succeeded, resp.header.revision, results)

    def session(
        self, ttl: int, *, lease_id: int = 0, on_lost: Callable[[], None] | None = None,
        interval: float | None = None,
    ) -> Session:
        """Grant a lease and keep it alive (over one of the client's keep-alive streams) until the session is
        closed, renewed every ``interval`` seconds (None: a third of ``ttl``).

        One LeaseGrant RPC now; see :class:`~etcd_store.client.Session`.
        """
        from .session import Session

        return Session(self, ttl, lease_id=lease_id, on_lost=on_lost, interval=interval)

    def keeper(
        self, ttl: int, *, on_expired: Callable[[], None] | None = None, lease_id: int = 0
    ) -> Session:
        """:meth:`session` under its former name (``on_expired`` is ``on_lost``)."""
        return self.session(ttl, lease_id=lease_id, on_lost=on_expired)

    # ---------------------------------------------------------------- watches & status

    def watch(
        self,
        key: bytes,
        range_end: bytes | None = None,
        *,
        prefix: bool = False,
        start_revision: int = 0,
        prev_kv: bool = False,
    ) -> Watch:
        """Start watching a key or range from ``start_revision`` (0: from now)."""
        from .watch import Watch

        end = prefix_range_end(key) if prefix else range_end
        return Watch(self, key, end or b"", start_revision, prev_kv)

    def status(self, index: int | None = None, *, timeout: float | None = None) -> MemberStatus:
        """Maintenance.Status of one member (``index``) or of whichever answers first."""
        req = rpc_pb2.StatusRequest()
        if index is None:
            resp = self._call("Maintenance", "Status", req, timeout=timeout, what="status")
        else:
            member = self._members[index]
            budget = self.timeout if timeout is None else timeout
            try:
                resp = member.stub("Maintenance").Status(req, timeout=budget)
            except grpc.RpcError as e:
                raise self._translate(e, f"status of {member.endpoint}") from None
        return MemberStatus(
            resp.header.member_id, resp.leader, resp.header.revision, resp.dbSize,
            resp.version, resp.raftTerm,
        )
