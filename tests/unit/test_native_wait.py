"""The synced-wait rule as ``etcd-v3``'s wait applies it (:class:`etcd_rdzv.native.wait.RoundWait`), without etcd.

A wait reads its watch through the client's :class:`~etcd_store.client.synced.SyncedWatch`, with the
view's revision as the caller's read: a watch that etcd registered after that revision is behind, one
catch-up read covers the gap, and the watch's events at or below that read never reach the view.
"""

from __future__ import annotations

from typing import Any

from etcd_rdzv.native.barrier import WaitUntil
from etcd_rdzv.native.records import Membership, RunKeys, Sealed, encode_sealed
from etcd_rdzv.native.settings import V3Settings
from etcd_rdzv.native.wait import RoundView, RoundWait
from etcd_store.client import Event, KeyValue, RangeResult
from etcd_store.client.kv import TxnResult

KEYS = RunKeys.for_run("/p", "r")
JOIN = 10  # the revision of our join in round 2
SEALED = KeyValue(KEYS.sealed, encode_sealed(1, 0x1, ("h", 1), Membership(2, joins=2)), 1, 5, 1, 0x1)


class Watch:
    """A confirmed watch that hands out the batches the test gives it."""

    def __init__(self, created_revision: int, *batches: list[Event]) -> None:
        self.created_revision = created_revision
        self.batches = list(batches)

    def wait_created(self, timeout: float) -> bool:
        return True

    def get(self, timeout: float | None = None) -> list[Event]:
        return self.batches.pop(0) if self.batches else []

    def cancel(self) -> None:
        pass


class Client:
    """Answers the catch-up read (``ctl/``: round 1's seal at 5; ``prev_count`` join keys in round 1)
    at ``revision``."""

    timeout = 5.0

    def __init__(self, revision: int, prev_count: int) -> None:
        self.revision, self.prev_count, self.reads = revision, prev_count, 0

    def describe(self) -> str:
        return "fake"

    def txn(self, *args: Any, **kwargs: Any) -> TxnResult:
        self.reads += 1
        return TxnResult(True, self.revision, [RangeResult([SEALED], 1, False, self.revision),
                                               RangeResult([], self.prev_count, False, self.revision)])


def departure(revision: int) -> Event:
    return Event("DELETE", KeyValue(KEYS.join_key(1, "gone"), b"", 0, revision, 0, 0))


def wait(client: Client, watch: Watch, prev_count: int) -> RoundWait:
    view = RoundView(KEYS, 2, seq=1, create_revision=JOIN, count=1, prev_count=prev_count, revision=JOIN)
    return RoundWait(V3Settings("r", 1, 4), client, KEYS, "me", None, 2, Sealed(round=1, revision=5),  # type: ignore[arg-type]
                     view, None, watch, True, None, evictor=None, give_up=lambda: True)  # type: ignore[arg-type]


def test_a_watch_registered_after_the_join_is_caught_up_and_skips_what_the_read_holds() -> None:
    """Two nodes in round 1 at our join (10); one leaves at 12, before the watch is registered (20);
    the catch-up read at 25 finds one left. The watch then delivers a departure at 22 (the read
    holds it: skipped, not subtracted again) and the last one at 30: round 1 is empty."""
    client = Client(revision=25, prev_count=1)
    w = wait(client, Watch(20, [departure(22)], [departure(30)]), prev_count=2)
    assert w.catch_up() is None and client.reads == 1
    assert w.view.prev_count == 1
    assert w.act(WaitUntil(None)) is None
    assert w.view.prev_count == 1 and not w.view.vacated
    w.act(WaitUntil(None))
    assert w.view.vacated


def test_a_watch_registered_before_the_join_needs_no_read_and_skips_up_to_the_join() -> None:
    """The ``ctl/`` watch confirmed before the join (at 4): no read. It delivers round 1's seal at 5
    and a departure at 9, both at or below the join (its compares saw them: no signal, no count),
    then a departure at 11, which empties round 1."""
    client = Client(revision=0, prev_count=0)
    w = wait(client, Watch(4, [Event("PUT", SEALED), departure(9), departure(11)]), prev_count=1)
    assert w.catch_up() is None and client.reads == 0
    assert w.act(WaitUntil(None)) is None  # round 1's seal would be a signal (join again)
    assert w.view.prev_count == 0
