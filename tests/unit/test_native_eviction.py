"""The eviction rule of ``etcd-v3`` (:mod:`etcd_rdzv.native.leases`) without etcd.

``to_evict`` is a pure function of what a survivor read (the leases left in its previous
round, as etcd's leader counts them), of when its own renewals were answered, and of the
time; every case is a made-up look. The rule runs against real etcd and real agents in
tests/integration/test_v3_eviction.py and tests/e2e/test_v3_no_false_eviction.py.
"""

from __future__ import annotations

import pytest

from etcd_rdzv.conf import parse_v3_settings
from etcd_rdzv.conf_keys import DEFAULT_EVICT_MISSES, DEFAULT_RENEW_INTERVAL
from etcd_rdzv.native.leases import (
    MARGIN,
    OBSERVERS,
    MemberLease,
    Pace,
    condemned_after,
    observes,
    own_pace,
    pace_in,
    silent_for,
    steady_for,
    to_evict,
    tolerated,
)
from etcd_rdzv.native.settings import V3Settings
from etcd_rdzv.native.start import address_of, join_value

TTL = 15
NOW = 1000.0
#: The defaults: a renewal every second, a keep-alive stream moved after 2 s of silence (TTL 15 s).
ONE = Pace(1.0, 2.0)


def member(remaining: int, name: str = "b", pace: Pace | None = None, ttl: int = TTL) -> MemberLease:
    return MemberLease(f"join/1/{name}".encode(), 7, 0x10, remaining, ttl, pace)


def silent(seconds: int, name: str = "b", pace: Pace | None = None, ttl: int = TTL) -> MemberLease:
    """A member whose lease etcd last renewed ``seconds``..``seconds + 1`` ago (as etcd reports it)."""
    return member(ttl - seconds - 1, name, pace, ttl)


def renewals(since: float, every: float = 1.0, until: float = NOW) -> list[float]:
    """Answer times every ``every`` seconds from ``since`` to ``until`` (as a healthy observer sees)."""
    out, t = [], since
    while t <= until:
        out.append(t)
        t += every
    return out


STEADY = renewals(NOW - 60)


def test_silence_is_a_lower_bound_from_whole_seconds() -> None:
    # etcd reports whole seconds: 12 left of 15 means 2 to 3 s since the renewal, so at least 2
    assert silent_for(member(12)) == 2.0
    assert silent_for(member(TTL)) == -1.0  # just renewed
    assert silent_for(member(TTL + 2)) < 0  # a new leader extended every lease


def test_the_bound_with_the_defaults_is_four_seconds_of_silence() -> None:
    # max(k*i = 2, i + failover + M = 1 + 2 + 1, tolerated + i + M = 2 + 1 + 1): 4 s (it was k*i = 2 s)
    assert tolerated(ONE) == 2.0
    assert condemned_after(ONE, ONE, 2) == 4.0
    assert own_pace(V3Settings("r", 2, 3), 2.0) == ONE  # answer_bound(15/3, first_attempt 2) = 2


def test_a_dead_member_is_evicted_after_four_seconds_of_silence() -> None:
    dead, fresh, late = silent(4, "dead"), silent(0, "fresh"), silent(3, "late")
    assert to_evict([dead, fresh, late], STEADY, NOW, ONE, 2) == [dead]


def test_a_member_renewed_a_second_ago_is_never_evicted() -> None:
    assert to_evict([member(TTL - 1), member(TTL)], STEADY, NOW, ONE, 2) == []


def test_the_frozen_follower_timeline_evicts_nobody() -> None:
    """Issue 30: member c's keep-alive stream sits on a follower that stops answering. Its last renewal
    reached the leader at 0; the next one (at 1 s) goes unanswered; the stream moves after the answer
    bound (2 s) and renews at once on the next member: the leader hears c again at about 3 s (measured
    2.98 s). Every silence the leader can report up to then (0..3 s) spares c; the old rule (k*i = 2 s)
    evicted it at 2.09 s."""
    for seconds in range(0, 4):  # etcd reports 0, 1, 2, 3 s: a true silence below 4 s
        assert to_evict([silent(seconds, "c")], STEADY, NOW, ONE, 2) == [], seconds
    # the same with c's pace in its join value (what a node of this version writes)
    assert to_evict([silent(3, "c", ONE)], STEADY, NOW, ONE, 2) == []
    # the bound covers the failover with a margin of its own: 1 + 2 s + MARGIN
    assert condemned_after(ONE, ONE, 2) >= 1.0 + 2.0 + MARGIN


