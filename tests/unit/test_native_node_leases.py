"""``NodeLeases`` alone: the node's lease session, the wait's watch, the run lease and stopping.

A fake lease source stands in for the client (these are the object's own rules, not
etcd's: the integration tests in test_v3_protocol.py, test_v3_outage.py and
test_v3_close.py run them against a real etcd).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from etcd_rdzv.native.leases import NodeLeases
from etcd_rdzv.native.records import NodeShutDown, RunKeys
from etcd_rdzv.native.settings import V3Settings


class FakeSession:
    def __init__(self, lease: int, on_lost: Callable[[], None]) -> None:
        self.id = lease
        self.on_lost = on_lost
        self.lost = threading.Event()
        self.gone_at_etcd = False
        self._done = threading.Event()
        self.kept: list[int] = []
        self.closed_with: bool | None = None

    def done(self) -> threading.Event:
        return self._done

    def keep_also(self, lease: int) -> None:
        self.kept.append(lease)

    def close(self, revoke: bool = True) -> None:
        self.closed_with = revoke
        self._done.set()

    def expire(self) -> None:  # what the keep-alive does when etcd reports the lease gone
        self.gone_at_etcd = True
        self.lost.set()
        self._done.set()
        self.on_lost()


class FakeClient:
    def __init__(self) -> None:
        self.sessions: list[FakeSession] = []
        self.revoked: list[int] = []

    def session(self, ttl: float, *, on_lost: Callable[[], None], interval: float) -> FakeSession:
        s = FakeSession(100 + len(self.sessions), on_lost)
        self.sessions.append(s)
        return s

    def lease_revoke(self, lease: int, timeout: float) -> None:
        self.revoked.append(lease)


class FakeWatch:
    cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Observer:
    lost = 0

    def joined(self, round_: int, count: int) -> None:
        pass

    def lease_lost(self) -> None:
        self.lost += 1


def _leases() -> tuple[NodeLeases, FakeClient, Observer]:
    client, observer = FakeClient(), Observer()
    leases = NodeLeases(V3Settings("r", 1, 2), client, RunKeys.for_run("/p", "r"), "n",  # type: ignore[arg-type]
                        observer)
    return leases, client, observer


def test_ensure_grants_once_and_again_after_the_lease_ended() -> None:
    leases, client, observer = _leases()
    assert leases.ensure() == (100, True)
    assert leases.ensure() == (100, False)  # the same live session: no grant
    client.sessions[0].expire()
    assert leases.ensure() == (101, True)
    assert observer.lost == 1


def test_a_lost_lease_and_stop_cancel_the_held_watch() -> None:
    leases, client, _ = _leases()
    leases.ensure()
    watch = FakeWatch()
    assert leases.hold_watch(watch) is client.sessions[0]  # type: ignore[arg-type]
    client.sessions[0].expire()
    assert watch.cancelled
    assert leases.hold_watch(FakeWatch()) is None  # type: ignore[arg-type]  # the lease ended: wait no more
    leases.ensure()
    other = FakeWatch()
    leases.hold_watch(other)  # type: ignore[arg-type]
    assert leases.stop() is client.sessions[1]
    assert other.cancelled and leases.session is None
    late = FakeWatch()
    with pytest.raises(NodeShutDown):
        leases.hold_watch(late)  # type: ignore[arg-type]
    assert late.cancelled
    with pytest.raises(NodeShutDown):
        leases.ensure()


def test_the_run_lease_rides_on_every_session_of_the_node() -> None:
    leases, client, _ = _leases()
    leases.ensure()
    leases.adopt_run_lease(7)
    leases.adopt_run_lease(None)  # a sealed record that names none changes nothing
    assert leases.run_lease == 7 and client.sessions[0].kept == [7]
    renewed = leases.renew()
    assert client.sessions[0].closed_with is False  # its lease is gone: no revoke
    assert renewed.kept == [7]  # type: ignore[attr-defined]
    leases.forget_run_lease(8)
    assert leases.run_lease == 7
    leases.forget_run_lease(7)
    assert leases.run_lease is None


def test_revoke_reports_whether_the_lease_is_gone() -> None:
    leases, client, _ = _leases()
    leases.ensure()
    session = leases.stop()
    assert session is not None
    assert leases.revoke(session, deadline=float("inf"))  # type: ignore[arg-type]
    assert client.revoked == [100]
    assert not leases.revoke(client.sessions[0], deadline=0.0)  # type: ignore[arg-type]  # too late
