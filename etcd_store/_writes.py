"""The writes of :class:`~etcd_store.EtcdStore`: the fenced, leased Txn every write uses,
``add``/``append``/``compare_set``, the plain keys and the queues (long form: docs/store.md).

Exactly once: every write Txn also requires the writing thread's marker key unchanged and
writes a fresh op id there (:meth:`ReadModifyWrite.fenced_txn`), so the client may resend it
after a lost reply: a resend of an applied Txn fails and its failure branch shows the op id.

Read-modify-write: one Txn when the store's cached view of the key is right; a failed compare
returns the current value to retry from (no sleeps), until the store timeout.

Queues: an item is a key under the queue's prefix; the oldest (lowest create revision) is popped
by a fenced Txn that also checks no older item exists. A store remembers the item it believes
oldest *with its value* (from its push, a watch event, or the oldest item every pop Txn
returns), so a pop is usually one Txn, and a resend that finds its pop applied returns that
value without reading etcd's history (which compaction may have removed).

The parts here take etcd keys; the facade converts user keys and translates errors.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ._namespace import (
    MAGIC,
    MAX_TXN_OPS,
    ChunkedValues,
    Layout,
    StoreLease,
    StoreTimeout,
    batches,
    budget,
    check_deadline,
    gen_of,
    size_batches,
)
from ._waits import Waits
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

log = logging.getLogger(__name__)

#: Values up to this size are remembered to make the next add/append one Txn.
_REMEMBER_BYTES = 1024
_REMEMBER_KEYS = 4096


class _Marker:
    """One store thread's marker key, its last seen mod revision and op ids ("Exactly once" above)."""

    __slots__ = ("key", "mod", "seq")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.mod = 0
        self.seq = 0

    def next_id(self) -> bytes:
        self.seq += 1
        return str(self.seq).encode()


@dataclass(frozen=True)
class Fenced:
    """The outcome of :meth:`ReadModifyWrite.fenced_txn`.

    ``txn``: the result, without the marker read. ``replayed``: an earlier send applied
    (reply lost) and ``txn`` is the failed resend, so success results are unknown.
    ``revision``: where the Txn applied (or, if not, read).
    """

    stored: bytes
    txn: TxnResult
    replayed: bool
    revision: int

    @property
    def applied(self) -> bool:
        return self.txn.succeeded or self.replayed


