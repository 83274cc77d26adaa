"""The waits of :class:`~etcd_store.EtcdStore`: ``wait``, the waiting part of ``get`` and
``multi_get``, a blocking ``queue_pop`` and ``barrier``.

Every wait follows the client's synced-watch rule (:mod:`etcd_store.client.synced`): the
caller reads first (so a key that is already there costs one read); on a miss
:meth:`Waits.wait_for` opens a watch *from now*, waits until etcd confirms it, reads again
if etcd moved past the caller's read before registering the watch, and then handles only
events above the last read's revision. No lost wake-up, no polling, no sleeps. A compacted
watch reads afresh and opens a new watch.
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
    """Reads that find out whether keys exist, and waits on watches until they do.

    ``client``, ``layout``: the store's. Waits take a deadline (``time.monotonic()``) and
    return False (or raise the ``DistStoreError`` of a timed-out wait) when it passes first.
    """

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

    def wait_for(
        self, start: bytes, end: bytes | None, revision: int, deadline: float,
        reread: Callable[[], tuple[bool, int]], on_event: Callable[[Event], bool],
    ) -> bool:
        """Wait on ``[start, end)`` until ``on_event`` says done (True) or the deadline (False).

        ``revision`` is that of the caller's read that found the wait not done.
        The watch starts from now, confirmed (:class:`~etcd_store.client.synced.SyncedWatch`);
        when etcd moved past ``revision`` before registering it, ``reread()`` reads again
        and returns (done, the revision of its read). Events at or below the last read's
        revision are skipped. Raises the watch's error when it failed (compaction aside).
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
        """Wait until each key in ``heads`` is written; their first written KeyValues.

        ``revision``: that of the read that found the keys missing. Raises
        :meth:`timeout_error` (naming ``shown``, after ``seconds``) at the deadline.
        """
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
        """Wait until the barrier counter ``k`` reaches ``world_size``; False at the deadline.

        ``revision``: that of this caller's arrival (its add). One watch from now, and one
        Range when etcd's revision moved past the add's before the watch was registered.
        """

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
