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
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from helpers.handlers import shut_down_all
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.utils.distributed import get_free_port

from etcd_rdzv.cli import main
from etcd_rdzv.cli.actions import close_v3
from etcd_rdzv.cli.connect import Deadline
from etcd_rdzv.native import protocol, queries
from etcd_rdzv.native.keys import RunKeys
from etcd_rdzv.plugin import create_etcd_v3_rdzv_handler
from etcd_store.client import EtcdClient

pytestmark = [pytest.mark.timeout(120), pytest.mark.etcd_matrix]

WAIT = 30.0
_ids = itertools.count()
CONF = {
    "c10d": {"join_timeout": "60", "last_call_timeout": "1", "close_timeout": "5"},
    "etcd-v3": {"join_timeout": "60", "last_call_timeout": "0.5", "close_timeout": "5", "heartbeat": "3",
                "read_timeout": "10"},
}


class Run:
    """Handlers of one run of ``backend``, their blocking calls in threads."""

    def __init__(self, backend: str, etcd_endpoint: str) -> None:
        self.backend = backend
        self.etcd_endpoint = etcd_endpoint
        self.run_id = f"close-{next(_ids)}"
        self.prefix = f"/v3close{next(_ids)}-{time.monotonic_ns() % 10**9}"
        self.handlers: list[RendezvousHandler] = []
        self.pool = ThreadPoolExecutor(max_workers=8)
        self.tcp_store: dist.TCPStore | None = None
        if backend == "c10d":
            port = get_free_port()
            self.tcp_store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                           timeout=timedelta(seconds=30))

    def handler(self, min_nodes: int, max_nodes: int) -> RendezvousHandler:
        conf: dict[str, Any] = dict(CONF[self.backend])
        if self.backend == "c10d":
            assert self.tcp_store is not None
            params = RendezvousParameters("c10d", f"127.0.0.1:{self.tcp_store.port}", self.run_id, min_nodes,
                                          max_nodes, local_addr="127.0.0.1", **conf)
            # One TCPStore client per node, as each torchrun agent has (one client object is
            # not safe for two nodes' blocking calls at once).
            store = dist.TCPStore("127.0.0.1", self.tcp_store.port, is_master=False, timeout=timedelta(seconds=30))
            h: RendezvousHandler = create_handler(store, C10dRendezvousBackend(store, self.run_id), params)
        else:
            params = RendezvousParameters(self.backend, self.etcd_endpoint, self.run_id, min_nodes, max_nodes,
                                          local_addr="127.0.0.1", key_prefix=self.prefix, **conf)
            h = create_etcd_v3_rdzv_handler(params)
        self.handlers.append(h)
        return h

    def group(self, n: int) -> list[RendezvousHandler]:
        """``n`` handlers (``--nnodes=n``) that formed one round."""
        hs = [self.handler(n, n) for _ in range(n)]
        infos = [f.result(timeout=WAIT) for f in [self.pool.submit(h.next_rendezvous) for h in hs]]
        assert sorted(i.rank for i in infos) == list(range(n))
        return hs

    def close(self) -> None:
        shut_down_all(self.handlers, self.pool)


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
def make_run(etcd_endpoint: str) -> Iterator[Callable[[str], Run]]:
    runs: list[Run] = []

    def make(backend: str) -> Run:
        runs.append(Run(backend, etcd_endpoint))
        return runs[-1]

    try:
        yield make
    finally:
        for r in runs:
            r.close()


@pytest.mark.parametrize("backend", ["c10d", "etcd-v3"])
def test_a_peer_that_ends_its_job_leaves_the_others_running(make_run: Callable[[str], Run], backend: str) -> None:
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


def test_the_last_member_out_of_a_closed_run_is_not_restarted(make_run: Callable[[str], Run]) -> None:
    """Every other member ended (shut down: lease revoked, key gone): the round is short of
    its world size, but a closed run forms no new group, so there is nothing to restart for."""
    run = make_run("etcd-v3")
    a, b, c = run.group(3)
    assert a.shutdown() is True and b.shutdown() is True
    assert c.num_nodes_waiting() == 0


def test_the_operators_close_stops_every_running_member(make_run: Callable[[str], Run], etcd_endpoint: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``etcd-rdzv close`` closes the run and marks it aborted: every member's
    ``num_nodes_waiting()`` is positive (its agent stops its workers), its
    ``next_rendezvous`` raises ``RendezvousClosedError``, and a node waiting for the next
    round gets ``RendezvousClosedError`` at once."""
    run = make_run("etcd-v3")
    a, b = run.group(2)
    waiter = run.handler(3, 3)
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


def test_set_closed_from_outside_the_job_stops_every_running_member(make_run: Callable[[str], Run]) -> None:
    """``set_closed()`` is what a process outside the job calls (torchrun's agents call only
    ``shutdown()``): like ``etcd-rdzv close`` it stops every member that still runs."""
    run = make_run("etcd-v3")
    a, b = run.group(2)
    outsider = run.handler(2, 2)
    outsider.set_closed()
    assert a.is_closed() and outsider.is_closed()
    assert a.num_nodes_waiting() >= 1 and b.num_nodes_waiting() >= 1
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()


def test_the_operators_close_also_stops_a_run_that_ended_normally(make_run: Callable[[str], Run],
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
        assert queries.count_waiting(client, keys, 1).aborted


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
