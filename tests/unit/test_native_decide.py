"""The ``etcd-v3`` barrier decision (:mod:`etcd_rdzv.native.barrier`) without etcd.

``decide`` is a pure function of the barrier state, the tally of the round, the
settings and the time, so every case here is a sequence of looks at made-up
tallies at chosen times. The same rules run against real etcd in
tests/integration/test_v3_protocol.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from etcd_rdzv.native.barrier import (
    SEAL_BACKUP_DELAY,
    Admitted,
    Barrier,
    Check,
    JoinCounts,
    JoinDeadline,
    Overflow,
    Seal,
    TimeOut,
    Undersized,
    WaitUntil,
    decide,
    resolved,
    verdict,
)
from etcd_rdzv.native.records import (
    MAX_RECORD_BYTES,
    Joiner,
    Membership,
    ProtocolStateError,
    decode_members,
    decode_membership,
    decode_sealed,
    encode_sealed,
    lease_of,
)
from etcd_rdzv.native.settings import V3Settings
from etcd_rdzv.native.start import address_of
from etcd_store.client import KeyValue

T0 = 1000.0  # any monotonic time


def rules(min_nodes: int = 2, max_nodes: int = 4, last_call: float = 30.0, join: float = 600.0) -> V3Settings:
    return V3Settings(
        run_id="r", min_nodes=min_nodes, max_nodes=max_nodes,
        last_call_timeout=last_call, join_timeout=join,
    )  # fmt: skip


def start(s: V3Settings, tally: JoinCounts, *, recover_size: int | None = None, now: float = T0) -> Barrier:
    return Barrier.start(JoinDeadline.start(s.join_timeout, now), tally, s, recover_size)


def test_a_joiner_below_min_nodes_is_no_candidate_and_waits_for_the_join_deadline_only() -> None:
    s = rules(min_nodes=3)
    tally = JoinCounts(count=2, prev_count=0)
    state, action = decide(start(s, tally), tally, s, T0)
    assert not state.candidate
    assert action == WaitUntil(T0 + s.join_timeout)
    # It never seals, whatever it is told later: only candidates read the round.
    _, action = decide(state, JoinCounts(count=5, prev_count=0, changes=1, fresh=True), s, T0 + 40)
    assert action == WaitUntil(T0 + s.join_timeout)


def test_a_candidate_reads_the_round_when_the_last_call_ends_then_seals() -> None:
    s = rules(min_nodes=2, max_nodes=4, last_call=30.0)
    tally = JoinCounts(count=2, prev_count=0)
    state, action = decide(start(s, tally), tally, s, T0)
    assert state.candidate and state.place == 0
    assert action == WaitUntil(T0 + 30.0)  # the last call, before the join deadline
    state, action = decide(state, tally, s, T0 + 29.9)
    assert action == WaitUntil(T0 + 30.0)  # unchanged: not restarted by a later look
    state, action = decide(state, tally, s, T0 + 30.0)
    assert action == Check()
    read = JoinCounts(count=3, prev_count=0, changes=1, fresh=True)
    state, action = decide(state, read, s, T0 + 30.01)
    assert action == Seal()
    assert state.tried_at_change == read.changes


def test_a_candidate_that_reads_fewer_than_min_nodes_steps_down() -> None:
    s = rules(min_nodes=2, last_call=30.0)
    two = JoinCounts(2, 0)
    state, action = decide(start(s, two), two, s, T0)
    state, action = decide(state, two, s, T0 + 30)
    assert action == Check()
    state, action = decide(state, JoinCounts(1, 0, changes=1, fresh=True), s, T0 + 30.1)  # one left
    assert state.last_call_at is None and action == WaitUntil(T0 + s.join_timeout)


def test_max_nodes_in_the_join_answer_seals_at_once_others_stand_back_by_place() -> None:
    s = rules(min_nodes=2, max_nodes=3)
    # The joiner whose join filled the round: due at once, first in line.
    filler = JoinCounts(count=3, prev_count=0)
    state = start(s, filler)
    assert state.place == 0
    state, action = decide(state, filler, s, T0)
    assert action == Check()
    _, action = decide(state, JoinCounts(3, 0, changes=1, fresh=True), s, T0)
    assert action == Seal()
    # The candidate that saw min_nodes + 1 (but not the round due) stands one place back.
    third = start(s, JoinCounts(count=3, prev_count=1))
    assert third.place == 1
    vacated = JoinCounts(count=3, prev_count=0, changes=1)
    state, action = decide(third, vacated, s, T0 + 5)
    assert action == WaitUntil(T0 + 5 + SEAL_BACKUP_DELAY)
    _, action = decide(state, vacated, s, T0 + 5 + SEAL_BACKUP_DELAY)
    assert action == Check()


def test_a_check_or_seal_is_not_repeated_on_an_unchanged_view() -> None:
    """Sealed by another node (or lost to a change): the next attempt waits for the
    view to change (a failed seal's answer is such a change)."""
    s = rules(min_nodes=1, max_nodes=1)
    tally = JoinCounts(count=1, prev_count=0, changes=1, fresh=True)
    state, action = decide(start(s, JoinCounts(1, 0)), tally, s, T0)
    assert action == Seal()
    state = state.sealed(False)
    state, action = decide(state, tally, s, T0 + 0.1)
    assert action == WaitUntil(T0 + s.join_timeout)  # only the join deadline remains
    _, action = decide(state, JoinCounts(1, 0, changes=2, fresh=True), s, T0 + 0.2)
    assert action == Seal()
    # Once a read showed the round sealed by someone else: no more attempts.
    _, action = decide(state.settle(), JoinCounts(1, 0, changes=3, fresh=True), s, T0 + 0.3)
    assert action == WaitUntil(T0 + s.join_timeout)


def test_after_our_seal_succeeded_we_only_wait_for_its_event() -> None:
    s = rules(min_nodes=1, max_nodes=1)
    tally = JoinCounts(count=1, prev_count=0, fresh=True)
    state, _ = decide(start(s, tally), tally, s, T0)
    state = state.sealed(True)
    _, action = decide(state, JoinCounts(1, 0, changes=5, fresh=True), s, T0 + 1)
    assert action == WaitUntil(T0 + s.join_timeout)


def test_a_running_previous_round_blocks_the_seal() -> None:
    s = rules(min_nodes=1, max_nodes=2)
    tally = JoinCounts(count=2, prev_count=1)
    state, action = decide(start(s, tally), tally, s, T0)
    assert state.candidate and state.place == 1  # not due from its answer
    assert action == WaitUntil(T0 + s.join_timeout) and state.ready_since is None
    vacated = JoinCounts(count=2, prev_count=0, changes=1)
    state, action = decide(state, vacated, s, T0 + 5)
    assert action == WaitUntil(T0 + 5 + SEAL_BACKUP_DELAY)
    _, action = decide(state, vacated, s, T0 + 5 + SEAL_BACKUP_DELAY)
    assert action == Check()


@pytest.mark.parametrize(("count", "due"), [(2, True), (3, True), (4, False)])
def test_fast_recovery_skips_the_last_call_unless_the_round_grows(count: int, due: bool) -> None:
    s = rules(min_nodes=2, max_nodes=8, last_call=30.0)
    tally = JoinCounts(count=count, prev_count=0)
    state, action = decide(start(s, tally, recover_size=3), tally, s, T0)
    assert (action == Check()) is due
    if not due:
        assert action == WaitUntil(T0 + 30.0)
    # Without fast_recovery (no group left) every size waits for the last call.
    _, action = decide(start(s, tally), tally, s, T0)
    assert action == WaitUntil(T0 + 30.0)


def test_fast_recovery_read_finds_a_newcomer_and_waits_for_the_last_call() -> None:
    s = rules(min_nodes=2, max_nodes=8, last_call=30.0)
    state, action = decide(start(s, JoinCounts(3, 0), recover_size=3), JoinCounts(3, 0), s, T0)
    assert action == Check()
    state, action = decide(state, JoinCounts(4, 0, changes=1, fresh=True), s, T0 + 0.1)
    assert action == WaitUntil(T0 + 30.0)
    _, action = decide(state, JoinCounts(4, 0, changes=1, fresh=True), s, T0 + 30.0)
    assert action == Seal()


def test_join_timeout_times_out_and_a_late_seal_is_awaited_without_a_deadline() -> None:
    s = rules(min_nodes=3, join=10.0)
    tally = JoinCounts(count=1, prev_count=0)
    state, action = decide(start(s, tally), tally, s, T0 + 9.9)
    assert action == WaitUntil(T0 + 10.0)
    state, action = decide(state, tally, s, T0 + 10.0)
    assert action == TimeOut()
    state = state.timed_out_late()  # the round was sealed before we could withdraw
    _, action = decide(state, tally, s, T0 + 10.1)
    assert action == WaitUntil(None)


def test_join_timeout_is_suspended_while_a_full_group_runs_and_restarts_after() -> None:
    s = rules(min_nodes=1, max_nodes=2, join=10.0)
    kept_out = JoinCounts(count=1, prev_count=2)
    state, action = decide(start(s, kept_out), kept_out, s, T0)
    assert state.clock.suspended and action == WaitUntil(None)
    state, action = decide(state, kept_out, s, T0 + 100.0)  # long past join_timeout
    assert action == WaitUntil(None)
    one_left = JoinCounts(count=1, prev_count=1, changes=1)
    state, action = decide(state, one_left, s, T0 + 200.0)
    assert not state.clock.suspended and action == WaitUntil(T0 + 210.0)


def test_verdict_of_the_sealed_round() -> None:
    s = rules(min_nodes=2, max_nodes=3)
    # Nobody left: the record names the joins, our sequence number is our place.
    assert verdict(Membership(3, joins=3), seq=2, create_revision=50, rules=s) == Admitted(1, 3)
    assert verdict(Membership(3, joins=5), seq=3, create_revision=50, rules=s) == Admitted(2, 3)
    assert verdict(Membership(3, joins=5), seq=4, create_revision=50, rules=s) == Overflow()
    # Someone left: the record names the members' create revisions.
    named = Membership(2, created=(40, 55))
    assert verdict(named, seq=9, create_revision=55, rules=s) == Admitted(1, 2)
    assert verdict(named, seq=3, create_revision=47, rules=s) == Overflow()  # gone when read
    # A record naming fewer than min_nodes (never written by a seal) forms no group.
    assert verdict(Membership(1, joins=1), seq=1, create_revision=1, rules=s) == Undersized(1)


def test_a_sequence_number_of_an_earlier_count_is_no_rank() -> None:
    """Identity by etcd. Joiner A (seq 1, created at 12) is evicted alive; the last node out deletes
    ``seq/1``; C and D join (seq 1 and 2 again, created at 40 and 41) and the compact record is sealed.
    A's number is 1, but its key is not one the record names: before, A took rank 0 beside C."""
    s = rules(min_nodes=2, max_nodes=4)
    record = Membership.of([Joiner("c", 40, b"{}"), Joiner("d", 41, b"{}")], joins=2, max_nodes=4)
    assert verdict(record, seq=1, create_revision=40, rules=s) == Admitted(0, 2)
    assert verdict(record, seq=2, create_revision=41, rules=s) == Admitted(1, 2)
    assert verdict(record, seq=1, create_revision=12, rules=s) == Overflow()
    assert verdict(record, seq=2, create_revision=45, rules=s) == Overflow()  # created after the last
    # a record of an older version (no first/last) keeps its meaning
    assert decode_membership(b'{"round":1,"world":2,"joins":2}') == Membership(2, joins=2)


def test_membership_encoding_round_trips() -> None:
    joiners = [Joiner(f"n{i}", rev, b"{}") for i, rev in enumerate((7, 9, 30, 31))]
    compact = Membership.of(joiners, joins=4, max_nodes=3)
    assert compact == Membership(3, joins=4, first=7, last=30)
    listed = Membership.of(joiners, joins=6, max_nodes=3)  # two left before the read
    assert listed == Membership(3, created=(7, 9, 30))
    for m in (compact, listed):
        value = encode_sealed(5, 0xAB, ("h", 1), m)
        assert decode_membership(value) == m
        assert decode_sealed(value) == (5, 0xAB, ("h", 1))
    assert json.loads(encode_sealed(5, 0xAB, None, listed))["created"] == [7, 2, 21]


def test_join_clock() -> None:
    clock = JoinDeadline.start(5.0, T0)
    assert not clock.expired(T0 + 4.9) and clock.expired(T0 + 5.0)
    paused = clock.suspend(True, T0 + 1)
    assert paused.suspend(True, T0 + 2) is paused and not paused.expired(T0 + 99)
    assert paused.suspend(False, T0 + 99).at == T0 + 104.0


def test_resolved_only_while_the_round_is_the_last_sealed_one() -> None:
    """A node whose wait ended without its round's outcome reads the members record; a round
    whose successor is sealed was empty at that seal, so the node's group is gone."""
    s = rules(min_nodes=2)
    members = ["a", "me", "c"]
    assert resolved(members, "me", 4, 4, s) == Admitted(1, 3)
    assert resolved(members, "me", 4, 5, s) is None  # sealed over: not ours any more
    assert resolved(members, "nobody", 4, 4, s) is None
    assert resolved(None, "me", 4, 4, s) is None
    assert resolved(["me"], "me", 4, 4, s) is None  # fewer than min_nodes: void


SEALED_KEY = b"/rdzv/run/ctl/sealed"


@pytest.mark.parametrize(
    ("decode", "value", "says"),
    [
        (decode_sealed, b'{"round":0}', "not a positive integer"),
        (decode_sealed, b'{"round":true}', "not a positive integer"),  # a bool is no integer
        (decode_sealed, b'{"round":1,"run_lease":5}', "'run_lease': HEX"),
        (decode_sealed, b'{"round":1,"run_lease":"-5"}', "'run_lease': HEX"),  # int("-5", 16) takes it
        (decode_sealed, b'{"round":1,"run_lease":"0x5"}', "'run_lease': HEX"),
        (decode_sealed, b"[" * 100_000, "'run_lease': HEX"),  # RecursionError: a malformed record
        (decode_sealed, b" " * (MAX_RECORD_BYTES + 1), "'run_lease': HEX"),  # over 16 MiB
        (decode_membership, b'{"round":1,"world":-1}', "malformed membership"),
        (decode_membership, b'{"round":1,"world":true,"joins":1}', "malformed membership"),
        (decode_members, b"[1]", "not a list of node ids"),
    ],
)
def test_malformed_v3_records_are_refused_naming_the_key(decode: Any, value: bytes, says: str) -> None:
    with pytest.raises(ProtocolStateError) as refused:
        decode(value, SEALED_KEY)
    assert str(refused.value).startswith(SEALED_KEY.decode()) and says in str(refused.value)
    assert len(str(refused.value)) < 200  # the value is quoted cut short


@pytest.mark.parametrize("value", [b"zz", b"-5", b"0x5", b" 5", b"5_0", b"8000000000000000", b""])
def test_a_run_key_that_holds_no_lease_id_is_refused(value: bytes) -> None:
    with pytest.raises(ProtocolStateError, match=r"^/rdzv/run/run holds .*, not a lease id$"):
        lease_of(KeyValue(b"/rdzv/run/run", value, 1, 1, 1, 0))
    assert lease_of(KeyValue(b"/rdzv/run/run", b"7fffffffffffffff", 1, 1, 1, 0)) == 2**63 - 1


@pytest.mark.parametrize("master", [["h", 0], ["h", 65536], ["", 1], ["h", True], ["h", "1"], ["h", 1, 2], 5])
def test_a_malformed_master_in_the_sealed_record_is_ignored(master: object) -> None:
    value = json.dumps({"round": 3, "run_lease": "ab", "master": master}).encode()
    assert decode_sealed(value, SEALED_KEY) == (3, 0xAB, None)
    good = json.dumps({"round": 3, "run_lease": "ab", "master": ["h", 65535]}).encode()
    assert decode_sealed(good, SEALED_KEY) == (3, 0xAB, ("h", 65535))


@pytest.mark.parametrize("port", [0, 65536, True, "80", 1.5, None])
def test_a_join_values_malformed_port_or_address_is_absent(port: object) -> None:
    assert address_of(json.dumps({"addr": "h", "port": port}).encode()) == ("h", None)
    assert address_of(json.dumps({"addr": "", "port": 1}).encode()) == (None, 1)
    assert address_of(json.dumps({"addr": 5, "port": 65535}).encode()) == (None, 65535)
    assert address_of(b"[" * 100_000) == (None, None)
