"""Queues of :class:`~etcd_store.EtcdStore`: ``queue_push``, ``queue_pop``, ``queue_len``.

An item is a key under the queue's prefix; the oldest (lowest create revision)
is popped by a fenced Txn that also checks no older item exists. A store
remembers the item it believes oldest, *with its value* (from its own push, a
watch event, or the oldest item every pop Txn returns), so a pop is usually one
Txn, and a pop whose reply was lost and whose resend finds it applied returns
that value without reading etcd's history (which a compaction may have removed).
"""

from __future__ import annotations

import logging
import threading
import time

import torch.distributed as dist

from ._cas import ReadModifyWrite
from ._layout import Layout
from ._limits import StoreTimeout, budget, check_deadline
from ._values import ChunkedValues
from ._waits import Waits
from .client import (
    DeleteResult,
    EtcdClient,
    Event,
    KeyValue,
    RangeResult,
    compare_create,
    compare_version,
    op_delete,
    op_get,
    op_put,
    prefix_range_end,
)

log = logging.getLogger(__name__)

class Queues:
    """The queues of one namespace, and this store's guess of each queue's oldest item.

    ``values``, ``writes``, ``waits``: the store's parts that encode items, push and pop
    them exactly once, and wait for a push; ``timeout``: the store timeout.
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
        self._lock = threading.Lock()
        self._heads: dict[bytes, KeyValue] = {}  # queue prefix -> the item guessed oldest, value included

    def push(self, k: bytes, v: bytes) -> None:
        """Append ``v`` to the queue of the etcd key ``k``. One Txn, applied exactly once even when resent."""
        item = self._layout.new_queue_item(k)
        # Fenced: a resend after a lost reply cannot push the item a second time.
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

        With ``block`` it waits up to the store timeout for an item (``DistStoreError``
        on timeout), else raises ``QueueEmptyError`` at once. One Txn when this store
        knows a candidate for the oldest item (it pushed one, popped before, or was
        woken by a push); otherwise one Range first. A wrong guess costs one more Txn,
        whose failure branch returns the queue's oldest item. Waiting on an empty queue
        opens one watch from now (one more Range when etcd's revision moved since
        the empty read: see :mod:`etcd_store._waits`). A resend that finds its Txn
        applied by a send whose reply was lost returns the guessed item's value,
        which the store held before it sent the Txn: no read of etcd's history.
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
        """Wait for an item in the queue ``qp``, found empty at ``revision``; the item, value included.

        The first item pushed after the empty read is the oldest (unless popped
        meanwhile: the pop Txn checks).
        """
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