class ReadModifyWrite:
    """One store's fenced, leased Txn, ``add``, ``append``, ``compare_set``.

    Holds the store's per-thread markers and its cache of values last read or written
    (so the next ``add``/``append`` is one Txn); ``timeout`` is each write's deadline.
    """

    def __init__(
        self, client: EtcdClient, layout: Layout, values: ChunkedValues, lease: StoreLease,
        timeout: StoreTimeout,
    ) -> None:
        self._client = client
        self._layout = layout
        self._values = values
        self._lease = lease
        self._timeout = timeout
        self._id = uuid.uuid4().hex[:16]
        self._lock = threading.Lock()
        self._known: dict[bytes, tuple[int, bytes]] = {}
        self._tls = threading.local()
        self._thread_numbers = itertools.count()

    def add(self, k: bytes, delta: int, key: str | bytes) -> tuple[int, int]:
        """:meth:`EtcdStore.add <etcd_store.EtcdStore.add>` on ``k``: (sum, revision). Raises
        ``EtcdTimeoutError``, or ``DistStoreError`` naming ``key`` for a non-integer value."""

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

        new, revision = self.update(k, plus)
        return int(new), revision

    def append(self, k: bytes, v: bytes) -> None:
        """Append ``v`` to ``k`` (created if missing). Same cost as :meth:`add`."""
        self.update(k, lambda old: (old or b"") + v)

    def compare_set(self, k: bytes, expected: bytes, desired: bytes) -> bytes:
        """:meth:`EtcdStore.compare_set <etcd_store.EtcdStore.compare_set>` on ``k``."""
        t = self._timeout.rpc()
        deadline = time.monotonic() + t
        what = f"compare_set of {k!r}"
        guard: list[Any] | None
        if expected == b"":
            guard = [compare_create(k, "==", 0)]
        elif self._values.inline(expected):
            guard = [compare_value(k, "==", expected)]
        else:
            guard = None  # a chunked expected value: compare after reading
        while True:
            check_deadline(deadline, what, t)
            if guard is None:
                res = self._client.range(k, timeout=budget(deadline))
                if not res.kvs:
                    if expected == b"":  # missing now: created, as by TCPStore
                        guard = [compare_create(k, "==", 0)]
                        continue
                    return expected
                current = self._values.decode(res.kvs[0], deadline)
                if current is None:
                    continue
                if current != expected:
                    return current
                guard = [compare_mod(k, "==", res.kvs[0].mod_revision)]
            out = self.fenced_txn(
                desired, guard, lambda stored, lease: [op_put(k, stored, lease=lease, prev_kv=True)],
                [op_get(k)], deadline, what,
            )
            if out.applied:
                self.remember(k, out.revision, desired)
                if out.txn.succeeded:
                    self._values.drop_replaced(put_of(out.txn).prev_kv, gen_of(out.stored))
                return desired
            rng = out.txn.responses[0]
            assert isinstance(rng, RangeResult)
            if not rng.kvs:
                if expected == b"":  # deleted since it was read: created, as by TCPStore
                    guard = [compare_create(k, "==", 0)]
                    continue
                return expected
            kv = rng.kvs[0]
            current = self._values.decode(kv, deadline)
            if current is None:
                guard = None
                continue
            if current == expected:  # b"" present, or a chunked value equal to expected
                guard = [compare_mod(k, "==", kv.mod_revision)]
                continue
            self.remember(k, kv.mod_revision, current)
            return current

    def update(self, k: bytes, compute: Callable[[bytes | None], bytes]) -> tuple[bytes, int]:
        """Read-modify-write ``k`` by compare-and-swap; (new value, revision). Retries from each
        failed Txn's value until the store timeout (then ``EtcdTimeoutError``)."""
        t = self._timeout.rpc()
        deadline = time.monotonic() + t
        what = f"read-modify-write of {k!r}"
        with self._lock:
            known: tuple[int, bytes | None] = self._known.get(k, (0, None))
        while True:
            base_mod, base = known
            new = compute(base)
            out = self.fenced_txn(
                new, [compare_mod(k, "==", base_mod)],
                lambda stored, lease: [op_put(k, stored, lease=lease, prev_kv=True)],
                [op_get(k)], deadline, what,
            )
            if out.applied:
                self.remember(k, out.revision, new)
                if out.txn.succeeded:
                    self._values.drop_replaced(put_of(out.txn).prev_kv, gen_of(out.stored))
                return new, out.revision
            check_deadline(deadline, what, t)
            current = out.txn.responses[0]
            assert isinstance(current, RangeResult)
            known = (0, None)
            if current.kvs:
                value = self._values.decode(current.kvs[0], deadline)
                if value is not None:  # None: replaced since; the next Txn fails and shows it
                    known = (current.kvs[0].mod_revision, value)

    def _marker(self) -> _Marker:
        marker: _Marker | None = getattr(self._tls, "marker", None)
        if marker is None:
            with self._lock:
                number = next(self._thread_numbers)
            marker = _Marker(self._layout.marker_key(self._id, number))
            self._tls.marker = marker
        return marker

    def fenced_txn(
        self, value: bytes | None, compare: Sequence[Any],
        success: Callable[[bytes, int], list[Any]], failure: Sequence[Any],
        deadline: float, what: str,
    ) -> Fenced:
        """One Txn, applied exactly once ("Exactly once" above), its writes on the namespace lease.

        ``value`` is encoded first (chunks: :meth:`ChunkedValues.encode`); ``success(stored,
        lease)`` builds the success ops (once per lease). Returns once applied (``replayed``
        if by a lost-reply send) or ``compare`` failed; a failure only on a stale marker is
        resent. Raises ``EtcdTimeoutError`` past ``deadline``; a lost lease is renewed and
        the Txn resent. Chunks of a certain failure are deleted; after an error (outcome
        unknown) the lease removes them.
        """
        marker = self._marker()
        op_id = marker.next_id()

        def attempt(lease: int) -> Fenced:
            stored = b"" if value is None else self._values.encode(value, lease, deadline)
            ops = success(stored, lease)
            while True:
                seen = marker.mod
                txn = self._client.txn(
                    [*compare, compare_mod(marker.key, "==", seen)],
                    [*ops, op_put(marker.key, op_id, lease=lease)],
                    [*failure, op_get(marker.key)],
                    timeout=budget(deadline), idempotent=True,
                )
                if txn.succeeded:
                    marker.mod = txn.revision
                    return Fenced(stored, TxnResult(True, txn.revision, txn.responses[:-1]), False, txn.revision)
                mark = txn.responses[-1]
                assert isinstance(mark, RangeResult)
                marker.mod = mark.kvs[0].mod_revision if mark.kvs else 0
                result = TxnResult(False, txn.revision, txn.responses[:-1])
                if mark.kvs and mark.kvs[0].value == op_id:
                    log.debug("%s: applied by an earlier send whose reply was lost", what)
                    return Fenced(stored, result, True, marker.mod)
                if marker.mod == seen:  # the marker held: the caller's compare failed
                    self._values.discard(stored)
                    return Fenced(stored, result, False, txn.revision)
                check_deadline(deadline, what, self._timeout.rpc())

        return self._lease.attached(attempt, budget(deadline))

    def remember(self, k: bytes, revision: int, value: bytes) -> None:
        with self._lock:
            if len(value) > _REMEMBER_BYTES:
                self._known.pop(k, None)
                return
            if len(self._known) >= _REMEMBER_KEYS and k not in self._known:
                self._known.clear()
            self._known[k] = (revision, value)

    def forget(self, *ks: bytes) -> None:
        """Forget what this store knew of ``ks`` (the next write of one reads it first)."""
        with self._lock:
            for k in ks:
                self._known.pop(k, None)


