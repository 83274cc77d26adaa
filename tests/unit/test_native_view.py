"""The round view of ``etcd-v3`` (:class:`etcd_rdzv.native.wait.RoundView`) without etcd.

A view folds a node's watch events and the reads it takes into what it knows of its
round. Every event at or below the revision of something the view already holds (the
join, a catch-up read, a seal candidate's read of the round) must count once.
"""

from __future__ import annotations

from etcd_rdzv.native.protocol import RoundRead
from etcd_rdzv.native.records import Joiner, Membership, RunKeys, Sealed, encode_sealed
from etcd_rdzv.native.wait import RoundView, SignalKind
from etcd_store.client import Event, KeyValue

KEYS = RunKeys.for_run("/p", "r")
SEALED_1 = Sealed(round=1, revision=5)  # round 1, sealed at revision 5; we wait in round 2


def view(prev_count: int = 0, revision: int = 10) -> RoundView:
    return RoundView(KEYS, 2, seq=1, create_revision=revision, count=1, prev_count=prev_count,
                     revision=revision)


def read_at(revision: int, prev_count: int) -> RoundRead:
    return RoundRead(revision, [Joiner("me", 10, b"{}")], joins=1, seq_mod=10, prev_count=prev_count,
                     sealed=SEALED_1, closed=False)


def join_event(kind: str, round_: int, node: str, revision: int, version: int = 1) -> Event:
    kv = KeyValue(KEYS.join_key(round_, node), b"{}" if kind == "PUT" else b"", revision, revision,
                  version if kind == "PUT" else 0, 0)
    return Event(kind, kv)


def test_a_read_counts_what_the_watch_delivers_later_only_once() -> None:
    """A member of round 1 re-attaches at revision 12 (a PUT of version 1); a candidate's read
    at 15 counts it, then the watch delivers that PUT: still one node in round 1, and its
    departure at 20 empties round 1 (it used to count twice: round 1 never emptied)."""
    v = view()
    v.update(read_at(15, prev_count=1))
    assert v.prev_count == 1
    assert v.apply(join_event("PUT", 1, "back", 12)) is None
    assert v.prev_count == 1
    assert v.read is not None  # the read holds that event: it is still fresh for a seal
    v.apply(join_event("DELETE", 1, "back", 20))
    assert v.vacated and v.read is None


def test_a_departure_the_read_saw_is_not_subtracted_again() -> None:
    """Two nodes left in round 1 at the join; one leaves at 12, a read at 15 says 1, the watch
    then delivers that departure: round 1 still holds one node (not vacated)."""
    v = view(prev_count=2)
    v.update(read_at(15, prev_count=1))
    v.apply(join_event("DELETE", 1, "gone", 12))
    assert v.prev_count == 1 and not v.vacated


def test_control_events_after_a_read_still_end_the_wait() -> None:
    v = view()
    v.update(read_at(15, prev_count=0))
    record = encode_sealed(2, 0x1, ("h", 1), Membership(1, joins=1))
    kv = KeyValue(KEYS.sealed, record, 1, 16, 2, 0x1)
    signal = v.apply(Event("PUT", kv))
    assert signal is not None and signal.kind is SignalKind.SEALED and signal.round == 2


def test_the_abort_mark_ends_the_wait_like_a_close() -> None:
    v = view()
    kv = KeyValue(KEYS.abort, b"1", 11, 11, 1, 0x1)
    signal = v.apply(Event("PUT", kv))
    assert signal is not None and signal.kind is SignalKind.CLOSED
