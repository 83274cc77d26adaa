"""The ``etcd-v3`` barrier decision (:mod:`etcd_rdzv.native.barrier`) without etcd.

``decide`` is a pure function of the barrier state, the tally of the round, the
settings and the time, so every case here is a sequence of looks at made-up
tallies at chosen times. The same rules run against real etcd in
tests/integration/test_v3_protocol.py.
"""

from __future__ import annotations

import pytest

from etcd_rdzv.native.barrier import (
    SEAL_BACKUP_DELAY,
    Admitted,
    Barrier,
    JoinClock,
    Overflow,
    Seal,
    Tally,
    TimeOut,
    Void,
    WaitUntil,
    decide,
    verdict,
)
from etcd_rdzv.native.settings import V3Settings

T0 = 1000.0  # any monotonic time


def rules(min_nodes: int = 2, max_nodes: int = 4, last_call: float = 30.0, join: float = 600.0) -> V3Settings:
    return V3Settings(
        run_id="r", min_nodes=min_nodes, max_nodes=max_nodes,
        last_call_timeout=last_call, join_timeout=join,
    )  # fmt: skip


def start(s: V3Settings, tally: Tally, *, recover_size: int | None = None, now: float = T0) -> Barrier:
    return Barrier.start(JoinClock.start(s.join_timeout, now), tally, s, recover_size)


def test_below_min_nodes_waits_for_the_join_deadline_only() -> None:
    s = rules(min_nodes=3)
    tally = Tally(count=2, before=0, prev_count=0)
    state, action = decide(start(s, tally), tally, s, T0)
    assert action == WaitUntil(T0 + s.join_timeout)
    assert state.last_call_at is None and state.ready_since is None


def test_min_nodes_starts_the_last_call_and_it_seals_when_it_ends() -> None:
    s = rules(min_nodes=2, max_nodes=4, last_call=30.0)
    tally = Tally(count=2, before=0, prev_count=0)
    state, action = decide(start(s, tally), tally, s, T0)
    assert action == WaitUntil(T0 + 30.0)  # the last call, before the join deadline
    state, action = decide(state, tally, s, T0 + 29.9)
    assert action == WaitUntil(T0 + 30.0)  # unchanged: not restarted by a later look
    state, action = decide(state, tally, s, T0 + 30.0)
    assert action == Seal()
    assert state.tried_at_change == tally.changes


def test_the_last_call_restarts_when_the_barrier_breaks() -> None:
    s = rules(min_nodes=2, last_call=30.0)
    two, one = Tally(2, 0, 0, changes=0), Tally(1, 0, 0, changes=1)
    state, _ = decide(start(s, two), two, s, T0)
    state, action = decide(state, one, s, T0 + 10)  # a joiner left
    assert state.last_call_at is None and action == WaitUntil(T0 + s.join_timeout)
    state, action = decide(state, Tally(2, 0, 0, changes=2), s, T0 + 20)
    assert action == WaitUntil(T0 + 50.0)


def test_max_nodes_seals_at_once_and_later_joiners_stand_one_place_back() -> None:
    s = rules(min_nodes=2, max_nodes=3)
    first = Tally(count=3, before=0, prev_count=0, changes=2)
    # The first joiner learnt of the others from its watch: it stands behind the filler.
    state, action = decide(start(s, Tally(1, 0, 0)), first, s, T0)
    assert action == WaitUntil(T0 + 1 * SEAL_BACKUP_DELAY)
    _, action = decide(state, first, s, T0 + SEAL_BACKUP_DELAY)
    assert action == Seal()
    # The joiner whose join filled the round seals from its join answer, at once.
    filler = Tally(count=3, before=2, prev_count=0)
    state = start(s, filler)
    assert state.filled_it
    _, action = decide(state, filler, s, T0)
    assert action == Seal()
    # The second joiner (not the filler) stands two places back.
    second = Tally(count=3, before=1, prev_count=0, changes=1)
    _, action = decide(start(s, Tally(2, 1, 0)), second, s, T0)
    assert action == WaitUntil(T0 + 2 * SEAL_BACKUP_DELAY)


def test_a_seal_attempt_is_not_repeated_on_an_unchanged_view() -> None:
    """Sealed by another node (or lost to a change): our transaction failed; the
    next attempt waits for the view to change, then keeps its place."""
    s = rules(min_nodes=1, max_nodes=1)
    tally = Tally(count=1, before=0, prev_count=0, changes=0)
    state, action = decide(start(s, tally), tally, s, T0)
    assert action == Seal()
    state = state.sealed(False)
    state, action = decide(state, tally, s, T0 + 0.1)
    assert action == WaitUntil(T0 + s.join_timeout)  # only the join deadline remains
    changed = Tally(count=1, before=0, prev_count=0, changes=1)
    _, action = decide(state, changed, s, T0 + 0.2)
    assert action == Seal()


