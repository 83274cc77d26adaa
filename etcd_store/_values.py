"""Chunked values of :class:`~etcd_store.EtcdStore`: values above ``chunk_bytes``.

A large value is written as chunks under a fresh, never reused generation id (one
Put each) and a manifest at the user key naming that generation (see
:mod:`etcd_store._layout`). Chunks are immutable once written, so a reader reads
them at etcd's latest revision, never at an old one that compaction may have
removed: one Txn that reads the chunks if the key still holds the manifest the
reader found. If the key moved on meanwhile the reader reads the key again (the
callers do, within their deadline); if it still holds the manifest but chunks are
missing, :class:`ChunksMissing` says so at once.

Chunks of a value are deleted only when the outcome is known: after a write that
replaced it (the replaced value is the write's own ``prev_kv``), or for a write
that etcd certainly did not apply. Anything left over goes with the namespace lease.
"""

from __future__ import annotations

import logging
import uuid

from ._layout import MAGIC, Layout, Manifest
from ._limits import StoreTimeout, budget
from .client import EtcdClient, KeyValue, RangeResult, compare_mod, op_get, prefix_range_end
from .errors import EtcdError

log = logging.getLogger(__name__)


class ChunksMissing(EtcdError):
    """A key holds a chunk manifest whose chunks are not all in etcd (deleted by hand or lost)."""


class ChunkedValues:
    """Encoding and decoding of stored values (inline, or a manifest of chunks) in one namespace.

    ``chunk_bytes``: the largest value stored inline, and the size of a chunk. ``timeout``:
    the store timeout (the deadline of a clean-up Delete).
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
        """What to store at the user key: the value, or a manifest after writing its chunks.

        The chunk Puts share ``deadline`` (a ``time.monotonic()`` value).
        """
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

        ``live``: ``kv`` is the key's current version as read; None means the key
        no longer holds it (replaced since: read the key again). For a queue item
        already removed by its popper, ``live=False`` reads the chunks unguarded
        (only that popper deletes them). Raises :class:`ChunksMissing` when the
        manifest is current and its chunks are incomplete.
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


def gen_of(stored: bytes) -> str | None:
    """The generation of the chunks a stored value names (None for an inline value)."""
    manifest = Manifest.decode(stored)
    return manifest.gen if manifest is not None else None
