"""Network faults between hosts: torchrun jobs over gloo and etcd members, each on its own host.

Every host is a Linux network namespace of the test's own bed (tests/helpers/netns.py): etcd members
and torchrun agents run in separate namespaces with their own addresses (``10.213.N.x``), the
workers train with gloo between those addresses (``--local-addr`` is the host's address, not
loopback). Faults are packet filters, links taken down and ``tc netem`` inside the namespaces.

Scenarios, each on etcd-v2 and etcd-v3 (the gate runs a on both and the others on one: :data:`GATE`;
``--full-matrix`` runs all), times in benchmarks/results/recovery.json:

c. the etcd leader cut off from the two other members (a minority of one), while a rendezvous
   waits for its last node: the clients fail over, the rendezvous completes;
a. a node cut off from etcd only: the others re-form without it, it stops training (never
   beside the new group), its agent exits without closing the run, and started again after
   the link heals (a pod restart) it rejoins;
e. the whole etcd cluster unreachable for 10 s mid-training: the job keeps training, no
   round is lost;
d. 200 ms latency and 5 % loss between the nodes and etcd: the rendezvous completes;
b. a node cut off from its peers but not from etcd: no group trains while the cut lasts (no
   split brain), every agent restarts its workers, and the job re-forms once it heals.

The module skips, saying why, where network namespaces cannot be created (not root, no
``ip``/``iptables``). Scenario d uses ``tc netem`` where the kernel has it, and otherwise
iptables ``statistic`` loss plus a userspace delay forwarder (tests/helpers/delay_proxy.py);
the method used is printed and recorded with its time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
from helpers.elastic import (
    BACKENDS,
    Job,
    agent_log_times,
    assert_groups_never_overlap,
    group_with,
    pick_version,
    record_timing,
    rendezvous_completions,
    steps_of,
)
from helpers.matrix import ETCD_BINARIES, FULL_VERSIONS, version_param
from helpers.netns import (
    CLIENT_PORT,
    Host,
    NetBed,
    NetemUnavailable,
    NetEtcd,
    netns_unavailable,
    remove_leftovers,
)

from etcd_rdzv.testing.agents import LocalAgent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

_WHY_NOT = netns_unavailable()
if _WHY_NOT is not None:
    pytest.skip(f"network namespaces cannot be created here: {_WHY_NOT}", allow_module_level=True)

VERSIONS = list(FULL_VERSIONS) or sorted(ETCD_BINARIES)
#: Seconds for a fresh 3-node job to train (a deadline, not a sleep): start-up is seconds of CPU per agent
#: and worker, and the suite's parallel lanes share two cores.
START_BUDGET = 180  # a hang bound, not a speed target (loaded CI host: 3 agents' first round can take 120 s)


#: The backends each scenario runs on in the gate (``python -m pytest``, CI); the other runs under
#: ``--full-matrix``. Scenario a (a restarted node rejoins) runs on both: the backends differ there.
#: Keyed by the scenario's number in :func:`pick_version`'s rotation (a 1, d 2, c 3, e 4, b 5).
GATE: dict[int, tuple[str, ...]] = {
    1: BACKENDS,  # a
    2: ("etcd-v3",),  # d
    3: ("etcd-v2",),  # c
    4: ("etcd-v2",),  # e
    5: ("etcd-v3",),  # b
}


def backends(scenario: int, xfail: dict[str, str] | None = None) -> list[Any]:
    """``(backend, version)`` parameters; those the gate does not run (:data:`GATE`) are marked
    ``full_matrix``; ``xfail`` maps a backend to a known defect (a strict xfail)."""
    out = []
    for b in BACKENDS:
        version = pick_version(VERSIONS, scenario, b)
        param = version_param(version, b, version, id=f"{b}-etcd{version}", full_matrix=b not in GATE[scenario])
        if xfail and b in xfail:
            marks = (*param.marks, pytest.mark.xfail(strict=True, reason=xfail[b]))
            param = pytest.param(*param.values, id=param.id, marks=marks)
        out.append(param)
    return out


class NetJob(Job):
    """A :class:`Job` whose nodes run on bed hosts, advertising the host's address."""

    def __init__(self, workdir: str, hosts: Mapping[str, Host], **kwargs: Any) -> None:
        super().__init__(workdir, **kwargs)
        self.hosts = dict(hosts)

    def start(self, name: str, env: Mapping[str, str] | None = None) -> LocalAgent:
        host = self.hosts[name]
        if name in self.nodes:
            old = self.nodes.pop(name)
            old.close()
            self.retired.append(old)
        cmd = [f"--local-addr={host.address}" if a.startswith("--local-addr=") else a for a in self._cmd]
        agent = LocalAgent(
            name,
            host.argv(cmd),
            env={"LOGLEVEL": "INFO", "GLOO_SOCKET_IFNAME": "eth0", **(env or {})},
            output=os.path.join(self.workdir, f"{name}.{len(self.retired)}.out"),
        )
        agent.start()
        self.nodes[name] = agent
        return agent


