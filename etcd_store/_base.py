"""What every part of :class:`~etcd_store.EtcdStore` shares: helpers, the store state
(declared on :class:`StoreBase`), deadlines, and waiting for keys with watches.

Waiting (:meth:`StoreBase._wait_for`): the caller reads first (so a key that is
already there costs one read); on a miss it opens a watch *from now* and waits
until etcd confirms it. etcd registers such a watch as "synced" and delivers
events to it as they are committed (about a millisecond); a watch from a past
revision would be "unsynced" and served only on etcd's 100 ms catch-up tick.

No lost wake-up: etcd's confirmation carries the revision ``W`` it had when it
registered the watch, and the watch delivers every event above ``W``. If the
caller's read was at revision ``R >= W`` it saw everything up to ``W``;
otherwise (someone wrote in between) it reads again, and that read, sent after
the confirmation, is linearizable, so it is at a revision ``R >= W``. Either
way every revision is covered, by the read (``<= R``) or by the watch
(``> W``); events at or below ``R`` are skipped, since the read reflected them.
A compacted watch reads afresh and opens a new watch. No polling, no sleeps.

Deadlines: every RPC gets at least ``MIN_RPC_TIMEOUT`` seconds.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from ._layout import Layout
from ._namespace_lease import StoreLease
from .client import EtcdClient, Event, KeyValue, RangeResult, Watch, op_get, prefix_range_end
from .errors import EtcdCompactedError, EtcdConnectionError, EtcdError

log = logging.getLogger(__name__)

#: etcd's default ``--max-txn-ops``.
MAX_TXN_OPS = 128
#: The shortest deadline given to one RPC, even when a wait has less time left.
MIN_RPC_TIMEOUT = 1.0
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


def _head_of(layout: Layout, etcd_key: bytes) -> bytes | None:
    """The user key an event's key belongs to (a queue item belongs to its queue's key).

    None for the internal key of a namespace nested in this one (``ns/sub\\0lease``).
    """
    nul = etcd_key.find(b"\0", len(layout.user_start))
    if nul < 0:
        return etcd_key
    head = etcd_key[:nul]
    return head if etcd_key.startswith(Layout.queue_prefix(head)) else None


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


class StoreBase:
    """The state of a store (set up by ``EtcdStore._setup``) and its deadline and wait helpers."""

    _client: EtcdClient
    _shared: _Shared
    _layout: Layout
    _chunk_bytes: int
    _id: str
    _lock: threading.Lock
    _known: dict[bytes, tuple[int, bytes]]
    _queues: dict[bytes, list[tuple[int, bytes]]]
    _tls: threading.local
    _thread_numbers: Iterator[int]

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

    def _probe(self, ks: Sequence[bytes], timeout: float) -> tuple[builtins.set[bytes], int]:
        """Which keys exist (or have queue items), and the revision of the read."""
        present: builtins.set[bytes] = builtins.set()
        revision = 0
        unique = list(dict.fromkeys(ks))
        for batch in _batches(unique, MAX_TXN_OPS // 2):
            # The key itself and its queue items; not the internal keys of a namespace
            # nested under the key's name (``ns/<key>\\0lease``, ...).
            ops = []
            for k in batch:
                qp = Layout.queue_prefix(k)
                ops += [op_get(k, count_only=True), op_get(qp, prefix_range_end(qp), count_only=True)]
            res = self._client.txn([], ops, timeout=timeout, idempotent=True)
            revision = revision or res.revision
            for i, k in enumerate(batch):
                if any(isinstance(r, RangeResult) and r.count for r in res.responses[2 * i : 2 * i + 2]):
                    present.add(k)
        return present, revision

    def _open_watch(self, start: bytes, end: bytes | None, deadline: float) -> Watch | None:
        """A watch on ``[start, end)`` from now, confirmed by etcd; None if the deadline came first.

        Its ``created_revision`` is the revision etcd had when it registered the
        watch: the watch delivers every event above it.
        """
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        watch = self._client.watch(start, end)
        try:
            if not watch.wait_created(remaining):
                watch.cancel()
                return None
            if not watch.created_revision:
                # The watch failed before etcd confirmed it: get() raises its error.
                watch.get(timeout=MIN_RPC_TIMEOUT)
                raise EtcdError(f"watch on {start!r} at {self._client.describe()} failed to start")
        except BaseException:
            watch.cancel()
            raise
        return watch

    def _wait_for(
        self, start: bytes, end: bytes | None, revision: int, deadline: float,
        reread: Callable[[], tuple[bool, int]], on_event: Callable[[Event], bool],
    ) -> bool:
        """Wait on ``[start, end)`` until ``on_event`` says done (True) or the deadline (False).

        ``revision`` is that of the caller's read that found the wait not done.
        The watch starts from now (synced: see the module docstring); when etcd
        moved past ``revision`` before registering it, ``reread()`` reads again
        and returns (done, the revision of its read). Events at or below the
        last read's revision are skipped.
        """
        while True:
            watch = self._open_watch(start, end, deadline)
            if watch is None:
                return False
            try:
                if watch.created_revision > revision:
                    done, revision = reread()
                    if done:
                        return True
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    for ev in watch.get(timeout=remaining):
                        if ev.kv.mod_revision > revision and on_event(ev):
                            return True
            except EtcdCompactedError:
                revision = 0  # the watch fell behind a compaction: read afresh, watch anew
            finally:
                watch.cancel()

    def _await_heads(
        self, heads: Sequence[bytes], revision: int, deadline: float, seconds: float,
        shown: Sequence[str | bytes],
    ) -> dict[bytes, KeyValue]:
        """Wait until each key in ``heads`` is written; their first written KeyValues.

        ``revision``: that of the read that found the keys missing.
        """
        wanted = set(heads)
        found: dict[bytes, KeyValue] = {}

        def seen(ev: Event) -> bool:
            if ev.type == "PUT" and ev.key in wanted and ev.key not in found:
                found[ev.key] = ev.kv
            return len(found) == len(wanted)

        def reread() -> tuple[bool, int]:
            at = 0
            for batch in _batches([k for k in heads if k not in found], MAX_TXN_OPS):
                res = self._client.txn([], [op_get(k) for k in batch],
                                       timeout=self._budget(deadline), idempotent=True)
                at = at or res.revision  # the lowest revision read: later events are handled
                for r in res.responses:
                    if isinstance(r, RangeResult) and r.kvs:
                        found[r.kvs[0].key] = r.kvs[0]
            return len(found) == len(wanted), at

        if self._wait_for(min(wanted), Layout.span_end(max(wanted)), revision, deadline, reread, seen):
            return found
        raise self._timeout_error(seconds, shown)
