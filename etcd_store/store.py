"""``EtcdStore``: a ``torch.distributed.Store`` over the etcd v3 API.

Code written against ``TCPStore`` runs unchanged: same methods, results, return
types and exception types (see the README section "EtcdStore" for the few
deliberate differences). Every operation costs one etcd round trip in the
uncontended case:

=================================  ============================================
``set``, ``delete_key``,           one Txn (fenced: see "Retries" below)
``queue_push``
``get`` (key present)              one Range
``get``/``wait``/``multi_get``      one read, then one watch from now; one more
(key missing)                      read when etcd's revision moved between the
                                   two (no polling, no lost wake-up: see
                                   :mod:`etcd_store._base`)
``multi_get``, ``multi_set``,      one Txn per 128 / 64 / 64 keys
``check``                          (etcd's default ``--max-txn-ops`` is 128)
``add``, ``append``                one Txn when the key is new or unchanged
                                   since this store last read or wrote it;
                                   one more Txn per concurrent change, each
                                   retry starting from the value the failed
                                   Txn returned (no sleeps)
``compare_set``                    one Txn
``queue_pop``                      one Txn (plus one Range when this store
                                   neither pushed to nor popped from the
                                   queue before)
``queue_len``, ``num_keys``,        one Range
``list_keys``
=================================  ============================================

Values larger than ``chunk_bytes`` (1 MiB, below etcd's default 1.5 MiB request
limit) cost one extra Put per chunk to write and one extra Txn to read (the
chunks at the latest revision, guarded by the manifest: see :mod:`etcd_store._values`).

Modules: this one (the torch facade: lifecycle, plain keys, waits, barrier),
:mod:`etcd_store._cas` (``add``, ``append``, ``compare_set``: the compare-and-swap
engine), :mod:`etcd_store._queues`, :mod:`etcd_store._values` (chunked values),
:mod:`etcd_store._base` (shared state, deadlines, watch-based waits),
:mod:`etcd_store._layout` (key layout) and :mod:`etcd_store._namespace_lease`.

Cleanup rule (see :mod:`etcd_store._namespace_lease`): every key of a
namespace is attached to one namespace lease that every live store of the
namespace keeps alive; ``lease_ttl`` seconds after the last store is closed or
its process died, etcd deletes the whole namespace.

Retries: one policy, the client's (:meth:`~etcd_store.client.transport.Transport.call`): each RPC gets attempts
with growing deadlines (2 s, 4 s, 8 s, ...) and fails over to the next endpoint,
until the call's deadline (the store timeout), so a call rides through an etcd
restart or a leader election within its timeout. Every request of the store is
safe to resend: reads are, and every write is one Txn fenced by the thread's
marker (:meth:`ReadModifyWrite._fenced_txn`), so it applies exactly once; they
are all sent with ``idempotent=True``.

Errors: an unreachable etcd raises ``torch.distributed.DistNetworkError``
naming the endpoints, within the store timeout; any other etcd failure raises
``torch.distributed.DistStoreError``; a ``get``/``wait`` that times out raises
``DistStoreError("wait timeout after <ms>ms, keys: <prefix>/<key>, ...")`` like
TCPStore; bad arguments raise ``TypeError``/``ValueError``.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ._base import (
    MAX_TXN_OPS,
    Timeout,
    _as_bytes,
    _batches,
    _dist_errors,
    _head_of,
    _seconds,
    _Shared,
    _size_batches,
)
from ._cas import _put_of
from ._layout import DEFAULT_CHUNK_BYTES, MAGIC, Layout
from ._namespace_lease import GivenLease, NamespaceLease, StoreLease
from ._queues import Queues
from ._values import _gen_of
from .client import (
    DeleteResult,
    EtcdClient,
    Event,
    KeyValue,
    PutResult,
    RangeResult,
    compare_version,
    op_delete,
    op_get,
    op_put,
)

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_LEASE_TTL", "DEFAULT_TIMEOUT", "EtcdStore"]

#: torch's default store timeout (``c10d::Store::kDefaultTimeout``).
DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)
#: Seconds a namespace outlives its last live store.
DEFAULT_LEASE_TTL = 3600

#: Every open store. torch's C++ side (PrefixStore, process groups, clone() called
#: from C++) holds a Python store without a Python reference, and pybind11 drops
#: the Python half of an object nobody in Python references; so a store keeps
#: itself alive until close().
_OPEN: set[EtcdStore] = set()
_OPEN_LOCK = threading.Lock()


class EtcdStore(Queues, dist.Store):
    """A ``torch.distributed.Store`` whose keys live in etcd under ``prefix``.

    Args:
        endpoints: ``"host:port[,host:port...]"`` or ``http(s)://`` URLs (the client
            layer's syntax), or an existing :class:`~etcd_store.client.EtcdClient`
            (shared, not closed by the store).
        prefix: the namespace; keys are stored as ``<prefix>/<key>``. Stores with
            the same endpoints and prefix see the same keys.
        timeout: how long ``get``/``wait``/``multi_get``/blocking ``queue_pop`` and
            ``barrier`` wait, and the deadline of every other call (torch's default
            store timeout, 300 s, when not given). ``set_timeout`` changes it.
        ca_cert, cert, key, user, password, protocol: TLS and auth options of
            :class:`~etcd_store.client.EtcdClient` (only with an endpoint string).
        lease: attach every key to this lease instead, which the caller owns and
            keeps alive (the store then grants, records and refreshes nothing, and
            opening it costs no RPC); ``lease_ttl`` is ignored.
        lease_ttl: seconds the namespace survives its last live store (see the
            module docstring); at least 2.
        chunk_bytes: values above this size are stored in chunks of this size.
        client_timeout: default deadline of the client built from ``endpoints``.

    The constructor reads (or creates) the namespace lease: one Range, or Range +
    LeaseGrant + Txn for the first store of a namespace. It raises
    ``DistNetworkError`` naming the endpoints when etcd cannot be reached.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str] | EtcdClient,
        prefix: str = "",
        timeout: Timeout = DEFAULT_TIMEOUT,
        *,
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
        protocol: str | None = None,
        lease_ttl: int = DEFAULT_LEASE_TTL,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        client_timeout: float = 30.0,
        lease: int | None = None,
    ) -> None:
        super().__init__()
        layout = Layout(prefix)
        seconds = _seconds(timeout)
        if not isinstance(chunk_bytes, int) or chunk_bytes < 1024:
            raise ValueError(f"EtcdStore chunk_bytes must be an int >= 1024, got {chunk_bytes!r}")
        if isinstance(endpoints, EtcdClient):
            given = {"ca_cert": ca_cert, "cert": cert, "key": key, "user": user,
                     "password": password, "protocol": protocol}
            extra = sorted(name for name, v in given.items() if v is not None)
            if extra:
                raise ValueError(
                    f"EtcdStore: {', '.join(extra)} apply only when the store builds its own "
                    "client from an endpoint string; configure the EtcdClient instead."
                )
            client, owns = endpoints, False
        elif isinstance(endpoints, (str, list, tuple)):
            client = EtcdClient(
                endpoints, timeout=client_timeout, ca_cert=ca_cert, cert=cert, key=key,
                user=user, password=password, protocol=protocol,
            )
            owns = True
        else:
            raise TypeError(
                f"EtcdStore endpoints must be a str or an EtcdClient, got {type(endpoints).__name__}"
            )
        keeper: StoreLease
        if lease is None:
            keeper = NamespaceLease(client, layout.lease_key, lease_ttl)
        else:
            keeper = GivenLease(lease)
        self._setup(_Shared(client, owns, keeper), layout, datetime.timedelta(seconds=seconds), chunk_bytes)
        try:
            with _dist_errors(f"__init__(prefix={layout.prefix!r})"):
                keeper.current(self._rpc_timeout())
        except BaseException:
            self.close()
            raise

    def _setup(
        self, shared: _Shared, layout: Layout, timeout: datetime.timedelta, chunk_bytes: int
    ) -> None:
        shared.acquire()
        self._shared = shared
        self._closer = weakref.finalize(self, shared.release)
        with _OPEN_LOCK:
            _OPEN.add(self)
        self._client = shared.client
        self._layout = layout
        self._chunk_bytes = chunk_bytes
        self._id = uuid.uuid4().hex[:16]
        self._lock = threading.Lock()
        self._known: dict[bytes, tuple[int, bytes]] = {}
        self._queues: dict[bytes, list[tuple[int, bytes]]] = {}
        self._tls = threading.local()
        self._thread_numbers = itertools.count()
        self.set_timeout(timeout)

    # ------------------------------------------------------------------ lifecycle

    @property
    def prefix(self) -> str:
        """The namespace of this store."""
        return self._layout.prefix

    @property
    def client(self) -> EtcdClient:
        """The etcd client (shared with clones)."""
        return self._client

    def close(self) -> None:
        """Stop keeping the namespace alive from this store; close the client if it owns it.

        Idempotent. The store and its clones share the client and the lease: both
        stop with the last of them. Keys stay until the namespace lease expires.
        Until closed, a store stays alive even without Python references, because
        torch's C++ side may still call it.
        """
        with _OPEN_LOCK:
            _OPEN.discard(self)
        self._closer()

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdStore({self._client.describe()!r}, prefix={self.prefix!r})"

    def clone(self) -> EtcdStore:
        """A store on the same namespace, client and lease (no RPC)."""
        twin = EtcdStore.__new__(EtcdStore)
        dist.Store.__init__(twin)
        twin._setup(self._shared, self._layout, self._timeout(), self._chunk_bytes)
        return twin

    def has_extended_api(self) -> bool:
        return True

    # ------------------------------------------------------------------ plain keys

    def set(self, key: str | bytes, value: str | bytes) -> None:  # type: ignore[override]
        """Write ``value`` at ``key``. One Txn, applied exactly once even when resent."""
        k = self._layout.key(key)
        v = _as_bytes(value, "value")
        with _dist_errors(f"set({key!r})"):
            out = self._fenced_txn(
                v, [], lambda stored, lease: [op_put(k, stored, lease=lease, prev_kv=True)], [],
                time.monotonic() + self._rpc_timeout(), f"set of {k!r}",
            )
            self._remember(k, out.revision, v)
            if out.txn.succeeded:  # a replayed write's replaced value is unknown: the lease cleans up
                self._drop_replaced(_put_of(out.txn).prev_kv, _gen_of(out.stored))

    def get(self, key: str | bytes) -> bytes:  # type: ignore[override]
        """The value of ``key``, waiting up to the store timeout for it to be set.

        One Range when the key exists; otherwise one Range and one watch from now
        (plus one more read when etcd's revision moved in between: see
        :mod:`etcd_store._base`). Raises ``DistStoreError`` on timeout.
        """
        k = self._layout.key(key)
        with _dist_errors(f"get({key!r})"):
            timeout = self._timeout().total_seconds()
            deadline = time.monotonic() + timeout
            while True:
                res = self._client.range(k, timeout=self._budget(deadline))
                if res.kvs:
                    kv = res.kvs[0]
                else:
                    kv = self._await_heads([k], res.revision, deadline, timeout, [key])[k]
                value = self._decode(kv, deadline)
                if value is not None:
                    self._remember(k, kv.mod_revision, value)
                    return value
                if time.monotonic() >= deadline:  # the chunked value kept being replaced
                    raise self._timeout_error(timeout, [key])

    def check(self, keys: Sequence[str | bytes]) -> bool:  # type: ignore[override]
        """Whether every key exists (a queue with items counts). One Txn per 64 keys."""
        ks = [self._layout.key(k) for k in self._key_list(keys)]
        if not ks:
            return True
        with _dist_errors(f"check({list(keys)!r})"):
            present, _ = self._probe(ks, self._rpc_timeout())
            return all(k in present for k in ks)

    def wait(  # type: ignore[override]
        self, keys: Sequence[str | bytes], timeout: Timeout | None = None
    ) -> None:
        """Block until every key exists (a queue with items counts) or the timeout passes.

        One Txn (per 64 keys), then one watch from now over the missing keys (and
        one more Txn when etcd's revision moved in between). Raises
        ``DistStoreError("wait timeout after ...ms, keys: ...")``.
        """
        key_list = self._key_list(keys)
        ks = [self._layout.key(k) for k in key_list]
        seconds = self._timeout().total_seconds() if timeout is None else _seconds(timeout)
        deadline = time.monotonic() + seconds
        with _dist_errors(f"wait({key_list!r})"):
            present, revision = self._probe(ks, self._budget(deadline))
            missing = {k for k in ks if k not in present}
            if not missing:
                return

            def reread() -> tuple[bool, int]:
                present, at = self._probe(list(missing), self._budget(deadline))
                missing.difference_update(present)
                return not missing, at

            def seen(ev: Event) -> bool:
                head = _head_of(self._layout, ev.key)
                if ev.type == "PUT" and head is not None:
                    missing.discard(head)
                return not missing

            if self._wait_for(min(missing), Layout.span_end(max(missing)), revision, deadline, reread, seen):
                return
            raise self._timeout_error(seconds, key_list)

    def delete_key(self, key: str | bytes) -> bool:  # type: ignore[override]
        """Delete ``key``; True if it existed. One Txn, applied exactly once even when resent."""
        k = self._layout.key(key)
        with _dist_errors(f"delete_key({key!r})"):
            out = self._fenced_txn(
                None, [compare_version(k, ">", 0)], lambda _, lease: [op_delete(k, prev_kv=True)], [],
                time.monotonic() + self._rpc_timeout(), f"delete_key of {k!r}",
            )
            self._forget(k)
            if out.txn.succeeded:
                deleted = out.txn.responses[0]
                assert isinstance(deleted, DeleteResult)
                for kv in deleted.prev_kvs:
                    self._drop_replaced(kv)
            return out.applied

    def num_keys(self) -> int:  # type: ignore[override]
        """How many keys this namespace holds (queues and internal keys not counted).

        One Range listing the keys of the namespace (keys only): queue items and the
        internal keys of namespaces nested in this one (``job/sub`` in ``job``) share
        the user key range and are left out, so it always agrees with
        :meth:`list_keys`. TCPStore counts one internal key more; this store counts
        only user keys.
        """
        return len(self._user_keys("num_keys()"))

    def list_keys(self) -> list[str]:  # type: ignore[override]
        """The keys of this namespace, sorted (queues not included). One Range."""
        return self._user_keys("list_keys()")

    def multi_get(self, keys: Sequence[str | bytes]) -> list[bytes]:  # type: ignore[override]
        """The values of ``keys``, waiting like ``get`` for missing ones.

        One Txn per 128 keys; missing keys add one watch.
        """
        key_list = self._key_list(keys)
        ks = [self._layout.key(k) for k in key_list]
        if not ks:
            return []
        with _dist_errors(f"multi_get({key_list!r})"):
            timeout = self._timeout().total_seconds()
            deadline = time.monotonic() + timeout
            unique = list(dict.fromkeys(ks))
            while True:
                found: dict[bytes, KeyValue] = {}
                revision = 0
                for batch in _batches(unique, MAX_TXN_OPS):
                    res = self._client.txn(
                        [], [op_get(k) for k in batch], timeout=self._budget(deadline), idempotent=True,
                    )
                    revision = revision or res.revision
                    for r in res.responses:
                        if isinstance(r, RangeResult) and r.kvs:
                            found[r.kvs[0].key] = r.kvs[0]
                missing = [k for k in unique if k not in found]
                if missing:
                    found.update(self._await_heads(missing, revision, deadline, timeout, key_list))
                values = {k: self._decode(found[k], deadline) for k in unique}
                if all(v is not None for v in values.values()):
                    return [values[k] for k in ks]  # type: ignore[misc]
                if time.monotonic() >= deadline:  # a chunked value kept being replaced
                    raise self._timeout_error(timeout, key_list)

    def multi_set(  # type: ignore[override]
        self, keys: Sequence[str | bytes], values: Sequence[str | bytes]
    ) -> None:
        """Write several keys. One Txn per 64 keys (or per 1 MiB of values); not atomic beyond one Txn."""
        key_list = self._key_list(keys)
        value_list = list(values)
        if len(key_list) != len(value_list):
            raise dist.DistStoreError("multiSet keys and values vectors must be of same size")
        pairs = dict(
            (self._layout.key(k), _as_bytes(v, "value")) for k, v in zip(key_list, value_list, strict=True)
        )
        if not pairs:
            return
        with _dist_errors(f"multi_set({key_list!r})"):
            deadline = time.monotonic() + self._rpc_timeout()
            # Batched by stored size: a chunked value's manifest is small.
            sized = [(k, v if self._inline(v) else MAGIC) for k, v in pairs.items()]
            for batch in _size_batches(sized, MAX_TXN_OPS // 2, self._chunk_bytes):
                self._multi_set_batch([(k, pairs[k]) for k, _ in batch], deadline)
            with self._lock:
                for k in pairs:
                    self._known.pop(k, None)

    def _multi_set_batch(self, batch: list[tuple[bytes, bytes]], deadline: float) -> None:
        """One fenced Txn writing ``batch`` (chunks first); replaced chunks deleted once applied."""
        gens: dict[bytes, str | None] = {}

        def ops(_: bytes, lease: int) -> list[Any]:
            puts = []
            for k, v in batch:
                stored = self._encode(v, lease, deadline)
                gens[k] = _gen_of(stored)
                puts.append(op_put(k, stored, lease=lease, prev_kv=True))
            return puts

        out = self._fenced_txn(None, [], ops, [], deadline, f"multi_set of {batch[0][0]!r}, ...")
        if out.txn.succeeded:
            for (k, _), r in zip(batch, out.txn.responses, strict=True):
                assert isinstance(r, PutResult)
                self._drop_replaced(r.prev_kv, gens[k])

    # ------------------------------------------------------------------ barrier

    def barrier(  # type: ignore[override]
        self, key: str | bytes, world_size: int, timeout: Timeout | None = None
    ) -> None:
        """Block until ``world_size`` callers called ``barrier`` with ``key``.

        As TCPStore: ``key`` holds the count of arrivals. One :meth:`add` and, unless
        this caller completes the barrier, one watch from now (and one Range when
        etcd's revision moved past the add's before the watch was registered).
        Raises ``DistStoreError("barrier timeout after ...ms, key: ...")``.
        """
        seconds = self._timeout().total_seconds() if timeout is None else _seconds(timeout)
        deadline = time.monotonic() + seconds
        count, revision = self._add(key, 1)
        if count >= world_size:
            return
        k = self._layout.key(key)

        def arrived(ev: Event) -> bool:
            if ev.type != "PUT" or ev.key != k:
                return False
            try:
                return int(ev.value) >= world_size
            except ValueError:
                return False

        def reread() -> tuple[bool, int]:
            res = self._client.range(k, timeout=self._budget(deadline))
            return bool(res.kvs) and arrived(Event("PUT", res.kvs[0])), res.revision

        with _dist_errors(f"barrier({key!r})"):
            if self._wait_for(k, None, revision, deadline, reread, arrived):
                return
        ms = int(round(seconds * 1000))
        text = key if isinstance(key, str) else key.decode("utf-8", "replace")
        raise dist.DistStoreError(f"barrier timeout after {ms}ms, key: {text}")

    # ------------------------------------------------------------------ helpers

    def _user_keys(self, what: str) -> list[str]:
        with _dist_errors(what):
            res = self._client.range(
                self._layout.user_start, self._layout.user_end, keys_only=True,
                timeout=self._rpc_timeout(),
            )
        keys = (self._layout.user_key(kv.key) for kv in res.kvs)
        return [k for k in keys if k is not None]
