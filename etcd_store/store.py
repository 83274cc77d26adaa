"""``EtcdStore``: a ``torch.distributed.Store`` over the etcd v3 API.

Code written against ``TCPStore`` runs unchanged: same methods, results, return
types and exception types (see the README section "EtcdStore" for the few
deliberate differences). Every operation costs one etcd round trip in the
uncontended case:

=================================  ============================================
``set``, ``queue_push``            one Put
``get`` (key present)              one Range
``get``/``wait``/``multi_get``      one read, then one watch from the revision
(key missing)                      of that read (no polling, no lost wake-up)
``multi_get``, ``multi_set``,      one Txn per 128 / 64 / 128 keys
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
``delete_key``                     one DeleteRange
=================================  ============================================

Values larger than ``chunk_bytes`` (1 MiB, below etcd's default 1.5 MiB request
limit) cost one extra Put per chunk to write and one extra Range to read.

Cleanup rule (see :mod:`etcd_store._namespace_lease`): every key of a
namespace is attached to one namespace lease that every live store of the
namespace keeps alive; ``lease_ttl`` seconds after the last store is closed or
its process died, etcd deletes the whole namespace.

Retries: one policy, the client's (:meth:`EtcdClient._call`): each RPC gets attempts
with growing deadlines (2 s, 4 s, 8 s, ...) and fails over to the next endpoint,
until the call's deadline (the store timeout), so a call rides through an etcd
restart or a leader election within its timeout. Every request of the store is
safe to resend: plain writes are idempotent and read-modify-writes are fenced
(see ``_Marker``), so they are all sent with ``idempotent=True``.

Errors: an unreachable etcd raises ``torch.distributed.DistNetworkError``
naming the endpoints, within the store timeout; any other etcd failure raises
``torch.distributed.DistStoreError``; a ``get``/``wait`` that times out raises
``DistStoreError("wait timeout after <ms>ms, keys: <prefix>/<key>, ...")`` like
TCPStore; bad arguments raise ``TypeError``/``ValueError``.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime
import itertools
import logging
import operator
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from ._layout import DEFAULT_CHUNK_BYTES, MAGIC, Layout, Manifest
from ._namespace_lease import GivenLease, NamespaceLease, StoreLease
from .client import (
    DeleteResult,
    EtcdClient,
    Event,
    KeyValue,
    PutResult,
    RangeResult,
    TxnResult,
    compare_create,
    compare_mod,
    compare_value,
    compare_version,
    op_delete,
    op_get,
    op_put,
    prefix_range_end,
)
from .errors import EtcdCompactedError, EtcdConnectionError, EtcdError

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_LEASE_TTL", "DEFAULT_TIMEOUT", "EtcdStore"]

#: torch's default store timeout (``c10d::Store::kDefaultTimeout``).
DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)
#: Seconds a namespace outlives its last live store.
DEFAULT_LEASE_TTL = 3600
#: etcd's default ``--max-txn-ops``.
MAX_TXN_OPS = 128
#: The shortest deadline given to one RPC, even when a wait has less time left.
MIN_RPC_TIMEOUT = 1.0
#: Values up to this size are remembered to make the next add/append one Txn.
_REMEMBER_BYTES = 1024
_REMEMBER_KEYS = 4096
#: Items of a queue this store remembers as candidates for the oldest.
_QUEUE_GUESSES = 64

_T = TypeVar("_T")
Timeout = datetime.timedelta | float | int


@contextlib.contextmanager
def _dist_errors(what: str) -> Iterator[None]:
    """Re-raise client errors as the exception types torch's stores raise."""
    try:
        yield
    except EtcdConnectionError as e:
        raise dist.DistNetworkError(f"EtcdStore.{what} failed: {e}") from e
    except EtcdError as e:
        raise dist.DistStoreError(f"EtcdStore.{what} failed: {e}") from e


def _as_bytes(value: Any, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"EtcdStore {what} must be str or bytes, got {type(value).__name__}")


def _seconds(timeout: Timeout, what: str = "timeout") -> float:
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"EtcdStore {what} must be a datetime.timedelta, got {timeout!r}")
    if seconds < 0:
        raise ValueError(f"EtcdStore {what} must not be negative, got {timeout!r}")
    return seconds


def _head_of(layout: Layout, etcd_key: bytes) -> bytes:
    """The user key an event's key belongs to (a queue item belongs to its queue's key)."""
    nul = etcd_key.find(b"\0", len(layout.user_start))
    return etcd_key if nul < 0 else etcd_key[:nul]


