"""An etcd-v2 observer's view of the presence keys (etcd_rdzv/dynamic/presence.py), on its own clock
and its own lease's renewals, without etcd: when it may judge, and how long an absence must last."""

from __future__ import annotations

import time

import pytest

from etcd_rdzv.dynamic.presence import Presence


class _Session:
    """A stand-in lease holder: only the renewal times the view reads."""

    def __init__(self, times: list[float]) -> None:
        self.times = times

    def renewed_at(self) -> tuple[float, ...]:
        return tuple(self.times)


def _view(renewals: list[float], present: set[str], seen: set[str], missing: dict[str, float]) -> Presence:
    view = Presence(client=None, state_key="/run", ttl=3)  # type: ignore[arg-type]  # no read is made
    now = time.monotonic()
    view._session = _Session([now - a for a in renewals])  # type: ignore[assignment]
    view._own, view._present, view._seen = "me", frozenset(present | {"me"}), seen | {"me"}
    view._missing_since = {n: now - a for n, a in missing.items()}
    view._read_at, view._trusted_from = now, now - 10
    return view


STEADY = [5.9, 5.4, 4.9, 4.4, 3.9, 3.4, 2.9, 2.4, 1.9, 1.4, 0.9, 0.4]  # seconds ago: every 0.5 s, as the keep-alive stream renews


def test_a_member_absent_for_the_grace_is_departed_one_absent_for_less_is_not() -> None:
    view = _view(STEADY, present={"b"}, seen={"b", "c", "d"}, missing={"c": 1.6, "d": 1.0})
    assert view.grace == 1.5
    assert view.departed(["b", "c", "d"]) == ["c"]


@pytest.mark.parametrize("gap_ago", [0.5, 2.9])
def test_nobody_is_judged_within_a_ttl_of_a_stall_of_our_own_renewals(gap_ago: float) -> None:
    """A gap of 2 s between two of our own renewals in the last TTL (a paused etcd leader: others' leases
    may have ended for the same reason, their owners not yet told): no judgement."""
    renewals = [t for t in STEADY if not gap_ago - 1.0 < t < gap_ago + 1.0]
    view = _view(renewals, present=set(), seen={"c"}, missing={"c": 2.0})
    assert view.present() is None and view.departed(["c"]) == []


def test_no_renewal_for_longer_than_the_stall_bound_is_a_stall_too() -> None:
    view = _view([3.4, 2.9, 2.4, 1.9], present=set(), seen={"c"}, missing={"c": 2.0})
    assert view.departed(["c"]) == []  # the last renewal 1.9 s ago
    assert _view(STEADY, present=set(), seen={"c"}, missing={"c": 2.0}).departed(["c"]) == ["c"]