class Bed:
    """A bed with ``etcd_hosts`` etcd members and ``nodes`` agent hosts, and its jobs."""

    def __init__(self, tmp_path: Any, version: str, etcd_hosts: int, nodes: Sequence[str]) -> None:
        self.tmp_path = tmp_path
        self.net = NetBed()
        self.jobs: list[NetJob] = []
        self.etcd: NetEtcd | None = None
        try:
            self.etcd_hosts = [self.net.add_host(f"e{i}") for i in range(etcd_hosts)]
            self.nodes = {n: self.net.add_host(n) for n in nodes}
            self.etcd = NetEtcd(self.etcd_hosts, binary=ETCD_BINARIES[version])
            self.etcd.start()
        except BaseException:
            self.close()
            raise

    def job(self, **kwargs: Any) -> NetJob:
        assert self.etcd is not None
        kwargs.setdefault("endpoint", self.etcd.endpoints)
        job = NetJob(os.path.join(str(self.tmp_path), f"job{len(self.jobs)}"), self.nodes, **kwargs)
        self.jobs.append(job)
        return job

    def close(self) -> None:
        errors = []
        for job in self.jobs:
            try:
                job.close()
            except AssertionError as e:
                errors.append(str(e))
        if self.etcd is not None:
            self.etcd.stop()
        self.net.close()
        assert not errors, errors


@pytest.fixture
def make_bed(tmp_path: Any) -> Iterator[Any]:
    remove_leftovers()
    made: list[Bed] = []

    def make(version: str, etcd_hosts: int, nodes: Sequence[str]) -> Bed:
        bed = Bed(tmp_path, version, etcd_hosts, nodes)
        made.append(bed)
        return bed

    try:
        yield make
    finally:
        for bed in made:
            bed.close()


def _first_step_time(records: Sequence[Any], group: str) -> float:
    return min(r.t for r in steps_of(records, group))


# --------------------------------------------------------------------------- c. leader isolated


@pytest.mark.parametrize(("backend", "version"), backends(3))
def test_c_leader_isolated_in_a_minority_rendezvous_completes(make_bed: Any, backend: str, version: str) -> None:
    bed = make_bed(version, 3, ["n0", "n1", "n2"])
    job = bed.job(backend=backend, nnodes="3:3")
    job.start("n0")
    job.start("n1")
    # Both wait for the third node; now cut the leader off from the other members.
    job.wait_for(
        "two agents rendezvousing",
        lambda _: all("Rendezvous'ing worker group" in a.output_tail(200) for a in job.nodes.values()),
        START_BUDGET,
    )
    time.sleep(1.0)  # let both join the round (their join is one etcd round trip)
    leader = bed.etcd.leader()
    others = [h for i, h in enumerate(bed.etcd_hosts) if i != leader]
    bed.etcd_hosts[leader].block(*others)
    cut = time.time()
    job.start("n2")
    # The isolated leader's UNKNOWN 'context deadline exceeded' fails over to another member
    # (tests/integration/test_findings.py): the round completes, never a hang. The time it takes is a
    # figure (printed; python -m benchmarks.recovery), not an assertion: worker start-up dominates it.
    group = job.wait_for(
        "a world of 3 training", lambda r: group_with(r, world_size=3, min_steps_done=2), START_BUDGET
    )
    took = _first_step_time(job.records(), group) - cut
    record_timing(
        f"partition_c_leader_isolated/{backend}/etcd{version}",
        {"isolation_to_first_step_s": round(took, 2), "leader": leader},
    )


# --------------------------------------------------------------------------- a. node cut from etcd


