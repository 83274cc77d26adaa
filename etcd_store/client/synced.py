"""Synced watches: watch from now, report only what a read has not already seen.

The one rule for waiting on etcd without polling and without a lost wake-up, used by the
store's waits, etcd-v3's rounds and the benchmarks:

1. The caller reads first; the read, at revision ``R``, finds the wait not done.
2. It opens a watch *from now* and waits until etcd confirms it (:func:`confirmed`). etcd
   registers a watch from now as "synced" and delivers its events as they are committed
   (about a millisecond); a watch from a past revision would be "unsynced", served only by
   etcd's 100 ms catch-up tick. The confirmation carries the revision ``W`` etcd had when it
   registered the watch; the watch delivers every event above ``W``.
3. If ``W > R`` (someone wrote in between: :attr:`SyncedWatch.behind`), the caller reads
   again. That read is sent after the confirmation, so it is linearizable at a revision
   ``R' >= W``; the caller records it (:meth:`SyncedWatch.read_at`).
4. Only events above the last read's revision are reported (:meth:`SyncedWatch.get`).

Every revision is then covered once: by the read (``<= R``) or by the watch (``> W``, and
events the read already reflected skipped).

Confirmed or raise, for every caller (:func:`confirmed`); a later failure (etcd refusing the
watch in its confirming answer, a compaction) is raised by :meth:`SyncedWatch.get`.
"""

from __future__ import annotations

import logging
from typing import Protocol

from ..errors import EtcdError, EtcdTimeoutError
from .kv import Event, show_key

log = logging.getLogger(__name__)

__all__ = ["SyncedWatch", "WatchNotConfirmed", "confirmed"]

#: How long to wait for the error of a watch that failed before confirmation (queued right
#: after the wait ends).
_ERROR_WAIT = 1.0


class WatchNotConfirmed(EtcdTimeoutError):
    """etcd did not confirm a watch within the time given (the watch was not waited on)."""


class WatchLike(Protocol):
    """What the synced rule needs of a watch (:class:`~etcd_store.client.Watch` has it)."""

    @property
    def created_revision(self) -> int: ...

    def wait_created(self, timeout: float) -> bool: ...

    def get(self, timeout: float | None = None) -> list[Event]: ...

    def cancel(self) -> None: ...


class Watcher(Protocol):
    """What opens a watch from now (:class:`~etcd_store.client.EtcdClient` does)."""

    def watch(self, key: bytes, range_end: bytes | None = None) -> WatchLike: ...


def confirmed(watch: WatchLike, timeout: float, what: str) -> int:
    """Block until etcd confirmed ``watch``; the revision etcd had when it registered it.

    Raises :class:`WatchNotConfirmed` (an :class:`~etcd_store.errors.EtcdTimeoutError`) when
    ``timeout`` seconds pass first (at once if not positive), or the watch's error if it failed
    before confirmation (an :class:`~etcd_store.errors.EtcdError` naming ``what`` if it queued
    none). Does not cancel ``watch``.
    """
    if timeout <= 0 or not watch.wait_created(timeout):
        raise WatchNotConfirmed(f"{what}: etcd did not confirm it within {max(timeout, 0):g} s")
    revision = watch.created_revision
    if not revision:
        watch.get(timeout=_ERROR_WAIT)  # raises the error it failed with
        raise EtcdError(f"{what} failed before etcd confirmed it")
    return revision


class SyncedWatch:
    """A confirmed watch from now that reports only events above the last read's revision.

    Made by :meth:`open` (or around a confirmed watch); the caller cancels it (:meth:`cancel`,
    or ``with``). ``created_revision``: ``W``; ``read_revision``: the caller's last read's.
    """

    def __init__(self, watch: WatchLike, read_revision: int) -> None:
        self.watch = watch
        self.created_revision = watch.created_revision
        self.read_revision = read_revision

    @classmethod
    def open(
        cls, client: Watcher, start: bytes, end: bytes | None, read_revision: int, timeout: float,
        what: str | None = None,
    ) -> SyncedWatch:
        """A watch on ``[start, end)`` (``end`` None: the key ``start``) from now, confirmed.

        ``read_revision``: the caller's read (0: report every event). Blocks at most
        ``timeout`` seconds (none opened if not positive); raises as :func:`confirmed`, the
        watch cancelled.
        """
        name = what or f"the watch on {show_key(start)}"
        if timeout <= 0:
            raise WatchNotConfirmed(f"{name}: no time left to open it")
        watch = client.watch(start, end)
        try:
            confirmed(watch, timeout, name)
        except BaseException:
            watch.cancel()
            raise
        return cls(watch, read_revision)

    @property
    def behind(self) -> bool:
        """Whether etcd moved past the caller's read before registering the watch (step 3:
        read again, then :meth:`read_at`)."""
        return self.created_revision > self.read_revision

    def read_at(self, revision: int) -> None:
        """The caller read again at ``revision`` (after the confirmation): skip events up to it."""
        self.read_revision = revision

    def get(self, timeout: float | None = None) -> list[Event]:
        """The next events above the last read's revision; ``[]`` on timeout (or all skipped).
        Raises the watch's error (compaction, permission denied, cancelled)."""
        return [ev for ev in self.watch.get(timeout=timeout) if ev.kv.mod_revision > self.read_revision]

    def cancel(self) -> None:
        """Stop the watch (idempotent)."""
        self.watch.cancel()

    def __enter__(self) -> SyncedWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()