def test_a_member_at_a_slower_pace_is_judged_at_its_own() -> None:
    """Issue 30: a member renewing every 5 s (lease TTL 15 s) is silent up to 5 s while healthy; the old
    rule evicted it 2 s after the others re-joined. Its join value names its pace; its bound is 2 x 5."""
    slow = Pace(5.0, 2.0)
    assert condemned_after(slow, ONE, 2) == 10.0
    assert to_evict([silent(5, "slow", slow)], STEADY, NOW, ONE, 2) == []  # silent 5..6 s (5.5 s)
    assert to_evict([silent(9, "slow", slow)], STEADY, NOW, ONE, 2) == []
    dead = silent(10, "slow", slow)
    assert to_evict([dead], STEADY, NOW, ONE, 2) == [dead]  # still well before its lease (15 s)
    # without the pace in its value (an older version) it is judged at the observer's: as before
    assert to_evict([silent(5, "old")], STEADY, NOW, ONE, 2) == [silent(5, "old")]


def test_a_slow_observer_judges_a_fast_member_only_with_a_margin_over_its_own_gaps() -> None:
    # an observer renewing every 5 s tolerates 6 s gaps in itself: a member condemned after less
    # would be evicted by an etcd slow for 6 s that the observer cannot see
    slow = Pace(5.0, 2.0)
    assert condemned_after(ONE, slow, 2) == tolerated(slow) + 1.0 + MARGIN == 8.0
    every5 = renewals(NOW - 60, 5.0)
    assert to_evict([silent(6)], every5, NOW, slow, 2) == []
    assert to_evict([silent(8, pace=ONE)], every5, NOW, slow, 2) == [silent(8, pace=ONE)]


def test_a_margin_between_what_the_observer_tolerates_in_itself_and_what_condemns() -> None:
    """An etcd that holds every renewal for D makes a member silent for at most D + i (its last renewal
    came up to i before) and gives the observer a gap of at least D: a silence that condemns needs
    D >= L - i = tolerated + M, a gap the observer does not tolerate in itself."""
    for own in (ONE, Pace(0.5, 1.0), Pace(5.0, 2.0)):
        for m in (ONE, Pace(0.5, 1.0), Pace(5.0, 2.0), Pace(2.0, 2.0)):
            for k in (1, 2, 3, 10):
                assert condemned_after(m, own, k) - m.renew >= tolerated(own) + MARGIN
    # etcd held every renewal for 3 s, until just now: the member (last renewed just before) is silent
    # 3-4 s, the observer saw a 4 s gap: more than it tolerates, so nobody is evicted
    held = [t for t in STEADY if not NOW - 3.5 < t < NOW - 0.5]
    assert steady_for(held, NOW, tolerated(ONE)) == 0.0
    assert to_evict([silent(3)], held, NOW, ONE, 2) == []


def test_nobody_is_evicted_when_the_observers_own_renewals_are_late() -> None:
    # etcd (or this host) is the problem: our last renewal was answered 2.5 s ago
    late = renewals(NOW - 60, until=NOW - 2.5)
    assert to_evict([member(5)], late, NOW, ONE, 2) == []
    assert to_evict([member(5)], [], NOW, ONE, 2) == []


def test_after_an_outage_a_member_silent_since_before_it_is_spared() -> None:
    # etcd was out of reach from NOW-20 to NOW-5 for everybody: our renewals resumed 5 s ago,
    # the member's not yet (its stream reconnects later): its silence (18 s) is longer than our
    # steady stretch, so it may be alive, just not reconnected yet
    resumed = renewals(NOW - 60, until=NOW - 20) + renewals(NOW - 5)
    assert steady_for(resumed, NOW, tolerated(ONE)) == pytest.approx(5.0)
    assert to_evict([member(2, ttl=30)], resumed, NOW, ONE, 2) == []
    # a member that went silent after we were steady again is dead (8 s later, same outage)
    resumed_longer = renewals(NOW - 60, until=NOW - 20) + renewals(NOW - 8)
    assert to_evict([silent(5)], resumed_longer, NOW, ONE, 2) == [silent(5)]


def test_one_late_renewal_of_our_own_breaks_the_steady_stretch() -> None:
    gap = [t for t in STEADY if not NOW - 9 < t < NOW - 6]  # 3 s without an answer, 6 s ago
    assert steady_for(gap, NOW, tolerated(ONE)) == pytest.approx(6.0)
    assert to_evict([silent(5)], gap, NOW, ONE, 2) == [silent(5)]  # silent 5 s <= 6
    assert to_evict([silent(7)], gap, NOW, ONE, 2) == []  # silent 7 s > 6


def test_the_time_the_reads_took_counts_against_the_steady_stretch() -> None:
    gap = [t for t in STEADY if not NOW - 9 < t < NOW - 6]  # steady for 6 s
    assert to_evict([silent(5)], gap, NOW, ONE, 2, read_for=0.5) == [silent(5)]  # 5 + 0.5 <= 6
    assert to_evict([silent(5)], gap, NOW, ONE, 2, read_for=1.5) == []  # 5 + 1.5 > 6


def test_gone_leases_are_left_alone_and_zero_misses_turns_eviction_off() -> None:
    assert to_evict([member(-1)], STEADY, NOW, ONE, 2) == []
    assert to_evict([silent(10)], STEADY, NOW, ONE, 0) == []


