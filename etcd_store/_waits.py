"""The waits of :class:`~etcd_store.EtcdStore`: ``wait``, the waiting part of ``get`` and
``multi_get``, a blocking ``queue_pop`` and ``barrier``.

Every wait follows the client's synced-watch rule (:mod:`etcd_store.client.synced`): read
first (a present key costs one read); on a miss :meth:`Waits.wait_for` watches from now. No
lost wake-up, polling or sleeps. A compacted watch reads afresh and watches anew.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

from ._namespace import MAX_TXN_OPS, Layout, batches, budget
from .client import EtcdClient, Event, KeyValue, RangeResult, op_get, prefix_range_end
from .client.synced import SyncedWatch, WatchNotConfirmed
from .errors import EtcdCompactedError


class Waits:
    """Reads that find out whether keys exist, and waits on watches until they do. Waits take a
    monotonic deadline and return False (or raise a timed-out wait's ``DistStoreError``) at it."""

    def __init__(self, client: EtcdClient, layout: Layout) -> None:
        self._client = client
        self._layout = layout

    def timeout_error(self, seconds: float, keys: Sequence[str | bytes]) -> dist.DistStoreError:
        """TCPStore's error for a wait that timed out: ``wait timeout after <ms>ms, keys: ...``."""
        shown = ", ".join(self._layout.display(k) for k in keys)
        return dist.DistStoreError(f"wait timeout after {int(round(seconds * 1000))}ms, keys: {shown}")

    def probe(self, ks: Sequence[bytes], timeout: float) -> tuple[builtins.set[bytes], int]:
        """Which keys exist (or have queue items), and the revision of the read. One Txn per 64 keys."""
        present: builtins.set[bytes] = builtins.set()
        revision = 0
        unique = list(dict.fromkeys(ks))
        for batch in batches(unique, MAX_TXN_OPS // 2):
            # The key and its queue items, not a nested namespace's internal keys (``ns/<key>\\0lease``).
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

    def wait_for(
        self, start: bytes, end: bytes | None, revision: int, deadline: float,
        reread: Callable[[], tuple[bool, int]], on_event: Callable[[Event], bool],
    ) -> bool:
        """Wait on ``[start, end)`` until ``on_event`` says done (True) or the deadline (False).

        ``revision``: the caller's read that found the wait not done. When the confirmed watch
        (:class:`~etcd_store.client.synced.SyncedWatch`) is behind it, ``reread()`` returns
        (done, its read's revision). Raises the watch's error (compaction aside).
        """
        what = f"the watch on {start!r} at {self._client.describe()}"
        while True:
            try:
                watch = SyncedWatch.open(self._client, start, end, revision, deadline - time.monotonic(), what)
            except WatchNotConfirmed:
                return False
            with watch:
                try:
                    if watch.behind:
                        done, revision = reread()
                        if done:
                            return True
                        watch.read_at(revision)
                    while True:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            return False
                        for ev in watch.get(timeout=remaining):
                            if on_event(ev):
                                return True
                except EtcdCompactedError:
                    revision = 0  # the watch fell behind a compaction: read afresh, watch anew

    def await_heads(
        self, heads: Sequence[bytes], revision: int, deadline: float, seconds: float,
        shown: Sequence[str | bytes],
    ) -> dict[bytes, KeyValue]:
        """The first written KeyValue of each key in ``heads``, missing at ``revision``; raises
        :meth:`timeout_error` (``shown``, ``seconds``) at the deadline."""
        wanted = set(heads)
        found: dict[bytes, KeyValue] = {}

        def seen(ev: Event) -> bool:
            if ev.type == "PUT" and ev.key in wanted and ev.key not in found:
                found[ev.key] = ev.kv
            return len(found) == len(wanted)

        def reread() -> tuple[bool, int]:
            at = 0
            for batch in batches([k for k in heads if k not in found], MAX_TXN_OPS):
                res = self._client.txn([], [op_get(k) for k in batch], timeout=budget(deadline), idempotent=True)
                at = at or res.revision  # the lowest revision read: later events are handled
                for r in res.responses:
                    if isinstance(r, RangeResult) and r.kvs:
                        found[r.kvs[0].key] = r.kvs[0]
            return len(found) == len(wanted), at

        if self.wait_for(min(wanted), Layout.span_end(max(wanted)), revision, deadline, reread, seen):
            return found
        raise self.timeout_error(seconds, shown)

    def wait_keys(self, ks: Sequence[bytes], seconds: float, shown: Sequence[str | bytes]) -> None:
        """:meth:`EtcdStore.wait <etcd_store.EtcdStore.wait>` on ``ks``, at most ``seconds``
        (:meth:`timeout_error` naming ``shown`` then)."""
        deadline = time.monotonic() + seconds
        present, revision = self.probe(ks, budget(deadline))
        missing = {k for k in ks if k not in present}
        if not missing:
            return

        def reread() -> tuple[bool, int]:
            present, at = self.probe(list(missing), budget(deadline))
            missing.difference_update(present)
            return not missing, at

        def seen(ev: Event) -> bool:
            head = self._layout.head_of(ev.key)
            if ev.type == "PUT" and head is not None:
                missing.discard(head)
            return not missing

        if self.wait_for(min(missing), Layout.span_end(max(missing)), revision, deadline, reread, seen):
            return
        raise self.timeout_error(seconds, shown)

    def await_count(self, k: bytes, world_size: int, revision: int, deadline: float) -> bool:
        """Wait until the barrier counter ``k``, added to at ``revision``, reaches ``world_size``;
        False at the deadline. One watch, plus one Range if the watch is behind."""

        def arrived(ev: Event) -> bool:
            if ev.type != "PUT" or ev.key != k:
                return False
            try:
                return int(ev.value) >= world_size
            except ValueError:
                return False

        def reread() -> tuple[bool, int]:
            res = self._client.range(k, timeout=budget(deadline))
            return bool(res.kvs) and arrived(Event("PUT", res.kvs[0])), res.revision

        return self.wait_for(k, None, revision, deadline, reread, arrived)
