"""A normal end versus the operator's stop: ``etcd-v3`` side by side with torch's own handlers.

torchrun calls ``shutdown()`` when an agent's job ends; that closes the run (no new
rounds) for every node. torch's agent polls only ``num_nodes_waiting()`` while its
workers are healthy and restarts them when it is positive, so a closed run must
answer 0 to a member that still runs (as torch's c10d handler answers): a node that
ends its job must not stop a slower one's workers. ``etcd-rdzv close`` (and
``set_closed()``, which only a process outside the job calls) is the other signal:
stop every agent now. It also writes the run's abort mark, and then
``num_nodes_waiting()`` is positive for every node, so each agent stops its workers
and learns from ``next_rendezvous`` (``RendezvousClosedError``) that the run is over.

In one process: the handlers of one run per backend, ``next_rendezvous`` in threads
(torch's c10d over a ``TCPStore`` this test hosts, etcd-v3 over the module's etcd).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

import pytest
from helpers.handlers import shutdown_failing
from helpers.nodes import Nodes, results
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from etcd_rdzv.cli import main
from etcd_rdzv.cli.actions import close_v3
from etcd_rdzv.cli.connect import Deadline
from etcd_rdzv.native import protocol
from etcd_rdzv.native.records import RunKeys
from etcd_store.client import EtcdClient

pytestmark = [pytest.mark.timeout(120), pytest.mark.etcd_matrix]

WAIT = 30.0
_ids = itertools.count()
CONF = {
    "c10d": {"join_timeout": "60", "last_call_timeout": "1", "close_timeout": "5"},
    "etcd-v3": {"join_timeout": "60", "last_call_timeout": "0.5", "close_timeout": "5", "heartbeat": "3",
                "read_timeout": "10"},
}


def new_run(backend: str, etcd_endpoint: str) -> Nodes:
    """Handlers of one run of ``backend`` (torch's c10d over a TCPStore, or etcd-v3), in threads."""
    return Nodes(etcd_endpoint, backend, conf=CONF[backend], name="v3close")


def wait_count(client: EtcdClient, prefix: bytes, want: int, timeout: float = WAIT) -> None:
    """Block until exactly ``want`` keys exist under ``prefix`` (watch-driven)."""
    res = client.range(prefix, prefix=True, count_only=True)
    deadline = time.monotonic() + timeout
    with client.watch(prefix, prefix=True, start_revision=res.revision + 1) as watch:
        while res.count != want:
            if time.monotonic() > deadline:
                raise AssertionError(f"{prefix!r} never held {want} keys")
            watch.get(timeout=deadline - time.monotonic())
            res = client.range(prefix, prefix=True, count_only=True)


@pytest.fixture
def make_run(etcd_endpoint: str) -> Iterator[Callable[[str], Nodes]]:
    runs: list[Nodes] = []

    def make(backend: str) -> Nodes:
        runs.append(new_run(backend, etcd_endpoint))
        return runs[-1]

    try:
        yield make
    finally:
        for r in runs:
            r.close()


@pytest.mark.parametrize("backend", ["c10d", "etcd-v3"])
def test_a_peer_that_ends_its_job_leaves_the_others_running(make_run: Callable[[str], Nodes], backend: str) -> None:
    """A peer's ``shutdown()`` (torchrun's at the end of its job) closes the run; a member
    still running keeps its workers (``num_nodes_waiting() == 0``), and only a new
    rendezvous fails: the semantics of torch's handlers for a closed run."""
    run = make_run(backend)
    fast, slow = run.group(2)
    assert fast.shutdown() is True
    # torch's handlers cache the state they read for a second (etcd-v3 reads it each time).
    deadline = time.monotonic() + WAIT
    while not slow.is_closed():
        assert time.monotonic() < deadline, "the run never showed closed"
        time.sleep(0.2)
    # torch's agent restarts healthy workers when this is positive: it must not be.
    for _ in range(3):
        assert slow.num_nodes_waiting() == 0
    with pytest.raises(RendezvousClosedError):
        slow.next_rendezvous()


def test_the_last_member_out_of_a_closed_run_is_not_restarted(make_run: Callable[[str], Nodes]) -> None:
    """Every other member ended (shut down: lease revoked, key gone): the round is short of
    its world size, but a closed run forms no new group, so there is nothing to restart for."""
    run = make_run("etcd-v3")
    a, b, c = run.group(3)
    assert a.shutdown() is True and b.shutdown() is True
    assert c.num_nodes_waiting() == 0


def test_the_operators_close_stops_every_running_member(make_run: Callable[[str], Nodes], etcd_endpoint: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``etcd-rdzv close`` closes the run and marks it aborted: every member's
    ``num_nodes_waiting()`` is positive (its agent stops its workers), its
    ``next_rendezvous`` raises ``RendezvousClosedError``, and a node waiting for the next
    round gets ``RendezvousClosedError`` at once."""
    run = make_run("etcd-v3")
    a, b = run.group(2)
    waiter = run.new(3, 3)
    pending = run.pool.submit(waiter.next_rendezvous)
    with EtcdClient(etcd_endpoint, timeout=10) as client:
        keys = RunKeys.for_run(run.prefix, run.run_id)
        wait_count(client, keys.join_prefix(2), 1)
    assert a.num_nodes_waiting() == 0  # the group is full (max_nodes=2): the newcomer waits
    capsys.readouterr()
    assert main(["--endpoints", etcd_endpoint, "--key-prefix", run.prefix, "close", run.run_id]) == 0
    assert capsys.readouterr().out.strip() == f"closed etcd-v3 run {run.run_id}"
    with pytest.raises(RendezvousClosedError):
        pending.result(timeout=WAIT)
    assert a.is_closed() and b.is_closed()
    assert a.num_nodes_waiting() >= 1 and b.num_nodes_waiting() >= 1
    with pytest.raises(RendezvousClosedError):
        a.next_rendezvous()


def test_set_closed_from_outside_the_job_stops_every_running_member(make_run: Callable[[str], Nodes]) -> None:
    """``set_closed()`` is what a process outside the job calls (torchrun's agents call only
    ``shutdown()``): like ``etcd-rdzv close`` it stops every member that still runs."""
    run = make_run("etcd-v3")
    a, b = run.group(2)
    outsider = run.new(2, 2)
    outsider.set_closed()
    assert a.is_closed() and outsider.is_closed()
    assert a.num_nodes_waiting() >= 1 and b.num_nodes_waiting() >= 1
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()


def test_the_operators_close_also_stops_a_run_that_ended_normally(make_run: Callable[[str], Nodes],
                                                                   etcd_endpoint: str) -> None:
    """The slow node of a finished job (its peers shut down: the run is closed, it keeps
    running) is still stopped by ``etcd-rdzv close``: the abort mark is written also
    when the run is closed already, once."""
    run = make_run("etcd-v3")
    fast, slow = run.group(2)
    assert fast.shutdown() is True
    assert slow.num_nodes_waiting() == 0
    with EtcdClient(etcd_endpoint, timeout=10) as client:
        keys = RunKeys.for_run(run.prefix, run.run_id)
        closed_at = client.get(keys.closed)
        assert closed_at is not None
        first = close_v3(client, run.prefix, run.run_id, Deadline(10))
        assert (first.closed, first.aborted) == (False, True)
        assert slow.num_nodes_waiting() >= 1
        again = close_v3(client, run.prefix, run.run_id, Deadline(10))
        assert (again.closed, again.aborted) == (False, False)
        after = client.get(keys.closed)
        assert after is not None and after.mod_revision == closed_at.mod_revision  # closed once
        assert protocol.count_waiting(client, keys, 1).aborted


def test_abort_is_one_transaction_that_also_closes(etcd_endpoint: str) -> None:
    """``protocol.abort`` on an open run writes ``ctl/closed`` and ``ctl/abort`` together (a
    join is refused from then on, and nothing sees an aborted run that is still open)."""
    with EtcdClient(etcd_endpoint, timeout=10) as client:
        keys = RunKeys.for_run(f"/v3abort{time.monotonic_ns() % 10**9}", "r")
        lease = protocol.ensure_run_lease(client, keys, 60)
        out = protocol.abort(client, keys, lease)
        assert (out.closed, out.aborted) == (True, True)
        closed, aborted = client.get(keys.closed), client.get(keys.abort)
        assert closed is not None and aborted is not None
        assert closed.mod_revision == aborted.mod_revision and aborted.lease == lease
        assert protocol.abort(client, keys, lease) == protocol.AbortOutcome(False, False)


# ------------------------------------------------------------------ a failed agent (issue 30)


def test_torchs_c10d_closes_the_run_when_one_agent_fails(make_run: Callable[[str], Nodes]) -> None:
    """torch's behaviour, for contrast (pytorch/pytorch#67616, #123678): one agent's failure
    closes the run, so a restarted node cannot join any more."""
    run = make_run("c10d")
    failed, survivor = run.group(2)
    shutdown_failing(failed)
    deadline = time.monotonic() + WAIT
    while not survivor.is_closed():
        assert time.monotonic() < deadline, "torch's c10d handler no longer closes the run on a failure"
        time.sleep(0.2)
    with pytest.raises(RendezvousClosedError):
        survivor.next_rendezvous()


def test_an_agent_that_fails_leaves_without_closing_the_run(make_run: Callable[[str], Nodes]) -> None:
    """etcd-v3: a ``shutdown()`` with an exception in flight only leaves: no ``ctl/closed``, its
    join key is gone at once (the survivor's ``num_nodes_waiting()`` turns positive), and the
    survivor re-forms a round with a restarted node (a fresh handler)."""
    run = make_run("etcd-v3")
    failed, survivor = run.group(2)
    assert shutdown_failing(failed) is True  # left: its lease revoked
    assert run.client.get(run.keys.closed) is None
    assert not survivor.is_closed()
    assert survivor.num_nodes_waiting() >= 1  # a lost member: its agent re-rendezvous now
    restarted = run.new(2, 2)
    infos = results(run.join(survivor, restarted))
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
    assert run.client.get(run.keys.closed) is None
    # A normal end still closes it.
    assert restarted.shutdown() is True
    assert run.client.get(run.keys.closed) is not None
