"""The ``etcd-v3`` handler when etcd is unreachable for longer than the lease TTL (issue 13, scenario e).

etcd is frozen with SIGSTOP and resumed with SIGCONT: its clock runs on, so every node's lease
expires (and its join key with it) while nobody can reach it, exactly as when the whole cluster is
cut off. The handlers run in this process (the in-process node harness, tests/helpers/nodes.py); a
:class:`Monitor` thread per node calls
``num_nodes_waiting()`` as torch's agent does every monitor interval while its workers are healthy
(so a call is in flight during the outage, as with an agent). A running group must survive such an
outage when no member died (each member re-attaches to its round), and still restart when one did.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from helpers.nodes import ETCD_V3, Nodes, results

from etcd_rdzv.native.handler import EtcdV3RendezvousHandler, RoundResult
from etcd_server import EtcdServer

pytestmark = pytest.mark.timeout(120)

TTL = 2  # the nodes' lease TTL ("heartbeat"); the outage lasts longer
OUTAGE = TTL + 2.0
MONITOR_INTERVAL = 0.1  # torch's default monitor interval
WAIT = 30.0
CONF = {"join_timeout": "60", "last_call_timeout": "0.5", "close_timeout": "5", "heartbeat": str(TTL),
        "read_timeout": "10"}


class Run(Nodes):
    """etcd-v3 handlers of one run on one client (the in-process node harness), and the frozen-etcd fault."""

    def __init__(self, server: EtcdServer) -> None:
        super().__init__(server.get_endpoint(), ETCD_V3, conf=CONF, shared=True, name="v3o")
        self.server = server

    def form(self, *handlers: EtcdV3RendezvousHandler) -> list[RoundResult]:
        res = results(self.start(*handlers), timeout=WAIT)
        assert len({(r.round, r.world_size) for r in res}) == 1
        return res

    def freeze_etcd(self, seconds: float) -> None:
        """etcd answers nothing for ``seconds`` (SIGSTOP), then resumes (SIGCONT); its leases age meanwhile."""
        pid = self.server.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)  # the fault's duration, not a synchronisation
        finally:
            os.kill(pid, signal.SIGCONT)


@pytest.fixture
def run(fresh_etcd: EtcdServer) -> Iterator[Run]:
    r = Run(fresh_etcd)
    try:
        yield r
    finally:
        r.close()


class Monitor:
    """torch's agent loop while its workers are healthy, in a thread: ``num_nodes_waiting()`` every
    monitor interval (before, during and after the outage) until its first positive answer (the
    agent would restart its workers there) or :meth:`stop`."""

    def __init__(self, handler: EtcdV3RendezvousHandler) -> None:
        self.handler = handler
        self.positive: tuple[float, int] | None = None  # (monotonic time, answer)
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                n = self.handler.num_nodes_waiting()
                if n:
                    self.positive = (time.monotonic(), n)
                    return
                self._stop.wait(MONITOR_INTERVAL)
        except BaseException as e:
            self.error = e

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(WAIT)
        assert not self._thread.is_alive()


def lease(handler: EtcdV3RendezvousHandler) -> int:
    session = handler._node.session
    assert session is not None
    return session.id


def test_a_running_group_survives_an_outage_longer_than_the_lease_ttl(run: Run) -> None:
    nodes = [run.new(3, 3) for _ in range(3)]
    run.form(*nodes)
    leases = [lease(h) for h in nodes]
    monitors = [Monitor(h) for h in nodes]
    run.freeze_etcd(OUTAGE)
    # Every lease expired meanwhile. The members re-attach to round 1 (new leases) and no
    # agent is told to restart, also past the grace for absent members.
    time.sleep(nodes[0]._group.grace + 1)  # how long the agents are watched (not a synchronisation)
    for m in monitors:
        m.stop()
    assert [(m.positive, m.error) for m in monitors] == [(None, None)] * 3, \
        "the group was told to restart although no node died"
    assert run.joined(1) == 3 and run.joined(2) == 0
    assert all(lease(h) != old for h, old in zip(nodes, leases, strict=True))
    # The group is still a group: a later restart of its agents forms round 2 of 3.
    assert {r.round for r in run.form(*nodes)} == {2}


def test_a_member_that_died_in_the_outage_still_breaks_the_group(run: Run) -> None:
    a, b, c = (run.new(2, 3) for _ in range(3))
    run.form(a, b, c)
    monitors = [Monitor(a), Monitor(b)]
    session = c._node.stop()  # c dies: no more keep-alives, and it never re-attaches
    assert session is not None
    session.close(revoke=False)
    run.freeze_etcd(OUTAGE)
    thawed = time.monotonic()
    grace = a._group.grace  # read_timeout + heartbeat
    reported = []
    for m in monitors:  # the survivors re-attach, and give c the grace to do so
        m.join(grace + WAIT)
        assert m.error is None and m.positive is not None, "the dead member was never reported"
        reported.append(m.positive[0] - thawed)
    # Reported after the grace (counted from the end of the outage), and not much later.
    assert all(grace <= t <= grace + WAIT / 3 for t in reported), reported
    assert run.joined(1) == 2
    res = run.form(a, b)
    assert {(r.round, r.world_size) for r in res} == {(2, 2)}


def test_a_member_whose_round_was_sealed_over_does_not_re_attach(run: Run) -> None:
    """A member cut off for longer than its TTL while the others re-formed without it
    (scenario a) must not put its key back into the old round: it restarts."""
    a, b, c = (run.new(2, 3) for _ in range(3))
    run.form(a, b, c)
    run.client.lease_revoke(lease(a))  # as if a's keep-alives had not reached etcd for a TTL
    assert b.num_nodes_waiting() >= 1  # etcd answered b at once: a is lost
    assert {(r.round, r.world_size) for r in run.form(b, c)} == {(2, 2)}
    assert a.num_nodes_waiting() >= 1
    assert run.joined(1) == 0