@pytest.mark.parametrize(("backend", "version"), backends(1))
def test_a_node_cut_off_from_etcd_stops_and_rejoins(make_bed: Any, backend: str, version: str) -> None:
    """The cut node's agent exits once etcd stays silent for ``read_timeout``
    (RendezvousConnectionError, documented) without closing the run; after the link
    heals the test starts it again, as Kubernetes restarts a pod whose process exited."""
    bed = make_bed(version, 1, ["n0", "n1", "n2"])
    job = bed.job(backend=backend, nnodes="2:3")
    for n in ("n0", "n1", "n2"):
        job.start(n)
    first = job.wait_for("a world of 3 training", lambda r: group_with(r, world_size=3, min_steps_done=2), START_BUDGET)
    victim = bed.nodes["n2"]
    victim.block(*bed.etcd_hosts)
    cut = time.time()
    second = job.wait_for(
        "n0, n1 re-formed without n2",
        lambda r: group_with(r, world_size=2, nodes={"n0", "n1"}, after=cut, min_steps_done=2),
        60,
    )
    second_start = _first_step_time(job.records(), second)
    reformed = second_start - cut
    cut_agent = job.nodes["n2"]
    rc = cut_agent.wait(60)
    assert rc is not None, f"n2's agent still runs {time.time() - cut:.0f} s after the cut\n{job.diagnostics()}"
    assert rc != 0, f"n2's agent exited 0 although it lost etcd\n{job.diagnostics()}"
    exited = time.time() - cut
    # n2 stopped training: it logs nothing in any group once the new group runs.
    late = [r for r in steps_of(job.records()) if r.node == "n2" and r.t > second_start]
    assert not late, f"n2 trained beside the new group: {late[:3]}"
    assert_groups_never_overlap(job.records())
    assert job.nodes["n0"].running() and job.nodes["n1"].running(), job.diagnostics()
    victim.heal()
    healed = time.time()
    job.start("n2")  # the pod restart
    # A hang bound, not a speed target. (The etcd-v2 survivors once saw the restarted node ~40 s late on a
    # loaded CI host: its join of the wait list lost every compare-and-swap to their heartbeats while torch's
    # inspect.stack() event naming sat inside its write window; fixed in etcd_rdzv.dynamic.state.record_event.)
    third = job.wait_for(
        "n2 rejoined", lambda r: group_with(r, world_size=3, after=healed, min_steps_done=2), 180
    )
    rejoined = _first_step_time(job.records(), third) - healed
    record_timing(
        f"partition_a_node_cut_from_etcd/{backend}/etcd{version}",
        {"cut_to_reformed_s": round(reformed, 2), "cut_to_agent_exit_s": round(exited, 2),
         "heal_to_rejoined_s": round(rejoined, 2), "first": first},
    )  # fmt: skip
    assert_groups_never_overlap(job.records())
    assert job.nodes["n0"].running() and job.nodes["n1"].running(), job.diagnostics()


# --------------------------------------------------------------------------- e. etcd unreachable


@pytest.mark.parametrize(("backend", "version"), backends(4))
def test_e_etcd_unreachable_for_10s_training_goes_on(make_bed: Any, backend: str, version: str) -> None:
    bed = make_bed(version, 1, ["n0", "n1", "n2"])
    job = bed.job(backend=backend, nnodes="3:3", conf={"read_timeout": 20})
    for n in ("n0", "n1", "n2"):
        job.start(n)
    group = job.wait_for("a world of 3 training", lambda r: group_with(r, world_size=3, min_steps_done=2), START_BUDGET)
    etcd_host = bed.etcd_hosts[0]
    etcd_host.block(*bed.nodes.values())
    cut = time.time()
    time.sleep(10)  # the outage lasts 10 s (the scenario's fault, not a synchronisation)
    etcd_host.heal()
    healed = time.time()
    during = [r for r in steps_of(job.records(), group) if cut < r.t < healed]
    job.wait_for(
        "the same group trains after the outage",
        lambda r: [s for s in steps_of(r, group) if s.t > healed + 3],
        30,
    )
    groups = {r.group for r in steps_of(job.records())}
    record_timing(
        f"partition_e_etcd_unreachable_10s/{backend}/etcd{version}",
        {"steps_during_outage": len({r.step for r in during}), "groups": len(groups)},
    )
    assert during, "no step was trained while etcd was unreachable"
    assert groups == {group}, f"a round was lost: groups {sorted(groups)}"
    assert all(a.running() for a in job.nodes.values())


# --------------------------------------------------------------------------- d. latency and loss


DELAY_PROXY_PORT = 2479