#: Every open store. torch's C++ side (PrefixStore, process groups, clone() called
#: from C++) holds a Python store without a Python reference, and pybind11 drops
#: the Python half of an object nobody in Python references; so a store keeps
#: itself alive until close().
_OPEN: set[EtcdStore] = set()
_OPEN_LOCK = threading.Lock()


class _Marker:
    """Per store thread: the key recording this thread's last add/append/queue_pop.

    Those three are not idempotent, so their Txn also writes a unique op id
    here and requires this key unchanged since the thread last saw it. A Txn
    whose reply was lost and that the client replays then fails, and its
    failure branch shows the op id: the op was applied exactly once.
    """

    __slots__ = ("key", "mod", "seq")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.mod = 0
        self.seq = 0

    def next_id(self) -> bytes:
        self.seq += 1
        return str(self.seq).encode()


class _Shared:
    """What a store and its clones share: the client, the namespace lease, a reference count."""

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
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            self.lease.close()
            if self.owns_client:
                self.client.close()


class EtcdStore(dist.Store):
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
        keeper = NamespaceLease(client, layout.lease_key, lease_ttl) if lease is None else GivenLease(lease)
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
        """Write ``value`` at ``key``. One Put."""
        k = self._layout.key(key)
        v = _as_bytes(value, "value")
        with _dist_errors(f"set({key!r})"):
            t = self._rpc_timeout()
            res = self._shared.lease.attached(
                lambda lease: self._put(k, v, lease, t), t
            )
            self._remember(k, res[0].revision, v)
            self._drop_replaced(res[0].prev_kv, res[1])

    def get(self, key: str | bytes) -> bytes:  # type: ignore[override]
        """The value of ``key``, waiting up to the store timeout for it to be set.

        One Range when the key exists; otherwise one Range and one watch from
        that Range's revision. Raises ``DistStoreError`` on timeout.
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
                    kv = self._await_heads([k], res.revision + 1, deadline, timeout, [key])[k]
                value = self._decode(kv)
                if value is not None:
                    self._remember(k, kv.mod_revision, value)
                    return value

    def check(self, keys: Sequence[str | bytes]) -> bool:  # type: ignore[override]
        """Whether every key exists (a queue with items counts). One Txn per 128 keys."""
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

        One Txn (per 128 keys), then one watch from its revision over the missing
        keys. Raises ``DistStoreError("wait timeout after ...ms, keys: ...")``.
        """
        key_list = self._key_list(keys)
        ks = [self._layout.key(k) for k in key_list]
        seconds = self._timeout().total_seconds() if timeout is None else _seconds(timeout)
        deadline = time.monotonic() + seconds
        with _dist_errors(f"wait({key_list!r})"):
            while True:
                present, revision = self._probe(ks, self._budget(deadline))
                missing = {k for k in ks if k not in present}
                if not missing:
                    return

                def seen(ev: Event, missing: builtins.set[bytes] = missing) -> bool:
                    if ev.type == "PUT":
                        missing.discard(_head_of(self._layout, ev.key))
                    return not missing

                try:
                    if self._watch(min(missing), Layout.span_end(max(missing)), revision + 1,
                                   deadline, seen):
                        return
                except EtcdCompactedError:
                    continue
                raise self._timeout_error(seconds, key_list)

    def delete_key(self, key: str | bytes) -> bool:  # type: ignore[override]
        """Delete ``key``; True if it existed. One DeleteRange."""
        k = self._layout.key(key)
        with _dist_errors(f"delete_key({key!r})"):
            res = self._client.delete(k, prev_kv=True, timeout=self._rpc_timeout())
            self._forget(k)
            for kv in res.prev_kvs:
                self._drop_replaced(kv)
            return res.deleted > 0

    def num_keys(self) -> int:  # type: ignore[override]
        """How many keys this namespace holds (queues and internal keys not counted).

        One Txn of two count-only ranges while no queue item was ever pushed in the
        namespace; after that one more Range listing the keys (queue items share the
        user key range and must be left out). TCPStore counts one internal key more;
        this store counts only user keys.
        """
        layout = self._layout
        with _dist_errors("num_keys()"):
            res = self._client.txn(
                [],
                [op_get(layout.user_start, layout.user_end, count_only=True),
                 op_get(layout.queues_key, count_only=True)],
                timeout=self._rpc_timeout(),
                idempotent=True,
            )
        users, queues = res.responses
        assert isinstance(users, RangeResult) and isinstance(queues, RangeResult)
        if queues.count == 0:
            return users.count
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
                    found.update(self._await_heads(missing, revision + 1, deadline, timeout, key_list))
                values = {k: self._decode(found[k]) for k in unique}
                if all(v is not None for v in values.values()):
                    return [values[k] for k in ks]  # type: ignore[misc]

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
            t = self._rpc_timeout()

            def write(lease: int) -> list[tuple[PutResult, str | None]]:
                stored = {k: self._encode(v, lease, t) for k, v in pairs.items()}
                results: list[tuple[PutResult, str | None]] = []
                for batch in _size_batches(list(stored.items()), MAX_TXN_OPS // 2, self._chunk_bytes):
                    res = self._client.txn(
                        [], [op_put(k, v, lease=lease, prev_kv=True) for k, v in batch],
                        timeout=t, idempotent=True,
                    )
                    for (_, v), r in zip(batch, res.responses, strict=True):
                        assert isinstance(r, PutResult)
                        results.append((r, _gen_of(v)))
                return results

            for put, gen in self._shared.lease.attached(write, t):
                self._drop_replaced(put.prev_kv, gen)
            with self._lock:
                for k in pairs:
                    self._known.pop(k, None)

    # ------------------------------------------------------------------ read-modify-write

    def add(self, key: str | bytes, amount: int) -> int:  # type: ignore[override]
        """Add ``amount`` to the integer at ``key`` (created at ``amount``); returns the sum.

        One Txn when the key is new or unchanged since this store last saw it;
        otherwise the failed Txn returns the current value and the next one
        retries from it (no sleep). Raises ``DistStoreError`` if the value is not
        an integer.
        """
        return self._add(key, amount)[0]

    def append(self, key: str | bytes, value: str | bytes) -> None:  # type: ignore[override]
        """Append ``value`` to ``key`` (created if missing). Same cost as :meth:`add`."""
        k = self._layout.key(key)
        v = _as_bytes(value, "value")
        with _dist_errors(f"append({key!r})"):
            self._update(k, lambda old: (old or b"") + v)

    def compare_set(  # type: ignore[override]
        self, key: str | bytes, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``; return the value now.

        As TCPStore: a missing key is created when ``expected_value`` is empty and
        left missing otherwise (``expected_value`` is returned); a mismatch returns
        the current value. One Txn.
        """
        k = self._layout.key(key)
        expected = _as_bytes(expected_value, "expected_value")
        desired = _as_bytes(desired_value, "desired_value")
        with _dist_errors(f"compare_set({key!r})"):
            return self._compare_set(k, expected, desired)

    def _compare_set(self, k: bytes, expected: bytes, desired: bytes) -> bytes:
        t = self._rpc_timeout()
        guard: list[Any] | None
        if expected == b"":
            guard = [compare_create(k, "==", 0)]
        elif self._inline(expected):
            guard = [compare_value(k, "==", expected)]
        else:
            guard = None  # a chunked expected value: compare after reading
        while True:
            if guard is None:
                res = self._client.range(k, timeout=t)
                if not res.kvs:
                    return expected
                current = self._decode(res.kvs[0])
                if current is None:
                    continue
                if current != expected:
                    return current
                guard = [compare_mod(k, "==", res.kvs[0].mod_revision)]
            stored, txn = self._leased_txn(
                desired, guard, lambda stored, lease: [op_put(k, stored, lease=lease, prev_kv=True)],
                [op_get(k)], t,
            )
            if txn.succeeded:
                put = txn.responses[0]
                assert isinstance(put, PutResult)
                self._remember(k, txn.revision, desired)
                self._drop_replaced(put.prev_kv, _gen_of(stored))
                return desired
            rng = txn.responses[0]
            assert isinstance(rng, RangeResult)
            if not rng.kvs:
                return expected
            kv = rng.kvs[0]
            if kv.value == stored:
                return desired  # our own write, replayed by the client after a lost reply
            self._discard(stored)
            current = self._decode(kv)
            if current is None:
                guard = None
                continue
            if current == expected:  # b"" present, or a chunked value equal to expected
                guard = [compare_mod(k, "==", kv.mod_revision)]
                continue
            self._remember(k, kv.mod_revision, current)
            return current

    def _add(self, key: str | bytes, amount: int) -> tuple[int, int]:
        k = self._layout.key(key)
        try:
            delta = operator.index(amount)
        except TypeError:
            raise TypeError(f"EtcdStore.add amount must be an int, got {amount!r}") from None

        def plus(old: bytes | None) -> bytes:
            if old is None:
                return str(delta).encode()
            try:
                number = int(old)
            except ValueError:
                raise dist.DistStoreError(
                    f"EtcdStore.add({key!r}): the value {old[:64]!r} is not an integer"
                ) from None
            return str(number + delta).encode()

        with _dist_errors(f"add({key!r}, {amount!r})"):
            new, revision = self._update(k, plus)
        return int(new), revision

    def _update(self, k: bytes, compute: Callable[[bytes | None], bytes]) -> tuple[bytes, int]:
        """Read-modify-write ``k`` with a compare-and-swap Txn; returns (new value, revision)."""
        t = self._rpc_timeout()
        marker = self._marker()
        op_id = marker.next_id()
        with self._lock:
            known: tuple[int, bytes | None] = self._known.get(k, (0, None))
        while True:
            base_mod, base = known
            new = compute(base)
            stored, txn = self._leased_txn(
                new,
                [compare_mod(k, "==", base_mod), compare_mod(marker.key, "==", marker.mod)],
                lambda stored, lease: [op_put(k, stored, lease=lease, prev_kv=True),
                                       op_put(marker.key, op_id, lease=lease)],
                [op_get(k), op_get(marker.key)],
                t,
            )
            if txn.succeeded:
                marker.mod = txn.revision
                put = txn.responses[0]
                assert isinstance(put, PutResult)
                self._remember(k, txn.revision, new)
                self._drop_replaced(put.prev_kv, _gen_of(stored))
                return new, txn.revision
            current, mark = txn.responses
            assert isinstance(current, RangeResult) and isinstance(mark, RangeResult)
            if mark.kvs and mark.kvs[0].value == op_id:
                # An earlier attempt was applied; the client replayed it after a lost reply.
                marker.mod = mark.kvs[0].mod_revision
                self._remember(k, marker.mod, new)
                return new, marker.mod
            self._discard(stored)
            marker.mod = mark.kvs[0].mod_revision if mark.kvs else 0
            if not current.kvs:
                known = (0, None)
                continue
            kv = current.kvs[0]
            value = self._decode(kv)
            while value is None:  # chunks compacted away: read the key afresh
                fresh = self._client.range(k, timeout=t)
                if not fresh.kvs:
                    break
                kv = fresh.kvs[0]
                value = self._decode(kv)
            known = (kv.mod_revision, value) if value is not None else (0, None)

    # ------------------------------------------------------------------ queues

    def queue_push(self, key: str | bytes, value: str | bytes) -> None:  # type: ignore[override]
        """Append ``value`` to the queue ``key``. One Txn: put the item, and mark the
        namespace as holding queues (see :meth:`num_keys`)."""
        k = self._layout.key(key)
        v = _as_bytes(value, "value")
        item = self._layout.new_queue_item(k)
        queues_key = self._layout.queues_key
        with _dist_errors(f"queue_push({key!r})"):
            t = self._rpc_timeout()
            res = self._shared.lease.attached(
                lambda lease: self._client.txn(
                    [],
                    [op_put(item, self._encode(v, lease, t), lease=lease), op_put(queues_key, b"1", lease=lease)],
                    timeout=t,
                    idempotent=True,  # the item key is unique: a replay writes the same two keys
                ),
                t,
            )
        # Remember the item: a later queue_pop by this store can guess it is the oldest.
        qp = Layout.queue_prefix(k)
        with self._lock:
            known = self._queues.get(qp, [])
            if len(known) < _QUEUE_GUESSES:  # only the oldest matters; a producer stays small
                self._queues[qp] = sorted([*known, (res.revision, item)])

    def queue_len(self, key: str | bytes) -> int:  # type: ignore[override]
        """Items in the queue ``key`` (0 if it never existed). One Range."""
        qp = Layout.queue_prefix(self._layout.key(key))
        with _dist_errors(f"queue_len({key!r})"):
            return self._client.range(qp, prefix=True, count_only=True, timeout=self._rpc_timeout()).count

    def queue_pop(self, key: str | bytes, block: bool = True) -> bytes:  # type: ignore[override]
        """Remove and return the oldest item of the queue ``key``.

        With ``block`` it waits up to the store timeout for an item (``DistStoreError``
        on timeout), else raises ``QueueEmptyError`` at once. One Txn when this store
        knows a candidate for the oldest item (it pushed one, popped before, or was
        woken by a push); otherwise one Range first. A wrong guess costs one more Txn,
        whose failure branch returns the queue's items.
        """
        qp = Layout.queue_prefix(self._layout.key(key))
        end = prefix_range_end(qp)
        with _dist_errors(f"queue_pop({key!r})"):
            timeout = self._timeout().total_seconds()
            deadline = time.monotonic() + timeout
            t = self._rpc_timeout()
            marker = self._marker()
            op_id = marker.next_id()
            while True:
                with self._lock:
                    items = self._queues.get(qp)
                if not items:
                    res = self._client.range(qp, end, keys_only=True, timeout=self._budget(deadline))
                    items = sorted((kv.create_revision, kv.key) for kv in res.kvs)
                    if not items:
                        if not block:
                            raise dist.QueueEmptyError("queue is empty")
                        first: list[KeyValue] = []

                        def pushed(ev: Event, first: list[KeyValue] = first) -> bool:
                            if ev.type == "PUT":
                                first.append(ev.kv)
                            return bool(first)

                        try:
                            if not self._watch(qp, end, res.revision + 1, deadline, pushed):
                                raise self._timeout_error(timeout, [key])
                        except EtcdCompactedError:
                            continue
                        # The first push after an empty read is the oldest item.
                        items = [(first[0].create_revision, first[0].key)]
                created, guess = items[0]
                _, txn = self._leased_txn(
                    None,
                    # The guess still exists and no item in the queue is older.
                    [compare_version(guess, ">", 0),
                     compare_create(qp, ">", created - 1, range_end=end),
                     compare_mod(marker.key, "==", marker.mod)],
                    # (called at once, in this iteration: B023 does not apply)
                    lambda _, lease: [op_delete(guess, prev_kv=True),  # noqa: B023
                                      op_get(qp, end, keys_only=True), op_put(marker.key, op_id, lease=lease)],
                    [op_get(qp, end, keys_only=True), op_get(marker.key)],
                    t,
                )
                if txn.succeeded:
                    deleted, rest = txn.responses[0], txn.responses[1]
                    assert isinstance(deleted, DeleteResult) and isinstance(rest, RangeResult)
                    self._set_queue(qp, rest)
                    marker.mod = txn.revision
                    return self._take_item(deleted.prev_kvs[0])
                rest, mark = txn.responses
                assert isinstance(rest, RangeResult) and isinstance(mark, RangeResult)
                self._set_queue(qp, rest)
                if mark.kvs and mark.kvs[0].value == op_id:
                    # Applied by an earlier attempt whose reply was lost: read what it removed.
                    marker.mod = mark.kvs[0].mod_revision
                    old = self._client.range(guess, revision=marker.mod - 1, timeout=t)
                    return self._take_item(old.kvs[0])
                marker.mod = mark.kvs[0].mod_revision if mark.kvs else 0

    def _set_queue(self, qp: bytes, rest: RangeResult) -> None:
        items = sorted((kv.create_revision, kv.key) for kv in rest.kvs)[:_QUEUE_GUESSES]
        with self._lock:
            self._queues[qp] = items

    def _take_item(self, kv: KeyValue) -> bytes:
        value = self._decode(kv)
        if value is None:
            raise dist.DistStoreError(f"EtcdStore.queue_pop: the chunks of item {kv.key!r} are gone")
        self._drop_replaced(kv)
        return value

    # ------------------------------------------------------------------ barrier

    def barrier(  # type: ignore[override]
        self, key: str | bytes, world_size: int, timeout: Timeout | None = None
    ) -> None:
        """Block until ``world_size`` callers called ``barrier`` with ``key``.

        As TCPStore: ``key`` holds the count of arrivals. One :meth:`add` and, unless
        this caller completes the barrier, one watch from the add's revision.
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

        with _dist_errors(f"barrier({key!r})"):
            while True:
                try:
                    if self._watch(k, None, revision + 1, deadline, arrived):
                        return
                except EtcdCompactedError:
                    res = self._client.range(k, timeout=self._budget(deadline))
                    revision = res.revision
                    if res.kvs and arrived(Event("PUT", res.kvs[0])):
                        return
                    continue
                ms = int(round(seconds * 1000))
                text = key if isinstance(key, str) else key.decode("utf-8", "replace")
                raise dist.DistStoreError(f"barrier timeout after {ms}ms, key: {text}")

    # ------------------------------------------------------------------ helpers

    def _timeout(self) -> datetime.timedelta:
        timeout: datetime.timedelta = dist.Store.timeout.__get__(self)  # type: ignore[attr-defined]
        return timeout

    def _rpc_timeout(self) -> float:
        return max(self._timeout().total_seconds(), MIN_RPC_TIMEOUT)

    @staticmethod
    def _budget(deadline: float) -> float:
        return max(deadline - time.monotonic(), MIN_RPC_TIMEOUT)

    @staticmethod
    def _key_list(keys: Sequence[str | bytes]) -> list[str | bytes]:
        if isinstance(keys, (str, bytes)):
            raise TypeError(f"EtcdStore expected a list of keys, got a single key {keys!r}")
        return list(keys)

    def _timeout_error(self, seconds: float, keys: Sequence[str | bytes]) -> dist.DistStoreError:
        shown = ", ".join(self._layout.display(k) for k in keys)
        return dist.DistStoreError(f"wait timeout after {int(round(seconds * 1000))}ms, keys: {shown}")

    def _marker(self) -> _Marker:
        marker: _Marker | None = getattr(self._tls, "marker", None)
        if marker is None:
            with self._lock:
                number = next(self._thread_numbers)
            marker = _Marker(self._layout.marker_key(self._id, number))
            self._tls.marker = marker
        return marker

    def _leased_txn(
        self, value: bytes | None, compare: Sequence[Any],
        success: Callable[[bytes, int], list[Any]], failure: Sequence[Any], t: float,
    ) -> tuple[bytes, TxnResult]:
        """One guarded Txn whose writes ride on the namespace lease; (stored value, result).

        ``value`` is stored first (its chunks, when it is large: see :meth:`_encode`);
        ``success(stored, lease)`` builds the success ops. If etcd lost the lease, the
        lease is renewed and the Txn sent again; chunks of a Txn that failed are deleted.
        """

        def attempt(lease: int) -> tuple[bytes, TxnResult]:
            stored = b"" if value is None else self._encode(value, lease, t)
            try:
                # Fenced (compares on the key and the thread's marker): safe to replay.
                return stored, self._client.txn(
                    compare, success(stored, lease), failure, timeout=t, idempotent=True
                )
            except EtcdError:
                self._discard(stored)
                raise

        return self._shared.lease.attached(attempt, t)

    def _put(self, k: bytes, v: bytes, lease: int, t: float) -> tuple[PutResult, str | None]:
        stored = self._encode(v, lease, t)
        return self._client.put(k, stored, lease=lease, prev_kv=True, timeout=t), _gen_of(stored)

    def _remember(self, k: bytes, revision: int, value: bytes) -> None:
        with self._lock:
            if len(value) > _REMEMBER_BYTES:
                self._known.pop(k, None)
                return
            if len(self._known) >= _REMEMBER_KEYS and k not in self._known:
                self._known.clear()
            self._known[k] = (revision, value)

    def _forget(self, k: bytes) -> None:
        with self._lock:
            self._known.pop(k, None)

    def _probe(self, ks: Sequence[bytes], timeout: float) -> tuple[builtins.set[bytes], int]:
        """Which keys exist (or have queue items), and the revision of the read."""
        present: builtins.set[bytes] = builtins.set()
        revision = 0
        unique = list(dict.fromkeys(ks))
        for batch in _batches(unique, MAX_TXN_OPS):
            res = self._client.txn(
                [], [op_get(k, Layout.span_end(k), count_only=True) for k in batch],
                timeout=timeout, idempotent=True,
            )
            revision = revision or res.revision
            for k, r in zip(batch, res.responses, strict=True):
                if isinstance(r, RangeResult) and r.count:
                    present.add(k)
        return present, revision

    def _watch(
        self, start: bytes, end: bytes | None, revision: int, deadline: float,
        on_event: Callable[[Event], bool],
    ) -> bool:
        """Watch ``[start, end)`` from ``revision`` until ``on_event`` says done (True) or the deadline (False)."""
        watch = self._client.watch(start, end, start_revision=revision)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                for ev in watch.get(timeout=remaining):
                    if on_event(ev):
                        return True
        finally:
            watch.cancel()

    def _await_heads(
        self, heads: Sequence[bytes], revision: int, deadline: float, seconds: float,
        shown: Sequence[str | bytes],
    ) -> dict[bytes, KeyValue]:
        """Wait until each key in ``heads`` is written; their first written KeyValues."""
        wanted = set(heads)
        found: dict[bytes, KeyValue] = {}

        def seen(ev: Event) -> bool:
            if ev.type == "PUT" and ev.key in wanted and ev.key not in found:
                found[ev.key] = ev.kv
            return len(found) == len(wanted)

        while True:
            try:
                if self._watch(min(wanted), Layout.span_end(max(wanted)), revision, deadline, seen):
                    return found
            except EtcdCompactedError:
                # Too far behind: read the keys afresh, then watch from that read.
                missing = [k for k in wanted if k not in found]
                res = self._client.txn([], [op_get(k) for k in missing],
                                       timeout=self._budget(deadline), idempotent=True)
                for r in res.responses:
                    if isinstance(r, RangeResult) and r.kvs:
                        found[r.kvs[0].key] = r.kvs[0]
                if len(found) == len(wanted):
                    return found
                revision = res.revision + 1
                continue
            raise self._timeout_error(seconds, shown)

    def _user_keys(self, what: str) -> list[str]:
        with _dist_errors(what):
            res = self._client.range(
                self._layout.user_start, self._layout.user_end, keys_only=True,
                timeout=self._rpc_timeout(),
            )
        keys = (self._layout.user_key(kv.key) for kv in res.kvs)
        return [k for k in keys if k is not None]

    # ------------------------------------------------------------------ chunked values

    def _inline(self, value: bytes) -> bool:
        return len(value) <= self._chunk_bytes and not value.startswith(MAGIC)

    def _encode(self, value: bytes, lease: int, timeout: float) -> bytes:
        """What to store at the user key: the value, or a manifest after writing its chunks."""
        if self._inline(value):
            return value
        size = self._chunk_bytes
        gen = uuid.uuid4().hex
        count = max(1, -(-len(value) // size))
        for i in range(count):
            self._client.put(
                self._layout.chunk_key(gen, i), value[i * size : (i + 1) * size],
                lease=lease, timeout=timeout,
            )
        return Manifest(gen, count, len(value)).encode()

    def _decode(self, kv: KeyValue) -> bytes | None:
        """The value ``kv`` holds; None if its chunks are gone (replaced and compacted)."""
        manifest = Manifest.decode(kv.value)
        if manifest is None:
            return kv.value
        try:
            res = self._client.range(
                self._layout.chunk_prefix(manifest.gen), prefix=True, revision=kv.mod_revision,
                timeout=self._rpc_timeout(),
            )
        except EtcdCompactedError:
            return None
        data = b"".join(c.value for c in res.kvs)
        if len(res.kvs) != manifest.count or len(data) != manifest.size:
            return None
        return data

    def _discard(self, stored: bytes) -> None:
        """Delete the chunks of a manifest that was never committed."""
        gen = _gen_of(stored)
        if gen is not None:
            self._delete_chunks(gen)

    def _drop_replaced(self, prev: KeyValue | None, own_gen: str | None = None) -> None:
        """Delete the chunks of a value that was overwritten or deleted (not our own)."""
        if prev is None:
            return
        gen = _gen_of(prev.value)
        if gen is not None and gen != own_gen:
            self._delete_chunks(gen)

    def _delete_chunks(self, gen: str) -> None:
        try:
            self._client.delete(self._layout.chunk_prefix(gen), prefix=True, timeout=self._rpc_timeout())
        except EtcdError as e:  # harmless: the namespace lease removes them later
            log.warning("could not delete the chunks of %s: %s", gen, e)


def _gen_of(stored: bytes) -> str | None:
    manifest = Manifest.decode(stored)
    return manifest.gen if manifest is not None else None


def _batches(items: Sequence[_T], size: int) -> Iterator[Sequence[_T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _size_batches(
    items: Sequence[tuple[bytes, bytes]], max_ops: int, max_bytes: int
) -> Iterator[list[tuple[bytes, bytes]]]:
    batch: list[tuple[bytes, bytes]] = []
    size = 0
    for k, v in items:
        n = len(k) + len(v)
        if batch and (len(batch) >= max_ops or size + n > max_bytes):
            yield batch
            batch, size = [], 0
        batch.append((k, v))
        size += n
    if batch:
        yield batch
