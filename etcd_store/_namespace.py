"""How an :class:`~etcd_store.EtcdStore` namespace lies in etcd: its keys, how one value is
stored, the lease every key rides on, and the limits of one request (long form:
docs/store.md, "Keys" and "Cleanup rule").

Keys, for a namespace ``ns`` (the store's prefix, UTF-8):

=============================================  =========================================
``ns/<key>``                                   a user key; its value, or a chunk manifest
``ns/<key>\\0q<id>``                            one item of the queue ``<key>``
``ns\\0lease``                                  the id of the namespace lease
``ns\\0c/<gen>/<index>``                        one chunk of a value too big for one request
``ns\\0w/<store>/<thread>``                     the last write of one store thread (exactly-once marker)
=============================================  =========================================

Everything lies under ``ns/`` or ``ns\\0``, so a role granted the prefix ``ns`` suffices.
User keys contain no NUL, so every internal key is outside ``ns/`` (``ns\\0...`` sorts
before it) or contains one. A nested namespace (``job/sub`` in ``job``) puts its internal
keys in the outer user range (``job/sub\\0lease``), where a NUL not followed by ``q`` marks
them as neither user keys nor queue items: ``check``/``wait`` read only a key and
``[ns/<key>\\0q, ns/<key>\\0r)``, waits ignore them, ``num_keys``/``list_keys`` skip NUL keys.

Values (:class:`ChunkedValues`): up to ``chunk_bytes`` a value is stored as is. A bigger
one (or one starting with :data:`MAGIC`) is written as chunks under a fresh, never reused
generation id (one Put each), then committed by a small *manifest* (``MAGIC`` + JSON) at the
user key. Chunks are immutable, so a reader reads them at etcd's latest revision (never an
old one compaction may have removed), in one Txn guarded by the manifest it found: it never
sees a mix of two writes; if the key moved on, it reads the key again (callers do, within
their deadline); if chunks are missing under a current manifest, :class:`ChunksMissing`
says so at once. Chunks are deleted only when the outcome is known: after a write that
replaced them (its own ``prev_kv``), or for a write etcd certainly did not apply. Leftovers
go with the lease.

The namespace lease (:class:`NamespaceLease`), recorded under ``ns\\0lease`` (on the lease
itself): the first store grants and records it (create-if-absent Txn, safe to resend: its own
id recorded means applied); later stores adopt it. Every live store refreshes it
(:class:`~etcd_store.client.Session`) and none revokes it. If it expired under a live store
(session lost, or :class:`~etcd_store.errors.EtcdLeaseNotFound`), the store forgets it and the
next write creates or adopts a new one and is retried (:meth:`StoreLease.attached`); keys
written under the old one are gone.

Limits: deadlines are ``time.monotonic()`` values; every RPC gets at least
:data:`MIN_RPC_TIMEOUT` seconds, even when a wait has less left; a Txn holds at most
:data:`MAX_TXN_OPS` ops.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch.distributed as dist

from .client import (
    EtcdClient,
    KeyValue,
    RangeResult,
    Session,
    TxnResult,
    compare_create,
    compare_mod,
    op_get,
    op_put,
    prefix_range_end,
    renewing_lease,
)
from .errors import EtcdError, EtcdLeaseNotFound, EtcdPermissionDenied, EtcdTimeoutError

log = logging.getLogger(__name__)

MAGIC = b"\x00etcd_store.chunked\x00"
DEFAULT_CHUNK_BYTES = 1024 * 1024
#: etcd's default ``--max-txn-ops``.
MAX_TXN_OPS = 128
#: The shortest deadline given to one RPC, even when a wait has less time left.
MIN_RPC_TIMEOUT = 1.0
_T = TypeVar("_T")


# ---------------------------------------------------------------------- keys


class Layout:
    """The etcd keys of one namespace."""

    def __init__(self, prefix: str) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"EtcdStore prefix must be a str, got {type(prefix).__name__}")
        if "\0" in prefix:
            raise ValueError(f"EtcdStore prefix {prefix!r} contains a NUL character")
        self.prefix = prefix.rstrip("/")
        self.ns = self.prefix.encode("utf-8", "surrogateescape")
        self.user_start = self.ns + b"/"
        self.user_end = self.ns + b"0"  # "/" + 1: the end of the user range
        self.lease_key = self.ns + b"\0lease"
        self._chunks = self.ns + b"\0c/"
        self._markers = self.ns + b"\0w/"

    def key(self, key: str | bytes) -> bytes:
        """The etcd key of a user key. Raises TypeError/ValueError naming a bad key."""
        if isinstance(key, str):
            raw = key.encode("utf-8", "surrogateescape")
        elif isinstance(key, (bytes, bytearray, memoryview)):
            raw = bytes(key)
        else:
            raise TypeError(f"EtcdStore key must be str, got {type(key).__name__}: {key!r}")
        if b"\0" in raw:
            raise ValueError(f"EtcdStore key {key!r} contains a NUL character, which etcd_store reserves")
        return self.user_start + raw

    def user_key(self, etcd_key: bytes) -> str | None:
        """The user key of an etcd key under ``ns/``, None for an internal key."""
        if not etcd_key.startswith(self.user_start) or b"\0" in etcd_key[len(self.user_start) :]:
            return None
        return etcd_key[len(self.user_start) :].decode("utf-8", "surrogateescape")

    def display(self, key: str | bytes) -> str:
        """A key as error messages show it (``<prefix>/<key>``, like TCPStore's ``/<key>``)."""
        text = key if isinstance(key, str) else bytes(key).decode("utf-8", "replace")
        return f"{self.prefix}/{text}"

    def head_of(self, etcd_key: bytes) -> bytes | None:
        """The user key an event's key belongs to (a queue item belongs to its queue's key).

        None for the internal key of a namespace nested in this one (``ns/sub\\0lease``).
        """
        nul = etcd_key.find(b"\0", len(self.user_start))
        if nul < 0:
            return etcd_key
        head = etcd_key[:nul]
        return head if etcd_key.startswith(Layout.queue_prefix(head)) else None

    @staticmethod
    def span_end(etcd_key: bytes) -> bytes:
        """End of the range holding a user key and its queue items."""
        return etcd_key + b"\x01"

    @staticmethod
    def queue_prefix(etcd_key: bytes) -> bytes:
        return etcd_key + b"\0q"

    def new_queue_item(self, etcd_key: bytes) -> bytes:
        return self.queue_prefix(etcd_key) + uuid.uuid4().hex.encode()

    def chunk_prefix(self, gen: str) -> bytes:
        return self._chunks + gen.encode() + b"/"

    def chunk_key(self, gen: str, index: int) -> bytes:
        return self.chunk_prefix(gen) + b"%08d" % index

    def marker_key(self, store_id: str, thread_no: int) -> bytes:
        return self._markers + f"{store_id}/{thread_no}".encode()


# ---------------------------------------------------------------------- limits


class StoreTimeout:
    """The store timeout, read at each use: torch holds it and ``set_timeout`` may change it.
    :meth:`of` reads a store's without keeping the store alive."""

    def __init__(self, read: Callable[[], datetime.timedelta]) -> None:
        self._read = read

    @classmethod
    def of(cls, store: dist.Store) -> StoreTimeout:
        ref = weakref.ref(store)

        def read() -> datetime.timedelta:
            owner = ref()
            assert owner is not None, "a part of a store outlived its store"
            timeout: datetime.timedelta = dist.Store.timeout.__get__(owner)  # type: ignore[attr-defined]
            return timeout

        return cls(read)

    def seconds(self) -> float:
        """The store timeout in seconds (how long a wait waits)."""
        return self._read().total_seconds()

    def rpc(self) -> float:
        """The deadline of a call that does not wait: the store timeout, at least :data:`MIN_RPC_TIMEOUT`."""
        return max(self.seconds(), MIN_RPC_TIMEOUT)


def budget(deadline: float) -> float:
    """The time left until ``deadline`` for one RPC, at least :data:`MIN_RPC_TIMEOUT`."""
    return max(deadline - time.monotonic(), MIN_RPC_TIMEOUT)


def check_deadline(deadline: float, what: str, seconds: float) -> None:
    """Raise :class:`EtcdTimeoutError` naming ``what`` once ``deadline`` (monotonic) passed."""
    if time.monotonic() >= deadline:
        raise EtcdTimeoutError(f"{what} did not complete within {seconds:g} s (the store timeout)")


def batches(items: Sequence[_T], size: int) -> Iterator[Sequence[_T]]:
    """``items`` in slices of at most ``size``."""
    for i in range(0, len(items), size):
        yield items[i : i + size]


def size_batches(
    items: Sequence[tuple[bytes, bytes]], max_ops: int, max_bytes: int
) -> Iterator[list[tuple[bytes, bytes]]]:
    """Key-value pairs in batches of at most ``max_ops`` pairs and (past the first) ``max_bytes``."""
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


# ---------------------------------------------------------------------- values


@dataclass(frozen=True)
class Manifest:
    """A committed chunked value: ``count`` chunks under generation ``gen``."""

    gen: str
    count: int
    size: int

    def encode(self) -> bytes:
        return MAGIC + json.dumps({"gen": self.gen, "count": self.count, "size": self.size}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Manifest | None:
        """The manifest stored in ``raw``, or None if ``raw`` is a plain value."""
        if not raw.startswith(MAGIC):
            return None
        try:
            doc = json.loads(raw[len(MAGIC) :])
            return cls(str(doc["gen"]), int(doc["count"]), int(doc["size"]))
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring a malformed chunk manifest %r", raw[:200])
            return None


def gen_of(stored: bytes) -> str | None:
    """The generation of the chunks a stored value names (None for an inline value)."""
    manifest = Manifest.decode(stored)
    return manifest.gen if manifest is not None else None


class ChunksMissing(EtcdError):
    """A key holds a chunk manifest whose chunks are not all in etcd (deleted by hand or lost)."""


class ChunkedValues:
    """Encodes and decodes stored values (inline, or a manifest of chunks) of one namespace.

    ``chunk_bytes`` is both the largest inline value and the chunk size; ``timeout`` bounds
    a clean-up Delete.
    """

    def __init__(self, client: EtcdClient, layout: Layout, chunk_bytes: int, timeout: StoreTimeout) -> None:
        self._client = client
        self._layout = layout
        self.chunk_bytes = chunk_bytes
        self._timeout = timeout

    def inline(self, value: bytes) -> bool:
        """Whether ``value`` is stored as it is (else as a manifest of chunks)."""
        return len(value) <= self.chunk_bytes and not value.startswith(MAGIC)

    def encode(self, value: bytes, lease: int, deadline: float) -> bytes:
        """What to store at the user key: the value, or a manifest after writing its chunks
        (the Puts share ``deadline``)."""
        if self.inline(value):
            return value
        size = self.chunk_bytes
        gen = uuid.uuid4().hex
        count = max(1, -(-len(value) // size))
        for i in range(count):
            self._client.put(
                self._layout.chunk_key(gen, i), value[i * size : (i + 1) * size],
                lease=lease, timeout=budget(deadline),
            )
        return Manifest(gen, count, len(value)).encode()

    def decode(self, kv: KeyValue, deadline: float, *, live: bool = True) -> bytes | None:
        """The value ``kv`` holds, its chunks read at etcd's latest revision.

        ``live``: guard the read by ``kv``'s mod revision; None means the key was replaced
        since (read it again). ``live=False`` (a queue item its popper already removed)
        reads unguarded: only that popper deletes the chunks. Raises :class:`ChunksMissing`
        when the manifest is current and its chunks are incomplete.
        """
        manifest = Manifest.decode(kv.value)
        if manifest is None:
            return kv.value
        start = self._layout.chunk_prefix(manifest.gen)
        end = prefix_range_end(start)
        if live:
            txn = self._client.txn(
                [compare_mod(kv.key, "==", kv.mod_revision)], [op_get(start, end)], [],
                timeout=budget(deadline), idempotent=True,
            )
            if not txn.succeeded:
                return None
            chunks = txn.responses[0]
            assert isinstance(chunks, RangeResult)
        else:
            chunks = self._client.range(start, end, timeout=budget(deadline))
        data = b"".join(c.value for c in chunks.kvs)
        if len(chunks.kvs) != manifest.count or len(data) != manifest.size:
            raise ChunksMissing(
                f"the value at {kv.key!r} is a manifest of {manifest.count} chunks ({manifest.size} "
                f"bytes, generation {manifest.gen}) but etcd holds {len(chunks.kvs)} of those "
                f"chunks ({len(data)} bytes): they were deleted outside this store"
            )
        return data

    def discard(self, stored: bytes) -> None:
        """Delete the chunks of a manifest that etcd certainly never committed."""
        gen = gen_of(stored)
        if gen is not None:
            self._delete_chunks(gen)

    def drop_replaced(self, prev: KeyValue | None, own_gen: str | None = None) -> None:
        """Delete the chunks of a value that our own applied write overwrote or deleted."""
        if prev is None:
            return
        gen = gen_of(prev.value)
        if gen is not None and gen != own_gen:
            self._delete_chunks(gen)

    def _delete_chunks(self, gen: str) -> None:
        try:
            self._client.delete(self._layout.chunk_prefix(gen), prefix=True, timeout=self._timeout.rpc())
        except EtcdError as e:  # harmless: the namespace lease removes them later
            log.warning("could not delete the chunks of %s: %s", gen, e)


# ---------------------------------------------------------------------- the lease


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
        """The lease id to attach writes to, found or created if needed. A lease whose session
        ended (lost, or keep-alive failed for good) is forgotten first: nobody would refresh it."""
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
        """The recorded lease or a new one we record; and whether it was adopted. A lease etcd
        refuses (``PERMISSION_DENIED`` on the record) is left for another grant, once."""
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
                # etcd refused the lease (someone attached a key to it first: see
                # renewing_lease) or the record key (then the next lease fails too)
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
        """A new lease; the client draws its id, so a grant resent after a lost reply cannot
        leave a second lease behind."""
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
    """A caller-owned, caller-refreshed lease (``EtcdStore(lease=...)``); no RPC here. Once etcd
    forgets it, writes fail with :class:`~etcd_store.errors.EtcdLeaseNotFound` (not ours to renew)."""

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
