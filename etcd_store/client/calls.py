"""``EtcdClient``: the etcd v3 calls (KV, transactions, leases, watches, status), and ``LeaseCalls``.

The client is a face over parts it holds: a :class:`~etcd_store.client.transport.Transport`
(channels, failover, auth, the call loop, error translation) and a :class:`LeaseCalls` (lease
RPCs and keep-alive streams over the same transport; usable alone). Watches get the
transport, sessions the lease calls; neither depends on ``EtcdClient``.

Each unary method is one RPC when healthy, under the transport's retry policy
(:meth:`Transport.call <etcd_store.client.transport.Transport.call>`): ``timeout`` bounds
it, retries included, and every failure is an :mod:`etcd_store.errors` exception. Streams
(:class:`~etcd_store.client.Watch`, lease sessions) reconnect by themselves.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from etcd3.etcdrpc import rpc_pb2

from ..errors import EtcdLeaseExists, EtcdLeaseNotFound, EtcdRequestError
from ..options import DEFAULT_CONNECT_TIMEOUT, DEFAULT_TIMEOUT, EtcdClientOptions
from .endpoints import Endpoint
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
from .leases import LEASES_PER_STREAM, KeepAlives
from .retry import RetryPolicy
from .stats import CallStats
from .transport import Transport

if TYPE_CHECKING:
    from .session import Session
    from .watch import Watch

log = logging.getLogger(__name__)

__all__ = ["EtcdClient", "LeaseCalls"]


class EtcdClient:
    """A thread-safe etcd v3 client over one or more endpoints.

    Args:
        endpoints: ``"h1:2379,h2:2379"``, ``http(s)://`` URLs, or a list of those.
        timeout: the default deadline in seconds of every call (retries included).
        ca_cert, cert, key: TLS files (CA bundle; client certificate and key). Any of them
            turns TLS on for endpoints without a scheme; ``ValueError`` for an ``http://``
            endpoint then, for mixed schemes, or for ``user:password@`` in an endpoint.
        user, password: etcd credentials; the token is fetched on first use and again
            when etcd rejects it. A password with a plain-text endpoint is a ``ValueError``
            unless ``allow_insecure_auth`` (then a warning); a password sent to an etcd
            with auth disabled logs a warning once per client.
        interceptors: gRPC client interceptors (e.g. :class:`~etcd_store.client.testing.RpcCounter`).
        connect_timeout: seconds (default 5) a client that never reached etcd retries while
            every endpoint refuses the connection, then raises :class:`EtcdConnectionError`
            instead of waiting out ``timeout``. Once any member answered, calls ride out
            outages until their own deadline.
        allow_insecure_auth: accept sending ``password`` over plain text.

    Calls fail over to the next endpoint; every failure is an
    :class:`~etcd_store.errors.EtcdError` naming the endpoints.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
        protocol: str | None = None,
        interceptors: Sequence[Any] = (),
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        allow_insecure_auth: bool = False,
    ) -> None:
        options = EtcdClientOptions(
            endpoints, timeout=timeout, protocol=protocol, ca_cert=ca_cert, cert=cert, key=key, user=user,
            password=password, allow_insecure_auth=allow_insecure_auth, connect_timeout=connect_timeout,
            interceptors=interceptors,
        )  # fmt: skip
        self._transport = Transport(options)
        self._leases = LeaseCalls(self._transport)

    @classmethod
    def from_options(cls, options: EtcdClientOptions, **changes: Any) -> EtcdClient:
        """A client of ``options`` (with ``changes``, e.g. test ``interceptors``); no RPC yet."""
        return cls(**{**vars(options), **changes})

    @property
    def options(self) -> EtcdClientOptions:
        """The options this client was made with."""
        return self._transport.options

    # ---------------------------------------------------------------- the transport's settings

    @property
    def transport(self) -> Transport:
        """The :class:`Transport`, for RPCs without a client method (e.g. :mod:`.auth_admin`:
        ``client.transport.call(service, method, request)``)."""
        return self._transport

    @property
    def endpoints(self) -> list[Endpoint]:
        """The parsed endpoints, in the order given."""
        return self._transport.endpoints

    @property
    def timeout(self) -> float:
        """The default deadline in seconds of every call, retries included."""
        return self._transport.timeout

    @property
    def connect_timeout(self) -> float:
        """Seconds a client that never reached etcd retries refused connections."""
        return self._transport.connect_timeout

    @property
    def stats(self) -> CallStats:
        """Retries and errors of this client (:mod:`.stats`), read by the layers above."""
        return self._transport.stats

    @property
    def retry_policy(self) -> RetryPolicy:
        """The numbers of the retry policy (:mod:`.retry`)."""
        return self._transport.retry_policy

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._transport.closed

    def describe(self) -> str:
        """The endpoints as a user would write them, for error messages."""
        return self._transport.describe()

    def __repr__(self) -> str:
        return f"EtcdClient({self.describe()!r})"

    def close(self) -> None:
        """Stop the keep-alive streams (sessions end, unrevoked), close the channels (watches end). No RPC."""
        self._leases.close()
        self._transport.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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

        ``sort_by`` (``"key"``, ``"version"``, ``"create"``, ``"mod"``, ``"value"``) orders
        the result (ascending unless ``descending``); with ``limit``, e.g. the
        earliest-created key of a prefix.
        """
        req = _range_request(
            key, range_end, prefix, keys_only, count_only, limit, revision, serializable,
            sort_by, descending,
        )
        resp = self._transport.call("KV", "Range", req, timeout=timeout, what=f"read {show_key(key)}")
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
        resp = self._transport.call("KV", "Put", req, timeout=timeout, what=f"write {show_key(key)}")
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
        resp = self._transport.call("KV", "DeleteRange", req, timeout=timeout, what=f"delete {show_key(key)}")
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

        With ``idempotent=False`` (default) a txn of unknown outcome (connection broke after
        sending) is not resent: the caller gets :class:`EtcdConnectionError` and decides.
        """
        req = rpc_pb2.TxnRequest(compare=list(compare), success=list(success), failure=list(failure))
        what = "transaction on " + ", ".join(show_key(c.key) for c in compare[:3]) if compare else "txn"
        resp = self._transport.call("KV", "Txn", req, timeout=timeout, what=what, idempotent=idempotent)
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
        """Grant a lease and keep it alive until the session closes, renewed every ``interval``
        seconds (None: a third of ``ttl``). One LeaseGrant RPC; see :class:`~etcd_store.client.Session`."""
        from .session import Session

        return Session(self._leases, ttl, lease_id=lease_id, on_lost=on_lost, interval=interval)

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
        return Watch(self._transport, key, end or b"", start_revision, prev_kv)

    def status(self, index: int | None = None, *, timeout: float | None = None) -> MemberStatus:
        """Maintenance.Status of one member (``index``) or of whichever answers first."""
        req = rpc_pb2.StatusRequest()
        if index is None:
            resp = self._transport.call("Maintenance", "Status", req, timeout=timeout, what="status")
        else:
            what = f"status of {self.endpoints[index]}"
            resp = self._transport.call_member(index, "Maintenance", "Status", req, timeout=timeout, what=what)
        return MemberStatus(
            resp.header.member_id, resp.leader, resp.header.revision, resp.dbSize,
            resp.version, resp.raftTerm,
        )

    # ---------------------------------------------------------------- leases (:class:`LeaseCalls`)

    def lease_grant(self, ttl: int, *, lease_id: int = 0, timeout: float | None = None) -> int:
        """Grant a lease of ``ttl`` seconds and return its id. One LeaseGrant RPC."""
        return self._leases.lease_grant(ttl, lease_id=lease_id, timeout=timeout)

    def lease_revoke(self, lease_id: int, *, timeout: float | None = None) -> bool:
        """Revoke a lease (its keys are deleted). False if it had expired already. One LeaseRevoke RPC."""
        return self._leases.lease_revoke(lease_id, timeout=timeout)

    def lease_time_to_live(self, lease_id: int, *, keys: bool = False, timeout: float | None = None) -> int:
        """Seconds left on the lease, or -1 when it expired or never existed. One LeaseTimeToLive RPC."""
        return self._leases.lease_time_to_live(lease_id, keys=keys, timeout=timeout)

    def lease_ttls(self, lease_id: int, *, timeout: float | None = None) -> tuple[int, int]:
        """``(remaining, granted)`` seconds of the lease (-1 remaining when gone). One LeaseTimeToLive RPC."""
        return self._leases.lease_ttls(lease_id, timeout=timeout)

    def keep_alives(self) -> KeepAlives:
        """The keep-alive stream a new session joins (no RPC; see :mod:`.leases`)."""
        return self._leases.keep_alives()

    def kept_leases(self) -> int:
        """How many leases the client's keep-alive streams refresh."""
        return self._leases.kept_leases()


