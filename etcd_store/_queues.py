"""Queues of :class:`~etcd_store.EtcdStore`: ``queue_push``, ``queue_pop``, ``queue_len``.

An item is a key under the queue's prefix; the oldest (lowest create revision)
is popped by a fenced Txn that also checks no older item exists. A store
remembers candidates for the oldest item, so a pop is usually one Txn.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from ._base import _as_bytes, _dist_errors
from ._cas import ReadModifyWrite
from ._layout import Layout
from ._values import check_deadline
from .client import (
    DeleteResult,
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

#: Items of a queue this store remembers as candidates for the oldest.
_QUEUE_GUESSES = 64


class Queues(ReadModifyWrite):
    """The queue operations of the store."""

    def queue_push(self, key: str | bytes, value: str | bytes) -> None:  # type: ignore[override]
        """Append ``value`` to the queue ``key``. One Txn, applied exactly once even when resent."""
        k = self._layout.key(key)
        v = _as_bytes(value, "value")
        item = self._layout.new_queue_item(k)
        with _dist_errors(f"queue_push({key!r})"):
            # Fenced: a resend after a lost reply cannot push the item a second time.
            out = self._fenced_txn(
                v, [], lambda stored, lease: [op_put(item, stored, lease=lease)],
                [], time.monotonic() + self._rpc_timeout(), f"queue_push to {k!r}",
            )
        # Remember the item: a later queue_pop by this store can guess it is the oldest.
        qp = Layout.queue_prefix(k)
        with self._lock:
            known = self._queues.get(qp, [])
            if len(known) < _QUEUE_GUESSES:  # only the oldest matters; a producer stays small
                self._queues[qp] = sorted([*known, (out.revision, item)])

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
        whose failure branch returns the queue's items. Waiting on an empty queue
        opens one watch from now (one more Range when etcd's revision moved since
        the empty read: see :mod:`etcd_store._base`).
        """
        qp = Layout.queue_prefix(self._layout.key(key))
        end = prefix_range_end(qp)
        with _dist_errors(f"queue_pop({key!r})"):
            timeout = self._timeout().total_seconds()
            deadline = time.monotonic() + timeout
            while True:
                with self._lock:
                    items = self._queues.get(qp)
                if not items:
                    res = self._client.range(qp, end, keys_only=True, timeout=self._budget(deadline))
                    items = sorted((kv.create_revision, kv.key) for kv in res.kvs)
                    if not items:
                        if not block:
                            raise dist.QueueEmptyError("queue is empty")
                        items = [self._await_push(qp, end, res.revision, deadline, timeout, key)]
                created, guess = items[0]
                out = self._fenced_txn(
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
                    old = self._client.range(guess, revision=out.revision - 1, timeout=self._budget(deadline))
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
            res = self._client.range(qp, end, keys_only=True, timeout=self._budget(deadline))
            first.extend(sorted(res.kvs, key=_created)[:1])
            return bool(first), res.revision

        if not self._wait_for(qp, end, revision, deadline, reread, pushed):
            raise self._timeout_error(timeout, [key])
        return first[0].create_revision, first[0].key

    def _set_queue(self, qp: bytes, rest: RangeResult) -> None:
        items = sorted((kv.create_revision, kv.key) for kv in rest.kvs)[:_QUEUE_GUESSES]
        with self._lock:
            self._queues[qp] = items

    def _take_item(self, kv: KeyValue, deadline: float) -> bytes:
        """The value of a popped item (its chunks read, then deleted)."""
        value = self._decode(kv, deadline, live=False)
        assert value is not None
        self._drop_replaced(kv)
        return value


def _created(kv: KeyValue) -> int:
    return kv.create_revision
