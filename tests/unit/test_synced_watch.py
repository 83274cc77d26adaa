"""The synced-watch rule (etcd_store/client/synced.py) on synthetic watches: confirmed or raise,
the gap read, and only events above the last read's revision (no etcd; the store's and
etcd-v3's integration tests exercise it on a real one)."""

from __future__ import annotations

import queue
import threading
from typing import Any

import pytest

from etcd_store.client import Event, KeyValue
from etcd_store.client.synced import SyncedWatch, WatchNotConfirmed, confirmed
from etcd_store.errors import EtcdConnectionError, EtcdError, EtcdPermissionDenied, EtcdTimeoutError


def _put(key: bytes, revision: int) -> Event:
    return Event("PUT", KeyValue(key, b"v", revision, revision, 1, 0))


class FakeWatch:
    """A watch whose confirmation, events and errors the test plays."""

    def __init__(self) -> None:
        self.created_revision = 0
        self._created = threading.Event()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.cancelled = False

    # what the test plays
    def confirm(self, revision: int) -> None:
        self.created_revision = revision
        self._created.set()

    def fail(self, err: BaseException) -> None:
        self._created.set()
        self._queue.put(err)

    def deliver(self, *events: Event) -> None:
        self._queue.put(list(events))

    # the watch's interface
    def wait_created(self, timeout: float) -> bool:
        return self._created.wait(timeout)

    def get(self, timeout: float | None = None) -> list[Event]:
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return []
        if isinstance(item, BaseException):
            self._queue.put(item)
            raise item
        return list(item)

    def cancel(self) -> None:
        self.cancelled = True


class FakeClient:
    def __init__(self, watch: FakeWatch) -> None:
        self.fake = watch
        self.opened: list[tuple[bytes, bytes | None]] = []

    def watch(self, key: bytes, range_end: bytes | None = None) -> FakeWatch:
        self.opened.append((key, range_end))
        return self.fake


def test_confirmed_returns_the_revision_etcd_registered_the_watch_at() -> None:
    w = FakeWatch()
    w.confirm(41)
    assert confirmed(w, 1.0, "w") == 41


def test_an_unconfirmed_watch_raises_a_timeout_error_after_the_timeout() -> None:
    w = FakeWatch()
    with pytest.raises(WatchNotConfirmed, match="did not confirm") as caught:
        confirmed(w, 0.05, "the watch on k")
    assert isinstance(caught.value, EtcdTimeoutError) and isinstance(caught.value, TimeoutError)


def test_a_watch_that_failed_before_its_confirmation_raises_its_own_error() -> None:
    w = FakeWatch()
    w.fail(EtcdConnectionError("injected: no member answered"))
    with pytest.raises(EtcdConnectionError, match="injected"):
        confirmed(w, 1.0, "w")


def test_open_confirms_and_cancels_the_watch_it_could_not_confirm() -> None:
    w = FakeWatch()
    client = FakeClient(w)
    with pytest.raises(WatchNotConfirmed):
        SyncedWatch.open(client, b"k", None, 5, 0.05)
    assert client.opened == [(b"k", None)] and w.cancelled


def test_open_cancels_a_watch_that_failed_and_raises_its_error() -> None:
    w = FakeWatch()
    w.fail(EtcdPermissionDenied("injected: permission denied"))
    with pytest.raises(EtcdPermissionDenied):
        SyncedWatch.open(FakeClient(w), b"a", b"b", 5, 1.0)
    assert w.cancelled


def test_open_without_time_left_opens_no_watch() -> None:
    client = FakeClient(FakeWatch())
    with pytest.raises(WatchNotConfirmed):
        SyncedWatch.open(client, b"k", None, 5, 0.0)
    assert client.opened == []


def test_a_watch_registered_at_or_below_the_read_needs_no_second_read() -> None:
    w = FakeWatch()
    w.confirm(10)
    sw = SyncedWatch.open(FakeClient(w), b"k", None, 10, 1.0)
    assert not sw.behind
    w.deliver(_put(b"k", 11))
    assert [ev.kv.mod_revision for ev in sw.get(1.0)] == [11]


def test_a_watch_registered_above_the_read_asks_for_a_read_whose_events_are_then_skipped() -> None:
    w = FakeWatch()
    w.confirm(12)  # etcd moved from 10 to 12 between the read and the watch
    sw = SyncedWatch.open(FakeClient(w), b"k", None, 10, 1.0)
    assert sw.behind
    sw.read_at(14)  # the second read, sent after the confirmation
    w.deliver(_put(b"k", 13), _put(b"k", 14), _put(b"k", 15))  # 13, 14: already in the read
    assert [ev.kv.mod_revision for ev in sw.get(1.0)] == [15]


def test_a_batch_wholly_covered_by_the_read_yields_no_event() -> None:
    w = FakeWatch()
    w.confirm(3)
    sw = SyncedWatch(w, 7)
    w.deliver(_put(b"k", 6), _put(b"k", 7))
    assert sw.get(1.0) == []
    assert sw.get(0.01) == []  # and then nothing: the timeout


def test_a_read_revision_of_zero_reports_every_event() -> None:
    w = FakeWatch()
    w.confirm(1)
    with SyncedWatch.open(FakeClient(w), b"go", None, 0, 1.0) as sw:
        w.deliver(_put(b"go", 2))
        assert [ev.key for ev in sw.get(1.0)] == [b"go"]
    assert w.cancelled


def test_a_later_failure_is_raised_by_get() -> None:
    w = FakeWatch()
    w.confirm(5)
    sw = SyncedWatch(w, 5)
    w.fail(EtcdError("injected: compacted"))
    with pytest.raises(EtcdError, match="compacted"):
        sw.get(1.0)