@pytest.mark.parametrize(("backend", "version"), backends(2))
def test_d_latency_and_loss_to_etcd_rendezvous_completes(make_bed: Any, backend: str, version: str) -> None:
    """With ``tc netem`` where the kernel has it (200 ms on every packet etcd's host
    sends, 5 % of them lost); otherwise iptables ``statistic`` drops 5 % of the packets
    each way between the nodes and etcd, and a userspace forwarder in etcd's namespace
    adds 200 ms to each direction of the client port (the nodes connect through it)."""
    bed = make_bed(version, 1, ["n0", "n1", "n2"])
    etcd_host = bed.etcd_hosts[0]
    endpoint = bed.etcd.endpoints
    try:
        etcd_host.netem(200, 5)
        method, added_rtt_ms = "tc netem (delay 200ms loss 5% on etcd's egress)", 200
    except NetemUnavailable:
        etcd_host.random_loss(5, *bed.nodes.values())
        endpoint = etcd_host.start_delay_proxy(DELAY_PROXY_PORT, CLIENT_PORT, 200)
        method, added_rtt_ms = "iptables statistic 5% loss each way + delay proxy 200ms each way", 400
    job = bed.job(backend=backend, nnodes="3:3", conf={"read_timeout": 30}, endpoint=endpoint)
    start = time.time()
    for n in ("n0", "n1", "n2"):
        job.start(n)
    # The bound covers torchrun's and the workers' start on a loaded 2-core machine (tens of
    # seconds there); the rendezvous itself is recorded apart.
    group = job.wait_for("a world of 3 training", lambda r: group_with(r, world_size=3, min_steps_done=2), 150)
    took = _first_step_time(job.records(), group) - start
    completed = [t for a in job.nodes.values() for t in rendezvous_completions(a)[:1]]
    joining = [t for a in job.nodes.values() for t in agent_log_times(a, "Rendezvous'ing worker group")[:1]]
    assert len(completed) == len(joining) == 3, job.diagnostics()
    print(f"\nscenario d fault method: {method}")
    record_timing(
        f"partition_d_latency_200ms_loss_5pct/{backend}/etcd{version}",
        {"last_join_to_rendezvous_complete_s": round(max(completed) - max(joining), 2),
         "start_to_rendezvous_complete_s": round(max(completed) - start, 2),
         "start_to_first_step_s": round(took, 2), "method": method, "added_rtt_ms": added_rtt_ms},
    )  # fmt: skip


# --------------------------------------------------------------------------- b. node cut from peers


@pytest.mark.parametrize(("backend", "version"), backends(5))
def test_b_node_cut_off_from_peers_no_split_brain(make_bed: Any, backend: str, version: str) -> None:
    """A node that reaches etcd but not its peers keeps its lease, so every round still
    names all three: neither torch's agent nor the rendezvous can tell which node is cut
    off (each side only sees its collectives time out). What must hold: no group trains
    while the cut lasts (no split brain: n0, n1 never train beside n2, nor without the
    round's third member), every agent restarts its workers instead of hanging, and once
    the cut heals the job re-forms and trains on (a cut that outlasts ``--max-restarts``
    cycles of ``pg_timeout`` ends the job: docs/operations.md)."""
    bed = make_bed(version, 1, ["n0", "n1", "n2"])
    job = bed.job(backend=backend, nnodes="2:3", pg_timeout=10, max_restarts=10)
    for n in ("n0", "n1", "n2"):
        job.start(n)
    first = job.wait_for("a world of 3 training", lambda r: group_with(r, world_size=3, min_steps_done=2), START_BUDGET)
    victim = bed.nodes["n2"]
    victim.block(bed.nodes["n0"], bed.nodes["n1"])
    cut = time.time()
    job.wait_for(
        "every agent re-rendezvoused after its workers timed out",
        lambda _: all(any(t > cut for t in rendezvous_completions(a)) for a in job.nodes.values()),
        60,
    )
    restarted = time.time() - cut
    victim.heal()
    healed = time.time()
    during = [r for r in steps_of(job.records()) if cut + 1 < r.t < healed]
    later = job.wait_for(
        "a world of 3 training after the heal",
        lambda r: group_with(r, world_size=3, after=healed, min_steps_done=3),
        START_BUDGET,
    )
    took = _first_step_time(job.records(), later) - healed
    record_timing(
        f"partition_b_node_cut_from_peers/{backend}/etcd{version}",
        {"cut_to_all_restarted_s": round(restarted, 2), "heal_to_training_s": round(took, 2),
         "steps_during_cut": len(during), "first": first},
    )  # fmt: skip
    assert not during, f"a group trained while n2 was cut off from its peers: {during[:3]}"
    assert_groups_never_overlap(job.records())
    assert all(a.running() for a in job.nodes.values()), job.diagnostics()