def put_of(txn: TxnResult) -> PutResult:
    put = txn.responses[0]
    assert isinstance(put, PutResult)
    return put


class _NamespacePart:
    """What :class:`PlainKeys` and :class:`Queues` are given: the client, the namespace's layout and
    values, the writes, the waits and the store timeout (only ``EtcdStore`` builds them)."""

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


class PlainKeys(_NamespacePart):
    """Reads and writes of a namespace's plain keys (costs: the :class:`~etcd_store.EtcdStore` methods)."""

    def set(self, k: bytes, v: bytes) -> None:
        """Write ``v`` at ``k``; one fenced Txn."""
        out = self._writes.fenced_txn(
            v, [], lambda stored, lease: [op_put(k, stored, lease=lease, prev_kv=True)], [],
            time.monotonic() + self._timeout.rpc(), f"set of {k!r}",
        )
        self._writes.remember(k, out.revision, v)
        if out.txn.succeeded:  # a replayed write's replaced value is unknown: the lease cleans up
            self._values.drop_replaced(put_of(out.txn).prev_kv, gen_of(out.stored))

    def get(self, k: bytes, key: str | bytes) -> bytes:
        """:meth:`EtcdStore.get <etcd_store.EtcdStore.get>` on ``k`` (``key``: as the user named
        it, for the timeout error)."""
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
        """Whether every key exists (a queue with items counts)."""
        if not ks:
            return True
        present, _ = self._waits.probe(ks, self._timeout.rpc())
        return all(k in present for k in ks)

    def delete(self, k: bytes) -> bool:
        """Delete ``k``; True if it existed. One fenced Txn."""
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
        the user named them)."""
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
        """Write several keys: one Txn per 64 keys or ``chunk_bytes`` of values, each atomic alone."""
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


class Queues(_NamespacePart):
    """The queues of one namespace, and this store's guess of each queue's oldest item."""

    def __init__(
        self, client: EtcdClient, layout: Layout, values: ChunkedValues, writes: ReadModifyWrite,
        waits: Waits, timeout: StoreTimeout,
    ) -> None:
        super().__init__(client, layout, values, writes, waits, timeout)
        self._lock = threading.Lock()
        self._heads: dict[bytes, KeyValue] = {}  # queue prefix -> the item guessed oldest, value included

    def push(self, k: bytes, v: bytes) -> None:
        """Append ``v`` to the queue of the etcd key ``k``; one fenced Txn (a resend cannot push twice)."""
        item = self._layout.new_queue_item(k)
        out = self._writes.fenced_txn(
            v, [], lambda stored, lease: [op_put(item, stored, lease=lease)],
            [], time.monotonic() + self._timeout.rpc(), f"queue_push to {k!r}",
        )
        # Remember the item: a later pop by this store can guess it is the oldest.
        with self._lock:
            self._heads.setdefault(Layout.queue_prefix(k), KeyValue(item, out.stored, out.revision, out.revision, 1, 0))

    def length(self, k: bytes) -> int:
        """Items in the queue of ``k`` (0 if it never existed). One Range."""
        qp = Layout.queue_prefix(k)
        return self._client.range(qp, prefix=True, count_only=True, timeout=self._timeout.rpc()).count

    def pop(self, k: bytes, block: bool, key: str | bytes) -> bytes:
        """Remove and return the oldest item of the queue of ``k`` (``key``, as the user named it).

        Blocking and errors as :meth:`EtcdStore.queue_pop <etcd_store.EtcdStore.queue_pop>`.
        One Txn when this store has a guess ("Queues" above), else one Range first; a wrong
        guess costs one more Txn, whose failure branch returns the oldest item. An empty
        queue is waited on with one watch from now (:mod:`etcd_store._waits`).
        """
        qp = Layout.queue_prefix(k)
        end = prefix_range_end(qp)
        timeout = self._timeout.seconds()
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                head = self._heads.get(qp)
            if head is None:
                res = self._client.range(qp, end, sort_by="create", limit=1, timeout=budget(deadline))
                if res.kvs:
                    head = res.kvs[0]
                elif not block:
                    raise dist.QueueEmptyError("queue is empty")
                else:
                    head = self._await_push(qp, end, res.revision, deadline, timeout, key)
            guess = head.key
            out = self._writes.fenced_txn(
                None,
                # The guess still exists and no item in the queue is older.
                [compare_version(guess, ">", 0), compare_create(qp, ">", head.create_revision - 1, range_end=end)],
                lambda _, lease: [op_delete(guess, prev_kv=True), _oldest(qp, end)],  # noqa: B023 (called at once)
                [_oldest(qp, end)], deadline, f"queue_pop of {qp!r}",
            )
            if out.txn.succeeded:
                deleted, rest = out.txn.responses
                assert isinstance(deleted, DeleteResult) and isinstance(rest, RangeResult)
                self._set_head(qp, rest)
                return self._take_item(deleted.prev_kvs[0], deadline)
            rest = out.txn.responses[0]
            assert isinstance(rest, RangeResult)
            self._set_head(qp, rest)
            if out.replayed:
                # Applied by an earlier send whose reply was lost: it removed the guess, whose value we hold.
                return self._take_item(head, deadline)
            check_deadline(deadline, f"queue_pop of {qp!r}", timeout)

    def _await_push(
        self, qp: bytes, end: bytes, revision: int, deadline: float, timeout: float, key: str | bytes
    ) -> KeyValue:
        """The first item pushed to ``qp`` after it was empty at ``revision``, value included:
        the oldest, unless popped meanwhile (the pop Txn checks)."""
        first: list[KeyValue] = []

        def pushed(ev: Event) -> bool:
            if ev.type == "PUT":
                first.append(ev.kv)
            return bool(first)

        def reread() -> tuple[bool, int]:
            res = self._client.range(qp, end, sort_by="create", limit=1, timeout=budget(deadline))
            first.extend(res.kvs)
            return bool(first), res.revision

        if not self._waits.wait_for(qp, end, revision, deadline, reread, pushed):
            raise self._waits.timeout_error(timeout, [key])
        return first[0]

    def _set_head(self, qp: bytes, oldest: RangeResult) -> None:
        """Guess the item a pop Txn returned as the oldest (none: the queue was empty)."""
        with self._lock:
            if oldest.kvs:
                self._heads[qp] = oldest.kvs[0]
            else:
                self._heads.pop(qp, None)

    def _take_item(self, kv: KeyValue, deadline: float) -> bytes:
        """The value of a popped item (its chunks read, then deleted)."""
        value = self._values.decode(kv, deadline, live=False)
        assert value is not None
        self._values.drop_replaced(kv)
        return value


def _oldest(qp: bytes, end: bytes) -> object:
    """A Txn op reading the queue's oldest item, value included (etcd sorts the whole range; one item comes back)."""
    return op_get(qp, end, sort_by="create", limit=1)
