"""The watch tap of the client's test instruments (etcd_store/client/testing.py), on a synthetic client."""

from __future__ import annotations

from typing import Any

import pytest

from etcd_store.client import Event, KeyValue
from etcd_store.client.testing import WatchTap
from etcd_store.errors import EtcdError


def _put(key: bytes, revision: int) -> Event:
    return Event("PUT", KeyValue(key, b"v", revision, revision, 1, 0))


class FakeWatch:
    def __init__(self, *batches: list[Event]) -> None:
        self.batches = list(batches)
        self.created_revision = 7
        self.cancelled = False

    def get(self, timeout: float | None = None) -> list[Event]:
        if self.cancelled:
            raise EtcdError("watch was cancelled")
        if not self.batches:
            self.cancelled = True  # the end of the play: as if cancelled
            raise EtcdError("watch was cancelled")
        return self.batches.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class FakeClient:
    def __init__(self, *batches: list[Event]) -> None:
        self.batches = batches
        self.timeout = 3.0
        self.opened: list[tuple[Any, ...]] = []

    def watch(self, *args: Any, **kwargs: Any) -> FakeWatch:
        self.opened.append(args)
        return FakeWatch(*self.batches)


def test_a_tap_records_what_its_watches_hand_out_and_passes_the_rest_through() -> None:
    client = FakeClient([_put(b"a", 8), _put(b"b", 9)], [_put(b"a", 10)])
    tap = WatchTap(client)
    assert tap.timeout == 3.0  # everything else is the client's
    with tap.watch(b"a", b"c") as w:
        assert w.created_revision == 7
        assert [ev.kv.mod_revision for ev in w.get()] == [8, 9]
        assert [ev.kv.mod_revision for ev in w.get(timeout=1)] == [10]
    assert w.watch.cancelled and client.opened == [(b"a", b"c")]
    assert [ev.kv.mod_revision for ev in tap.events()] == [8, 9, 10]


def test_a_deaf_tap_keeps_the_errors_and_drops_the_events() -> None:
    tap = WatchTap(FakeClient([_put(b"a", 8)]), keep=lambda ev: False)
    w = tap.watch(b"a")
    assert w.get() == []
    assert [ev.kv.key for ev in tap.events()] == [b"a"]  # delivered, recorded, not handed on
    with pytest.raises(EtcdError):
        w.get()


def test_iterating_a_tapped_watch_goes_through_the_tap_and_ends_when_cancelled() -> None:
    tap = WatchTap(FakeClient([_put(b"a", 8)], [_put(b"b", 9)]))
    assert [ev.kv.key for ev in tap.watch(b"a")] == [b"a", b"b"]
    assert len(tap.events()) == 2
