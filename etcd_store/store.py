"""``EtcdStore``: a ``torch.distributed.Store`` over the etcd v3 API.

Code written against ``TCPStore`` runs unchanged: same methods, results, return
types and exception types (deliberate differences: docs/store.md). Every operation
costs one etcd round trip in the uncontended case (table: docs/store.md, "Cost of
each operation"); a ``get``/``wait`` of a missing key reads once, then watches from
now, without polling or lost wake-ups (:mod:`etcd_store.client.synced`). Values
above ``chunk_bytes`` (1 MiB, below etcd's default 1.5 MiB request limit) cost one
extra Put per chunk to write and one extra Txn to read.

Parts: this facade (torch's API: arguments, errors, lifecycle) over
:mod:`etcd_store._namespace` (keys, chunked values, the namespace lease, request
limits), :mod:`etcd_store._writes` (the fenced Txn, read-modify-write, plain keys,
queues) and :mod:`etcd_store._waits` (watch-based waits). Clones share the client
and the namespace lease (:class:`Shared`).

Cleanup rule (:mod:`etcd_store._namespace`): every key hangs on one namespace lease
that every live store keeps alive; ``lease_ttl`` seconds after the last store closes
or dies, etcd deletes the whole namespace.

Retries: the client's one policy (:meth:`~etcd_store.client.transport.Transport.call`)
rides through an etcd restart or leader election within the store timeout. Every request
is sent ``idempotent=True``: reads are safe to resend, and every write is one Txn fenced
by the thread's marker (:meth:`ReadModifyWrite.fenced_txn`), so it applies exactly once.

Errors: unreachable etcd raises ``torch.distributed.DistNetworkError`` naming the
endpoints, within the store timeout; any other etcd failure ``DistStoreError``; a
timed-out ``get``/``wait`` raises ``DistStoreError("wait timeout after <ms>ms, keys:
<prefix>/<key>, ...")`` like TCPStore; bad arguments ``TypeError``/``ValueError``.
"""

from __future__ import annotations

import contextlib
import datetime
import operator
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed as dist

from ._namespace import (
    DEFAULT_CHUNK_BYTES,
    ChunkedValues,
    GivenLease,
    Layout,
    NamespaceLease,
    StoreLease,
    StoreTimeout,
)
from ._waits import Waits
from ._writes import PlainKeys, Queues, ReadModifyWrite
from .client import EtcdClient
from .errors import EtcdConnectionError, EtcdError
from .options import DEFAULT_TIMEOUT as DEFAULT_CLIENT_TIMEOUT

__all__ = ["DEFAULT_LEASE_TTL", "DEFAULT_TIMEOUT", "EtcdStore"]

#: torch's default store timeout (``c10d::Store::kDefaultTimeout``).
DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)
#: Seconds a namespace outlives its last live store.
DEFAULT_LEASE_TTL = 3600

#: Every open store: torch's C++ side (PrefixStore, process groups, C++ clone()) holds
#: stores without a Python reference, and pybind11 would drop the Python half; so a
#: store keeps itself alive until close().
_OPEN: set[EtcdStore] = set()
_OPEN_LOCK = threading.Lock()


# ---------------------------------------------------------------------- torch's conventions

Timeout = datetime.timedelta | float | int


@contextlib.contextmanager
def dist_errors(what: str) -> Iterator[None]:
    """Re-raise :class:`EtcdConnectionError` (timeouts included) as ``DistNetworkError``,
    other :class:`EtcdError` as ``DistStoreError``, both naming ``EtcdStore.<what>``."""
    try:
        yield
    except EtcdConnectionError as e:
        raise dist.DistNetworkError(f"EtcdStore.{what} failed: {e}") from e
    except EtcdError as e:
        raise dist.DistStoreError(f"EtcdStore.{what} failed: {e}") from e


