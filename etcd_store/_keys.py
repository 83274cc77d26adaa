"""The plain keys of :class:`~etcd_store.EtcdStore`: ``set``, ``get``, ``check``,
``delete_key``, ``multi_get``, ``multi_set``, ``list_keys`` on etcd keys (the facade converts
the user's keys with :class:`~etcd_store._layout.Layout` and translates errors).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from ._cas import ReadModifyWrite, put_of
from ._layout import MAGIC, Layout
from ._limits import MAX_TXN_OPS, StoreTimeout, batches, budget, size_batches
from ._values import ChunkedValues, gen_of
from ._waits import Waits
from .client import (
    DeleteResult,
    EtcdClient,
    KeyValue,
    PutResult,
    RangeResult,
    compare_version,
    op_delete,
    op_get,
    op_put,
)

log = logging.getLogger(__name__)


class PlainKeys:
    """Reads and writes of a namespace's plain keys.

    ``values``: the encoding of values; ``writes``: the fenced Txn and the cache of known
    values; ``waits``: the waits for missing keys; ``timeout``: the store timeout.
    """

    def __init__(
        self, client: EtcdClient, layout: Layout, values: ChunkedValues, writes: ReadModifyWrite,
        waits: Waits, timeout: StoreTimeout,
    ) -> None:
        self._client = client
        self._layout = layout
        self._values = values
        self._writes = writes
        self._waits = waits
        self._timeout = timeout

    def set(self, k: bytes, v: bytes) -> None:
        """Write ``v`` at ``k``. One Txn, applied exactly once even when resent."""
        out = self._writes.fenced_txn(
            v, [], lambda stored, lease: [op_put(k, stored, lease=lease, prev_kv=True)], [],
            time.monotonic() + self._timeout.rpc(), f"set of {k!r}",
        )
        self._writes.remember(k, out.revision, v)
        if out.txn.succeeded:  # a replayed write's replaced value is unknown: the lease cleans up
            self._values.drop_replaced(put_of(out.txn).prev_kv, gen_of(out.stored))

    def get(self, k: bytes, key: str | bytes) -> bytes:
        """The value of ``k``, waiting up to the store timeout for it to be set (``key``: as the
        user named it, for the timeout error).

        One Range when the key exists; otherwise one Range and one watch from now (plus
        one more read when etcd's revision moved in between).
        """
        timeout = self._timeout.seconds()
        deadline = time.monotonic() + timeout
        while True:
            res = self._client.range(k, timeout=budget(deadline))
            if res.kvs:
                kv = res.kvs[0]
            else:
                kv = self._waits.await_heads([k], res.revision, deadline, timeout, [key])[k]
            value = self._values.decode(kv, deadline)
            if value is not None:
                self._writes.remember(k, kv.mod_revision, value)
                return value
            if time.monotonic() >= deadline:  # the chunked value kept being replaced
                raise self._waits.timeout_error(timeout, [key])

    def check(self, ks: Sequence[bytes]) -> bool:
        """Whether every key exists (a queue with items counts). One Txn per 64 keys."""
        if not ks:
            return True
        present, _ = self._waits.probe(ks, self._timeout.rpc())
        return all(k in present for k in ks)

    def delete(self, k: bytes) -> bool:
        """Delete ``k``; True if it existed. One Txn, applied exactly once even when resent."""
        out = self._writes.fenced_txn(
            None, [compare_version(k, ">", 0)], lambda _, lease: [op_delete(k, prev_kv=True)], [],
            time.monotonic() + self._timeout.rpc(), f"delete_key of {k!r}",
        )
        self._writes.forget(k)
        if out.txn.succeeded:
            deleted = out.txn.responses[0]
            assert isinstance(deleted, DeleteResult)
            for kv in deleted.prev_kvs:
                self._values.drop_replaced(kv)
        return out.applied

    def user_keys(self) -> list[str]:
        """The user keys of the namespace, sorted (no queue items, no internal keys). One Range."""
        res = self._client.range(
            self._layout.user_start, self._layout.user_end, keys_only=True, timeout=self._timeout.rpc(),
        )
        keys = (self._layout.user_key(kv.key) for kv in res.kvs)
        return [k for k in keys if k is not None]

    def multi_get(self, ks: Sequence[bytes], shown: Sequence[str | bytes]) -> list[bytes]:
        """The values of ``ks``, waiting like :meth:`get` for missing ones (``shown``: the keys as
        the user named them). One Txn per 128 keys; missing keys add one watch."""
        timeout = self._timeout.seconds()
        deadline = time.monotonic() + timeout
        unique = list(dict.fromkeys(ks))
        while True:
            found: dict[bytes, KeyValue] = {}
            revision = 0
            for batch in batches(unique, MAX_TXN_OPS):
                res = self._client.txn([], [op_get(k) for k in batch], timeout=budget(deadline), idempotent=True)
                revision = revision or res.revision
                for r in res.responses:
                    if isinstance(r, RangeResult) and r.kvs:
                        found[r.kvs[0].key] = r.kvs[0]
            missing = [k for k in unique if k not in found]
            if missing:
                found.update(self._waits.await_heads(missing, revision, deadline, timeout, shown))
            values = {k: self._values.decode(found[k], deadline) for k in unique}
            if all(v is not None for v in values.values()):
                return [values[k] for k in ks]  # type: ignore[misc]
            if time.monotonic() >= deadline:  # a chunked value kept being replaced
                raise self._waits.timeout_error(timeout, shown)

    def multi_set(self, pairs: dict[bytes, bytes]) -> None:
        """Write several keys. One Txn per 64 keys (or per ``chunk_bytes`` of values); not atomic
        beyond one Txn."""
        deadline = time.monotonic() + self._timeout.rpc()
        # Batched by stored size: a chunked value's manifest is small.
        sized = [(k, v if self._values.inline(v) else MAGIC) for k, v in pairs.items()]
        for batch in size_batches(sized, MAX_TXN_OPS // 2, self._values.chunk_bytes):
            self._multi_set_batch([(k, pairs[k]) for k, _ in batch], deadline)
        self._writes.forget(*pairs)

    def _multi_set_batch(self, batch: list[tuple[bytes, bytes]], deadline: float) -> None:
        """One fenced Txn writing ``batch`` (chunks first); replaced chunks deleted once applied."""
        gens: dict[bytes, str | None] = {}

        def ops(_: bytes, lease: int) -> list[Any]:
            puts = []
            for k, v in batch:
                stored = self._values.encode(v, lease, deadline)
                gens[k] = gen_of(stored)
                puts.append(op_put(k, stored, lease=lease, prev_kv=True))
            return puts

        out = self._writes.fenced_txn(None, [], ops, [], deadline, f"multi_set of {batch[0][0]!r}, ...")
        if out.txn.succeeded:
            for (k, _), r in zip(batch, out.txn.responses, strict=True):
                assert isinstance(r, PutResult)
                self._values.drop_replaced(r.prev_kv, gens[k])
