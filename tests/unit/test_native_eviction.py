"""The eviction rule of ``etcd-v3`` (:mod:`etcd_rdzv.native.eviction`) without etcd.

``to_evict`` is a pure function of what a survivor read (the leases left in its previous
round, as etcd's leader counts them), of when its own renewals were answered, and of the
time; every case is a made-up look. The rule runs against real etcd and real agents in
tests/integration/test_v3_eviction.py and tests/e2e/test_v3_no_false_eviction.py.
"""

from __future__ import annotations

import pytest

from etcd_rdzv.conf import parse_v3_settings
from etcd_rdzv.native.eviction import OBSERVERS, MemberLease, observes, silent_for, steady_for, to_evict
from etcd_rdzv.native.settings import DEFAULT_EVICT_MISSES, DEFAULT_RENEW_INTERVAL, V3Settings

TTL = 15
NOW = 1000.0


def member(remaining: int, name: str = "b") -> MemberLease:
    return MemberLease(f"join/1/{name}".encode(), 7, 0x10, remaining, TTL)


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


def test_a_dead_member_is_evicted_after_two_missed_renewals() -> None:
    dead, fresh, late_once = member(12, "dead"), member(14, "fresh"), member(13, "late")
    assert to_evict([dead, fresh, late_once], STEADY, NOW, 1.0, 2) == [dead]


def test_a_member_renewed_a_second_ago_is_never_evicted() -> None:
    assert to_evict([member(TTL - 1), member(TTL)], STEADY, NOW, 1.0, 2) == []


def test_nobody_is_evicted_when_the_observers_own_renewals_are_late() -> None:
    # etcd (or this host) is the problem: our last renewal was answered 2.5 s ago
    late = renewals(NOW - 60, until=NOW - 2.5)
    assert to_evict([member(5)], late, NOW, 1.0, 2) == []
    assert to_evict([member(5)], [], NOW, 1.0, 2) == []


def test_after_an_outage_a_member_silent_since_before_it_is_spared() -> None:
    # etcd was out of reach from NOW-12 to NOW-3 for everybody: our renewals resumed 3 s ago,
    # the member's not yet (its stream reconnects later): its silence (10 s) is longer than our
    # steady stretch, so it may be alive, just not reconnected yet
    resumed = renewals(NOW - 60, until=NOW - 12) + renewals(NOW - 3)
    assert steady_for(resumed, NOW, 2.0) == pytest.approx(3.0)
    assert to_evict([member(TTL - 11)], resumed, NOW, 1.0, 2) == []
    # a member that went silent after we were steady again is dead (4 s later, same outage)
    resumed_longer = renewals(NOW - 60, until=NOW - 12) + renewals(NOW - 6)
    assert to_evict([member(TTL - 4)], resumed_longer, NOW, 1.0, 2) == [member(TTL - 4)]


def test_one_late_renewal_of_our_own_breaks_the_steady_stretch() -> None:
    gap = [t for t in STEADY if not NOW - 8 < t < NOW - 5]  # 3 s without an answer, 5 s ago
    assert steady_for(gap, NOW, 2.0) == pytest.approx(5.0)
    assert to_evict([member(TTL - 5)], gap, NOW, 1.0, 2) == [member(TTL - 5)]  # silent 4 s <= 5
    assert to_evict([member(TTL - 7)], gap, NOW, 1.0, 2) == []  # silent 6 s > 5


def test_the_time_the_reads_took_counts_against_the_steady_stretch() -> None:
    gap = [t for t in STEADY if not NOW - 8 < t < NOW - 5]  # steady for 5 s
    assert to_evict([member(TTL - 5)], gap, NOW, 1.0, 2, read_for=0.5) == [member(TTL - 5)]  # 4 + 0.5 <= 5
    assert to_evict([member(TTL - 5)], gap, NOW, 1.0, 2, read_for=1.5) == []  # 4 + 1.5 > 5


def test_gone_leases_are_left_alone_and_zero_misses_turns_eviction_off() -> None:
    assert to_evict([member(-1)], STEADY, NOW, 1.0, 2) == []
    assert to_evict([member(3)], STEADY, NOW, 1.0, 0) == []


def test_more_misses_or_a_longer_interval_wait_longer() -> None:
    assert to_evict([member(11)], STEADY, NOW, 1.0, 3) == [member(11)]  # silent >= 3
    assert to_evict([member(12)], STEADY, NOW, 1.0, 3) == []
    assert to_evict([member(12)], renewals(NOW - 60, 2.0), NOW, 2.0, 2) == []  # needs 4 s
    assert to_evict([member(10)], renewals(NOW - 60, 2.0), NOW, 2.0, 2) == [member(10)]


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