def random_lease_id() -> int:
    """A lease id no one can guess: a positive int64 with 62 random bits."""
    return secrets.randbits(62) + 1


class LeaseCalls:
    """The lease RPCs and keep-alive streams of one client. Thread-safe; :meth:`close` stops the
    streams (the transport's owner closes the transport after it)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._lock = threading.Lock()
        self._keep_alive_muxes: tuple[KeepAlives, ...] = ()

    def lease_grant(self, ttl: int, *, lease_id: int = 0, timeout: float | None = None) -> int:
        """Grant a lease of ``ttl`` seconds and return its id. One LeaseGrant RPC (two after a lost reply).

        Without ``lease_id`` the id is random (62 bits), not etcd's sequential one: no other user
        can guess it and attach a key (which would make the owner's leased writes fail with a
        permission error), and a resend after a lost reply leaves no second lease: etcd refuses
        it (the id exists) and a live lease with our id is ours. Raises
        :class:`~etcd_store.errors.EtcdLeaseExists` for a given ``lease_id`` etcd already holds."""
        chosen = lease_id or random_lease_id()
        req = rpc_pb2.LeaseGrantRequest(TTL=int(ttl), ID=chosen)
        deadline = time.monotonic() + (self._transport.timeout if timeout is None else timeout)
        try:
            resp = self._transport.call("Lease", "LeaseGrant", req, timeout=timeout, what=f"grant lease ttl={ttl}")
        except EtcdLeaseExists:
            if lease_id or self.lease_time_to_live(chosen, timeout=max(deadline - time.monotonic(), 0.001)) <= 0:
                raise
            log.debug("lease %x: our grant was applied by an earlier send", chosen)
            return chosen
        if resp.error:
            raise EtcdRequestError(f"etcd at {self._transport.describe()} refused a lease: {resp.error}")
        return int(resp.ID)

    def lease_revoke(self, lease_id: int, *, timeout: float | None = None) -> bool:
        """Revoke a lease (its keys are deleted). False if it had expired already."""
        req = rpc_pb2.LeaseRevokeRequest(ID=lease_id)
        try:
            self._transport.call("Lease", "LeaseRevoke", req, timeout=timeout, what=f"revoke lease {lease_id:x}")
        except EtcdLeaseNotFound:
            return False
        return True

    def lease_time_to_live(self, lease_id: int, *, keys: bool = False, timeout: float | None = None) -> int:
        """Seconds left on the lease, or -1 when it expired or never existed."""
        return self._time_to_live(lease_id, keys, timeout)[0]

    def lease_ttls(self, lease_id: int, *, timeout: float | None = None) -> tuple[int, int]:
        """``(remaining, granted)`` seconds: whole seconds left as etcd's leader counts them
        (truncated; -1 when gone) and the granted TTL. One LeaseTimeToLive RPC."""
        return self._time_to_live(lease_id, False, timeout)

    def _time_to_live(self, lease_id: int, keys: bool, timeout: float | None) -> tuple[int, int]:
        req = rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id, keys=keys)
        resp = self._transport.call("Lease", "LeaseTimeToLive", req, timeout=timeout, what=f"lease {lease_id:x}")
        return int(resp.TTL), int(resp.grantedTTL)

    def keep_alives(self) -> KeepAlives:
        """The keep-alive stream for a new session (no RPC): the first below
        :data:`LEASES_PER_STREAM` leases, or a new one."""
        with self._lock:
            for mux in self._keep_alive_muxes:
                if mux.reserve(LEASES_PER_STREAM):
                    return mux
            mux = KeepAlives(self._transport)
            mux.reserve(LEASES_PER_STREAM)
            self._keep_alive_muxes += (mux,)
            return mux

    def kept_leases(self) -> int:
        """How many leases the client's keep-alive streams refresh."""
        return sum(mux.kept() for mux in self._keep_alive_muxes)

    def close(self) -> None:
        """Stop the keep-alive streams: every session ends, unrevoked (no RPC)."""
        for mux in self._keep_alive_muxes:
            mux.stop()