def as_bytes(value: Any, what: str) -> bytes:
    """A value or key given as str (UTF-8) or bytes-like; ``TypeError`` naming ``what`` otherwise."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"EtcdStore {what} must be str or bytes, got {type(value).__name__}")


def seconds(timeout: Timeout, what: str = "timeout") -> float:
    """A timeout in seconds (``timedelta`` or a number); ``TypeError``/``ValueError`` if invalid."""
    if isinstance(timeout, datetime.timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise TypeError(f"EtcdStore {what} must be a datetime.timedelta, got {timeout!r}")
    if value < 0:
        raise ValueError(f"EtcdStore {what} must not be negative, got {timeout!r}")
    return value


def key_list(keys: Sequence[str | bytes]) -> list[str | bytes]:
    """A list of keys; ``TypeError`` for a single key passed where a list is expected."""
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"EtcdStore expected a list of keys, got a single key {keys!r}")
    return list(keys)


# ---------------------------------------------------------------------- what clones share


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


class EtcdStore(dist.Store):
    """A ``torch.distributed.Store`` whose keys live in etcd under ``prefix``.

    Args:
        endpoints: ``"host:port[,host:port...]"`` or ``http(s)://`` URLs (the client
            layer's syntax), or an existing :class:`~etcd_store.client.EtcdClient`
            (shared, not closed by the store).
        prefix: the namespace; keys are stored as ``<prefix>/<key>``. Stores with
            the same endpoints and prefix see the same keys.
        timeout: how long ``get``/``wait``/``multi_get``/blocking ``queue_pop``/``barrier``
            wait, and every other call's deadline (default 300 s, torch's);
            ``set_timeout`` changes it.
        ca_cert, cert, key, user, password, protocol: TLS and auth options of
            :class:`~etcd_store.client.EtcdClient` (only with an endpoint string).
        lease: attach every key to this caller-owned, caller-refreshed lease instead
            (the store grants and refreshes nothing; opening costs no RPC;
            ``lease_ttl`` is ignored).
        lease_ttl: seconds the namespace survives its last live store; at least 2.
        chunk_bytes: values above this size are stored in chunks of this size (>= 1024).
        client_timeout: default deadline (s) of the client built from ``endpoints``.

    Opening reads the namespace lease (one Range; Range + LeaseGrant + Txn for a new
    namespace); raises ``DistNetworkError`` naming the endpoints if etcd is unreachable.
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
        client_timeout: float = DEFAULT_CLIENT_TIMEOUT,
        lease: int | None = None,
    ) -> None:
        super().__init__()
        layout = Layout(prefix)
        timeout_s = seconds(timeout)
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
        self._setup(Shared(client, owns, keeper), layout, datetime.timedelta(seconds=timeout_s), chunk_bytes)
        try:
            with dist_errors(f"__init__(prefix={layout.prefix!r})"):
                keeper.current(self._clock.rpc())
        except BaseException:
            self.close()
            raise

    def _setup(
        self, shared: Shared, layout: Layout, timeout: datetime.timedelta, chunk_bytes: int
    ) -> None:
        """Hold ``shared`` and build this store's parts (no RPC)."""
        shared.acquire()
        self._shared = shared
        self._closer = weakref.finalize(self, shared.release)
        with _OPEN_LOCK:
            _OPEN.add(self)
        client = shared.client
        self._layout = layout
        self._clock = clock = StoreTimeout.of(self)
        self._values = ChunkedValues(client, layout, chunk_bytes, clock)
        self._writes = ReadModifyWrite(client, layout, self._values, shared.lease, clock)
        self._waits = Waits(client, layout)
        self._keys = PlainKeys(client, layout, self._values, self._writes, self._waits, clock)
        self._queues = Queues(client, layout, self._values, self._writes, self._waits, clock)
        self.set_timeout(timeout)

    # ------------------------------------------------------------------ lifecycle

    @property
    def prefix(self) -> str:
        """The namespace of this store."""
        return self._layout.prefix

    @property
    def client(self) -> EtcdClient:
        """The etcd client (shared with clones)."""
        return self._shared.client

    def close(self) -> None:
        """Stop keeping the namespace alive from this store; idempotent.

        The shared client (if owned) and lease keep-alive stop with the last of the
        store and its clones; keys stay until the namespace lease expires. Until
        closed, a store stays alive without Python references (torch's C++ may call it).
        """
        with _OPEN_LOCK:
            _OPEN.discard(self)
        self._closer()

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdStore({self.client.describe()!r}, prefix={self.prefix!r})"

    def clone(self) -> EtcdStore:
        """A store on the same namespace, client and lease (no RPC)."""
        twin = EtcdStore.__new__(EtcdStore)
        dist.Store.__init__(twin)
        twin._setup(self._shared, self._layout, self._timeout(), self._values.chunk_bytes)
        return twin

    def has_extended_api(self) -> bool:
        return True

    def _timeout(self) -> datetime.timedelta:
        timeout: datetime.timedelta = dist.Store.timeout.__get__(self)  # type: ignore[attr-defined]
        return timeout

    # ------------------------------------------------------------------ plain keys

    def set(self, key: str | bytes, value: str | bytes) -> None:  # type: ignore[override]
        """Write ``value`` at ``key``. One Txn, applied exactly once even when resent."""
        k = self._layout.key(key)
        v = as_bytes(value, "value")
        with dist_errors(f"set({key!r})"):
            self._keys.set(k, v)

    def get(self, key: str | bytes) -> bytes:  # type: ignore[override]
        """The value of ``key``, waiting up to the store timeout for it to be set.

        One Range if present, else one Range and one watch from now (see the module
        docstring). Raises ``DistStoreError`` on timeout.
        """
        k = self._layout.key(key)
        with dist_errors(f"get({key!r})"):
            return self._keys.get(k, key)

    def check(self, keys: Sequence[str | bytes]) -> bool:  # type: ignore[override]
        """Whether every key exists (a queue with items counts). One Txn per 64 keys."""
        ks = [self._layout.key(k) for k in key_list(keys)]
        with dist_errors(f"check({list(keys)!r})"):
            return self._keys.check(ks)

    def wait(  # type: ignore[override]
        self, keys: Sequence[str | bytes], timeout: Timeout | None = None
    ) -> None:
        """Block until every key exists (a queue with items counts) or the timeout passes.

        One Txn per 64 keys, then one watch over the missing ones. Raises
        ``DistStoreError("wait timeout after ...ms, keys: ...")``.
        """
        names = key_list(keys)
        ks = [self._layout.key(k) for k in names]
        wait_s = self._clock.seconds() if timeout is None else seconds(timeout)
        with dist_errors(f"wait({names!r})"):
            self._waits.wait_keys(ks, wait_s, names)

    def delete_key(self, key: str | bytes) -> bool:  # type: ignore[override]
        """Delete ``key``; True if it existed. One Txn, applied exactly once even when resent."""
        k = self._layout.key(key)
        with dist_errors(f"delete_key({key!r})"):
            return self._keys.delete(k)

    def num_keys(self) -> int:  # type: ignore[override]
        """How many user keys this namespace holds; agrees with :meth:`list_keys`.

        One keys-only Range. Queue items and the internal keys of nested namespaces
        (``job/sub`` in ``job``) share the range and are left out; TCPStore counts
        one internal key more.
        """
        with dist_errors("num_keys()"):
            return len(self._keys.user_keys())

    def list_keys(self) -> list[str]:  # type: ignore[override]
        """The keys of this namespace, sorted (queues not included). One Range."""
        with dist_errors("list_keys()"):
            return self._keys.user_keys()

    def multi_get(self, keys: Sequence[str | bytes]) -> list[bytes]:  # type: ignore[override]
        """The values of ``keys``, waiting like ``get`` for missing ones. One Txn per 128 keys;
        missing keys add one watch."""
        names = key_list(keys)
        ks = [self._layout.key(k) for k in names]
        if not ks:
            return []
        with dist_errors(f"multi_get({names!r})"):
            return self._keys.multi_get(ks, names)

    def multi_set(  # type: ignore[override]
        self, keys: Sequence[str | bytes], values: Sequence[str | bytes]
    ) -> None:
        """Write several keys. One Txn per 64 keys (or per 1 MiB of values); not atomic beyond one Txn."""
        names = key_list(keys)
        value_list = list(values)
        if len(names) != len(value_list):
            raise dist.DistStoreError("multiSet keys and values vectors must be of same size")
        pairs = dict(
            (self._layout.key(k), as_bytes(v, "value")) for k, v in zip(names, value_list, strict=True)
        )
        if not pairs:
            return
        with dist_errors(f"multi_set({names!r})"):
            self._keys.multi_set(pairs)

    # ------------------------------------------------------------------ read-modify-write

    def add(self, key: str | bytes, amount: int) -> int:  # type: ignore[override]
        """Add ``amount`` to the integer at ``key`` (created at ``amount``); returns the sum.

        One Txn if the key is new or unchanged since this store last saw it; else
        each failed Txn returns the current value to retry from (no sleep), until
        the store timeout. ``DistStoreError`` for a non-integer value or on timeout.
        """
        return self._add(key, amount)[0]

    def _add(self, key: str | bytes, amount: int) -> tuple[int, int]:
        """:meth:`add`, and the revision of the write."""
        k = self._layout.key(key)
        try:
            delta = operator.index(amount)
        except TypeError:
            raise TypeError(f"EtcdStore.add amount must be an int, got {amount!r}") from None
        with dist_errors(f"add({key!r}, {amount!r})"):
            return self._writes.add(k, delta, key)

    def append(self, key: str | bytes, value: str | bytes) -> None:  # type: ignore[override]
        """Append ``value`` to ``key`` (created if missing). Same cost as :meth:`add`."""
        k = self._layout.key(key)
        v = as_bytes(value, "value")
        with dist_errors(f"append({key!r})"):
            self._writes.append(k, v)

    def compare_set(  # type: ignore[override]
        self, key: str | bytes, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``; return the value now.

        As TCPStore: a missing key is created if ``expected_value`` is empty, else left
        missing (returning ``expected_value``); a mismatch returns the current value.
        One Txn, applied at most once even when resent.
        """
        k = self._layout.key(key)
        expected = as_bytes(expected_value, "expected_value")
        desired = as_bytes(desired_value, "desired_value")
        with dist_errors(f"compare_set({key!r})"):
            return self._writes.compare_set(k, expected, desired)

    # ------------------------------------------------------------------ queues

    def queue_push(self, key: str | bytes, value: str | bytes) -> None:  # type: ignore[override]
        """Append ``value`` to the queue ``key``. One Txn, applied exactly once even when resent."""
        k = self._layout.key(key)
        v = as_bytes(value, "value")
        with dist_errors(f"queue_push({key!r})"):
            self._queues.push(k, v)

    def queue_len(self, key: str | bytes) -> int:  # type: ignore[override]
        """Items in the queue ``key`` (0 if it never existed). One Range."""
        k = self._layout.key(key)
        with dist_errors(f"queue_len({key!r})"):
            return self._queues.length(k)

    def queue_pop(self, key: str | bytes, block: bool = True) -> bytes:  # type: ignore[override]
        """Remove and return the oldest item of the queue ``key``.

        With ``block``, waits up to the store timeout (``DistStoreError``), else raises
        ``QueueEmptyError`` at once. One Txn, plus a Range first when this store knows
        no candidate (:meth:`Queues.pop <etcd_store._writes.Queues.pop>`).
        """
        k = self._layout.key(key)
        with dist_errors(f"queue_pop({key!r})"):
            return self._queues.pop(k, block, key)

    # ------------------------------------------------------------------ barrier

    def barrier(  # type: ignore[override]
        self, key: str | bytes, world_size: int, timeout: Timeout | None = None
    ) -> None:
        """Block until ``world_size`` callers called ``barrier`` with ``key``.

        As TCPStore, ``key`` counts arrivals. One :meth:`add`, and one watch unless this
        caller completes it. Raises ``DistStoreError("barrier timeout after ...ms, key: ...")``.
        """
        wait_s = self._clock.seconds() if timeout is None else seconds(timeout)
        deadline = time.monotonic() + wait_s
        count, revision = self._add(key, 1)
        if count >= world_size:
            return
        with dist_errors(f"barrier({key!r})"):
            if self._waits.await_count(self._layout.key(key), world_size, revision, deadline):
                return
        ms = int(round(wait_s * 1000))
        text = key if isinstance(key, str) else key.decode("utf-8", "replace")
        raise dist.DistStoreError(f"barrier timeout after {ms}ms, key: {text}")
