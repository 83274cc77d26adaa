"""Queues of :class:`~etcd_store.EtcdStore`: ``queue_push``, ``queue_pop``, ``queue_len``.

An item is a key under the queue's prefix; the oldest (lowest create revision)
is popped by a fenced Txn that also checks no older item exists. A store
remembers candidates for the oldest item, so a pop is usually one Txn.
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

#: Items of a queue this store remembers as candidates for the oldest.
_QUEUE_GUESSES = 64


class Queues:
    """The queues of one namespace, and this store's guesses of each queue's oldest items.

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
        self._queues: dict[bytes, list[tuple[int, bytes]]] = {}

    def push(self, k: bytes, v: bytes) -> None:
        """Append ``v`` to the queue of the etcd key ``k``. One Txn, applied exactly once even when resent."""
        item = self._layout.new_queue_item(k)
        # Fenced: a resend after a lost reply cannot push the item a second time.
        out = self._writes.fenced_txn(
            v, [], lambda stored, lease: [op_put(item, stored, lease=lease)],
            [], time.monotonic() + self._timeout.rpc(), f"queue_push to {k!r}",
        )
        # Remember the item: a later pop by this store can guess it is the oldest.
        qp = Layout.queue_prefix(k)
        with self._lock:
            known = self._queues.get(qp, [])
            if len(known) < _QUEUE_GUESSES:  # only the oldest matters; a producer stays small
                self._queues[qp] = sorted([*known, (out.revision, item)])

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
        whose failure branch returns the queue's items. Waiting on an empty queue
        opens one watch from now (one more Range when etcd's revision moved since
        the empty read: see :mod:`etcd_store._waits`).
        """
        qp = Layout.queue_prefix(k)
        end = prefix_range_end(qp)
        timeout = self._timeout.seconds()
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                items = self._queues.get(qp)
            if not items:
                res = self._client.range(qp, end, keys_only=True, timeout=budget(deadline))
                items = sorted((kv.create_revision, kv.key) for kv in res.kvs)
                if not items:
                    if not block:
                        raise dist.QueueEmptyError("queue is empty")
                    items = [self._await_push(qp, end, res.revision, deadline, timeout, key)]
            created, guess = items[0]
            out = self._writes.fenced_txn(
                None,
                # The guess still exists and no item in the queue is older.
                [compare_version(guess, ">", 0), compare_create(qp, ">", created - 1, range_end=end)],
                lambda _, lease: [op_delete(guess, prev_kv=True),  # noqa: B023 (called at once)
                                  op_get(qp, end, keys_only=True)],
                [op_get(qp, end, keys_only=True)], deadline, f"queue_pop of {qp!r}",
            )
            if out.txn.succeeded:
                deleted, rest = out.txn.responses
                assert isinstance(deleted, DeleteResult) and isinstance(rest, RangeResult)
                self._set_queue(qp, rest)
                return self._take_item(deleted.prev_kvs[0], deadline)
            rest = out.txn.responses[0]
            assert isinstance(rest, RangeResult)
            self._set_queue(qp, rest)
            if out.replayed:
                # Applied by an earlier send whose reply was lost: read what it removed.
                old = self._client.range(guess, revision=out.revision - 1, timeout=budget(deadline))
                return self._take_item(old.kvs[0], deadline)
            check_deadline(deadline, f"queue_pop of {qp!r}", timeout)

    def _await_push(
        self, qp: bytes, end: bytes, revision: int, deadline: float, timeout: float, key: str | bytes
    ) -> tuple[int, bytes]:
        """Wait for an item in the queue ``qp``, found empty at ``revision``; (create revision, key).

        The first item pushed after the empty read is the oldest (unless popped
        meanwhile: the pop Txn checks).
        """
        first: list[KeyValue] = []

        def pushed(ev: Event) -> bool:
            if ev.type == "PUT":
                first.append(ev.kv)
            return bool(first)

        def reread() -> tuple[bool, int]:
            res = self._client.range(qp, end, keys_only=True, timeout=budget(deadline))
            first.extend(sorted(res.kvs, key=_created)[:1])
            return bool(first), res.revision

        if not self._waits.wait_for(qp, end, revision, deadline, reread, pushed):
            raise self._waits.timeout_error(timeout, [key])
        return first[0].create_revision, first[0].key

    def _set_queue(self, qp: bytes, rest: RangeResult) -> None:
        items = sorted((kv.create_revision, kv.key) for kv in rest.kvs)[:_QUEUE_GUESSES]
        with self._lock:
            self._queues[qp] = items

    def _take_item(self, kv: KeyValue, deadline: float) -> bytes:
        """The value of a popped item (its chunks read, then deleted)."""
        value = self._values.decode(kv, deadline, live=False)
        assert value is not None
        self._values.drop_replaced(kv)
        return value


def _created(kv: KeyValue) -> int:
    return kv.create_revision