def test_one_miss_still_evicts() -> None:
    """Issue 30: ``evict_misses=1`` used to turn eviction off silently (the observer's own answers come
    slightly more than one interval apart, and it tolerated no more); the observer's tolerance no longer
    depends on k."""
    jittery = renewals(NOW - 60, 1.01)
    assert steady_for(jittery, NOW, tolerated(ONE)) > 50
    assert to_evict([silent(4)], jittery, NOW, ONE, 1) == [silent(4)]
    assert to_evict([silent(3)], jittery, NOW, ONE, 1) == []  # the failover bound still holds


def test_more_misses_or_a_longer_interval_wait_longer() -> None:
    assert to_evict([silent(5)], STEADY, NOW, ONE, 5) == [silent(5)]  # silent >= 5 x 1
    assert to_evict([silent(4)], STEADY, NOW, ONE, 5) == []
    every2 = renewals(NOW - 60, 2.0)
    two = Pace(2.0, 2.0)
    assert condemned_after(two, two, 2) == 6.0  # tolerated 3 + 2 + 1
    assert to_evict([silent(5)], every2, NOW, two, 2) == []
    assert to_evict([silent(6)], every2, NOW, two, 2) == [silent(6)]


def test_the_join_value_carries_the_pace_and_old_values_stay_readable() -> None:
    value = join_value("10.0.0.1", Pace(5.0, 2.0).fields())
    assert pace_in(value, ONE) == Pace(5.0, 2.0)
    assert address_of(value)[0] == "10.0.0.1"
    assert pace_in(join_value("10.0.0.1"), ONE) == ONE  # a value of an older version: the observer's
    for bad in (b"", b"[]", b'{"renew": 1}', b'{"renew": "1", "failover": 2}', b'{"renew": true, "failover": 2}',
                b'{"renew": -1, "failover": 2}', b'{"renew": 1e400, "failover": 2}'):
        assert pace_in(bad, ONE) == ONE, bad


def test_settings_defaults_and_conf_keys() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    s = V3Settings("r", 2, 3)
    assert (s.renew_interval, s.evict_misses) == (DEFAULT_RENEW_INTERVAL, DEFAULT_EVICT_MISSES) == (1.0, 2)
    assert s.renew_every == 1.0
    assert V3Settings("r", 2, 3, lease_ttl=2).renew_every == pytest.approx(2 / 3)  # a third of a short TTL
    with pytest.raises(ValueError, match="renew_interval"):
        V3Settings("r", 2, 3, renew_interval=0)
    with pytest.raises(ValueError, match="evict_misses"):
        V3Settings("r", 2, 3, evict_misses=-1)

    def parse(**conf: str) -> V3Settings:
        return parse_v3_settings(RendezvousParameters("etcd-v3", "localhost:2379", "r", 2, 3, **conf))[0]

    got = parse(renew_interval="0.5", evict_misses="0")
    assert (got.renew_interval, got.evict_misses) == (0.5, 0)
    with pytest.raises(ValueError, match="evict_misses"):
        parse(evict_misses="-2")


def test_the_first_ranks_of_a_failed_group_observe() -> None:
    s = V3Settings("r", 2, 64)
    assert [r for r in range(64) if observes(s, r)] == list(range(OBSERVERS)) == [0, 1, 2, 3]
    assert not observes(V3Settings("r", 2, 64, evict_misses=0), 0)


def test_the_evictor_looks_again_when_the_previous_round_refills(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 30: once a look found T-1 empty the evictor stopped looking for the rest of the wait,
    although a re-attach (a live member evicted falsely) refills T-1; if that member then died, the
    group waited for its lease. An empty look is now followed by another one an interval later."""
    from types import SimpleNamespace

    from etcd_rdzv.native import leases
    from etcd_rdzv.native.records import RunKeys

    clock = [NOW]
    monkeypatch.setattr(leases.time, "monotonic", lambda: clock[0])
    kvs: list[object] = []
    looks: list[float] = []

    def range_(*_: object, **__: object) -> object:
        looks.append(clock[0])
        return SimpleNamespace(kvs=list(kvs))

    client = SimpleNamespace(range=range_, retry_policy=SimpleNamespace(first_attempt=2.0),
                             lease_ttls=lambda lease: (TTL - 5 - 1, TTL),
                             txn=lambda *_a, **_k: SimpleNamespace(succeeded=True))
    session = SimpleNamespace(id=0x99, renewed_at=lambda: renewals(clock[0] - 60, until=clock[0]))
    ev = leases.Evictor(V3Settings("r", 2, 3), client, RunKeys.for_run("", "r"), 2, session)  # type: ignore[arg-type]
    assert ev.poll(None) == pytest.approx(1.0)  # T-1 empty: the next look in an interval, not never
    clock[0] += 1.0
    kvs.append(SimpleNamespace(key=b"join/1/c", mod_revision=9, lease=0x10, value=join_value("c", ONE.fields())))
    ev.poll(None)
    assert looks == [NOW, NOW + 1.0] and ev.evicted == [b"join/1/c"]  # re-attached, then silent 5 s: evicted