def test_after_our_seal_succeeded_we_only_wait_for_its_event() -> None:
    s = rules(min_nodes=1, max_nodes=1)
    tally = Tally(count=1, before=0, prev_count=0)
    state, _ = decide(start(s, tally), tally, s, T0)
    state = state.sealed(True)
    _, action = decide(state, Tally(1, 0, 0, changes=5), s, T0 + 1)
    assert action == WaitUntil(T0 + s.join_timeout)


def test_a_running_previous_round_blocks_the_seal() -> None:
    s = rules(min_nodes=1, max_nodes=2)
    tally = Tally(count=2, before=0, prev_count=1)
    state, action = decide(start(s, tally), tally, s, T0)
    assert not state.filled_it
    assert action == WaitUntil(T0 + s.join_timeout) and state.ready_since is None
    vacated = Tally(count=2, before=0, prev_count=0, changes=1)
    state, action = decide(state, vacated, s, T0 + 5)
    # Full, but our join did not fill it: the filler seals first, we stand in after.
    assert action == WaitUntil(T0 + 5 + SEAL_BACKUP_DELAY)
    _, action = decide(state, vacated, s, T0 + 5 + SEAL_BACKUP_DELAY)
    assert action == Seal()


@pytest.mark.parametrize(("count", "due"), [(2, True), (3, True), (4, False)])
def test_fast_recovery_skips_the_last_call_unless_the_round_grows(count: int, due: bool) -> None:
    s = rules(min_nodes=2, max_nodes=8, last_call=30.0)
    tally = Tally(count=count, before=0, prev_count=0)
    state, action = decide(start(s, tally, recover_size=3), tally, s, T0)
    assert (action == Seal()) is due
    if not due:
        assert action == WaitUntil(T0 + 30.0)
    # Without fast_recovery (no group left) every size waits for the last call.
    _, action = decide(start(s, tally), tally, s, T0)
    assert action == WaitUntil(T0 + 30.0)


def test_join_timeout_times_out_and_a_late_seal_is_awaited_without_a_deadline() -> None:
    s = rules(min_nodes=3, join=10.0)
    tally = Tally(count=1, before=0, prev_count=0)
    state, action = decide(start(s, tally), tally, s, T0 + 9.9)
    assert action == WaitUntil(T0 + 10.0)
    state, action = decide(state, tally, s, T0 + 10.0)
    assert action == TimeOut()
    state = state.timed_out_late()  # the round was sealed before we could withdraw
    _, action = decide(state, tally, s, T0 + 10.1)
    assert action == WaitUntil(None)


def test_join_timeout_is_suspended_while_a_full_group_runs_and_restarts_after() -> None:
    s = rules(min_nodes=1, max_nodes=2, join=10.0)
    kept_out = Tally(count=1, before=0, prev_count=2)
    state, action = decide(start(s, kept_out), kept_out, s, T0)
    assert state.clock.suspended and action == WaitUntil(None)
    state, action = decide(state, kept_out, s, T0 + 100.0)  # long past join_timeout
    assert action == WaitUntil(None)
    one_left = Tally(count=1, before=0, prev_count=1, changes=1)
    state, action = decide(state, one_left, s, T0 + 200.0)
    assert not state.clock.suspended and action == WaitUntil(T0 + 210.0)


def test_verdict_of_the_sealed_round() -> None:
    s = rules(min_nodes=2, max_nodes=3)
    # Sealed (by us or by another node) with us at place 1 of 3.
    assert verdict(Tally(count=3, before=1, prev_count=0), s) == Admitted(1, 3)
    # More joiners than max_nodes: the first three are the group.
    assert verdict(Tally(count=5, before=2, prev_count=0), s) == Admitted(2, 3)
    assert verdict(Tally(count=5, before=3, prev_count=0), s) == Overflow()
    # A joiner died in the instant before the seal: too few left, the round is void.
    assert verdict(Tally(count=1, before=0, prev_count=0), s) == Void(1)


def test_join_clock() -> None:
    clock = JoinClock.start(5.0, T0)
    assert not clock.expired(T0 + 4.9) and clock.expired(T0 + 5.0)
    paused = clock.suspend(True, T0 + 1)
    assert paused.suspend(True, T0 + 2) is paused and not paused.expired(T0 + 99)
    assert paused.suspend(False, T0 + 99).at == T0 + 104.0
