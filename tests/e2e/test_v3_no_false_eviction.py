"""No false eviction (issue 24, item 2): a healthy ``etcd-v3`` job keeps every member through etcd's
and its hosts' hiccups, with the default settings (1 s renewals, eviction after 2 missed ones).

One job of three real torchrun agents (``--nnodes=2:3``, so that a member lost would re-form a group
of two: a false eviction would show as a second worker group) trains on a 3-member etcd cluster
(etcd_rdzv/testing/train.py, DDP on gloo, a JSON-lines step log). While it trains, etcd's leader is
SIGKILLed, then one whole node (agent and worker) is SIGSTOPped for 5 s. The job must log one
worker group throughout: zero worker restarts. The partition scenario e (a 10 s outage of every
etcd member) is tests/e2e/test_partitions.py; a real eviction (SIGKILL of a node with the default
settings) is tests/e2e/test_v3_torchrun.py.

Cost: three agents and their workers start (~30 s on two busy cores), then about 20 s of faults.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers.elastic import Job, job_factory, steps_of
from helpers.matrix import ETCD_BINARIES, FULL_VERSIONS, version_param

from etcd_rdzv.conf_keys import DEFAULT_KEEP_ALIVE_INTERVAL, DEFAULT_KEEP_ALIVE_MAX_ATTEMPT
from etcd_rdzv.testing.agents import summarize
from etcd_server import EtcdCluster

pytestmark = pytest.mark.timeout(300)

STEP_BUDGET = 180  # seconds a step of the scenario may take (deadlines: agents start slowly on 2 cores)
FROZEN = 5.0  # how long the node is stopped
#: The defaults of everything that bears on liveness (Job's FAST_CONF shortens the TTL to 3 s).
DEFAULTS = {"keep_alive_interval": DEFAULT_KEEP_ALIVE_INTERVAL, "keep_alive_max_attempt": DEFAULT_KEEP_ALIVE_MAX_ATTEMPT,
            "last_call_timeout": 30}  # fmt: skip


@pytest.fixture
def jobs(tmp_path: Any) -> Iterator[Callable[..., Job]]:
    with job_factory(tmp_path) as make:
        yield make


def _steps_after(job: Job, t: float, n: int, what: str) -> None:
    """Wait until the job logged ``n`` more steps after ``t`` (one group, or the test fails later)."""
    job.wait_for(what, lambda rs: len({r.step for r in steps_of(rs) if r.t > t}) >= n, timeout=STEP_BUDGET)


@pytest.mark.parametrize("version", [version_param(v) for v in FULL_VERSIONS[:1]])
def test_a_leader_kill_and_a_frozen_node_evict_nobody(version: str, jobs: Callable[..., Job]) -> None:
    if version not in ETCD_BINARIES:
        pytest.skip(f"etcd {version} is not installed")
    cluster = EtcdCluster(3, binary=ETCD_BINARIES[version])
    cluster.start(timeout=60)
    try:
        job = jobs(backend="etcd-v3", endpoint=cluster.endpoint_string, nnodes="2:3", conf=DEFAULTS)
        for name in ("node0", "node1", "node2"):
            job.start(name)
        job.wait_for("the group of three trains", lambda rs: any(g.world_size == 3 for g in summarize(rs)),
                     timeout=STEP_BUDGET)
        _steps_after(job, 0.0, 3, "three steps of the group of three")

        leader = cluster.leader()
        killed_at = time.time()
        cluster.stop_member(leader, graceful=False)
        _steps_after(job, killed_at, 10, "ten steps after the leader was killed")

        frozen = job.nodes["node2"]
        frozen.freeze()
        thawed_at = 0.0
        try:
            time.sleep(FROZEN)  # the fault's duration, not a synchronisation
        finally:
            frozen.thaw()
            thawed_at = time.time()
        _steps_after(job, thawed_at, 10, "ten steps after the node was thawed")

        groups = summarize(job.records())
        print(f"[no-false-eviction] etcd {version}: leader {leader} killed, node2 stopped {FROZEN:g} s: "
              f"{len(groups)} worker group(s), world sizes {[g.world_size for g in groups]}")
        assert [g.world_size for g in groups] == [3], job.diagnostics()
        assert all(a.running() for a in job.nodes.values()), job.diagnostics()
    finally:
        cluster.stop()
