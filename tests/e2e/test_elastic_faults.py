"""Fault scenarios with real torchrun agents, real workers and a real etcd.

Every scenario runs the training script (etcd_rdzv/testing/train.py: DDP on gloo,
checkpoint every 3 steps, a JSON-lines step log) under local torchrun agents
(tests/helpers/elastic.py) and judges the job by its log and its agents' exit codes.
Recovery times are printed (``[timing]`` lines) and, under ``python -m benchmarks.recovery``, collected
into benchmarks/results/recovery.json.

Each scenario runs on both backends, on the whole-suite version (3.7: the scenarios' code paths do not
branch on the etcd version); scale-down also runs on 3.6 (the other version users run today) with
etcd-v2 (tests/helpers/etcd_versions.py); 3.4 and 3.5 are covered by the client, store and backend
contract tests of the matrix. The gate (``python -m pytest``, CI) runs the cells without brackets;
``--full-matrix`` runs them all (:data:`GATE`)::

    scenario                          etcd-v2     etcd-v3
    1 scale-down (node SIGKILLed)     [3.7], 3.6  3.7
    2 scale-up (fourth node joins)    3.7         [3.7]
    3 exclusivity (node SIGSTOPped)   [3.7]       3.7
    4 etcd restarted mid-training     [3.7]       3.7
    5 3-member cluster, leader killed 3.7         [3.7]
    6 rendezvous closed from outside  (the same job as 5)
    7 bad input (3 agents)            3.7         3.7

Which node dies also alternates: in scenario 1 etcd-v2 loses a node that does
not host the worker group's store (the case measured in the issue: stale keys
in a surviving shared store) and etcd-v3 loses the node of group rank 0 (the
store host); scenario 3 freezes the other kind.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Any

import pytest
from helpers.elastic import (
    BACKENDS,
    FAST_CONF,
    Job,
    assert_groups_never_overlap,
    exclusive_records,
    group_with,
    job_factory,
    node_of_group_rank,
    pick_version,
    record_timing,
    rendezvous_completions,
    steps_of,
)
from helpers.matrix import ETCD_BINARIES, FULL_VERSIONS, SELECTED, version_param
from helpers.ports import closed_port

from etcd_rdzv.testing.agents import LocalAgent, summarize, torchrun_command
from etcd_rdzv.testing.train import Record
from etcd_server import EtcdCluster, EtcdServer, TLSConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

#: Seconds a scenario's step may take (deadlines, not sleeps): agents and workers cost seconds of CPU each
#: to start, and the suite's parallel lanes share two cores.
STEP_BUDGET = 240

VERSIONS = list(FULL_VERSIONS) or sorted(ETCD_BINARIES)

#: etcd-v2's settings in the scale-up scenario (and in scenarios 5-6, whose outside closer's compare-and-set
#: competes with the agents' heartbeats for close_timeout): torch's default heartbeat (5 s x 3), a 5 s last call.
#: torch's handler keeps the state in one key written by compare-and-set; every node in the join loop
#: writes its heartbeat each keep_alive_interval, every reader drops a forming round's node whose stored
#: heartbeat is older than keep_alive_interval x keep_alive_max_attempt, and the round completes
#: last_call_timeout after min_nodes joined (waiting nodes read the state once a second). When four
#: agents re-join at once on a loaded host, FAST_CONF's 1 s heartbeats saturate the key (one write wins
#: per round trip), live nodes lose the race for more than the 3 s window and are dropped, and the 1 s
#: last call completes rounds of 2 or 3 without them; each such round restarts every worker, which loads
#: the host more (measured with the agents and etcd in a 0.3-CPU cgroup: 1 to 5 extra rounds, 115 s to
#: the 4-node rendezvous, once no 4-node group within STEP_BUDGET; the CI run's 71 s). Nobody dies in
#: this scenario, and 4 = max_nodes completes the round at once, so only the first 3-node round waits
#: for the last call; the heartbeat costs nothing here.
V2_CALM_CONF: dict[str, Any] = {"keep_alive_interval": 5, "keep_alive_max_attempt": 3, "last_call_timeout": 5}
HEARTBEAT_TIMEOUT = FAST_CONF["keep_alive_interval"] * FAST_CONF["keep_alive_max_attempt"]
KEY_PREFIX = "/torch/elastic/rendezvous"


def _installed_backends() -> set[str]:
    return {ep.name for ep in entry_points(group="torchrun.handlers")}


#: The backends each scenario runs on in the gate (``python -m pytest``, CI); the others run under
#: ``--full-matrix``. Each end-to-end job costs about 5 s of CPU per agent and per worker started (the
#: torch import), so the gate runs a scenario once where the backends share the path it tests.
GATE: dict[int, tuple[str, ...]] = {
    1: ("etcd-v3",),  # etcd-v2 runs it on 3.6 (backends_on_subset_versions)
    2: ("etcd-v2",),
    3: ("etcd-v3",),
    4: ("etcd-v3",),
    5: ("etcd-v2",),
    7: BACKENDS,
}


def backends(scenario: int) -> list[Any]:
    """``(backend, version)`` parameters of a scenario (see the table above); those the gate
    does not run (:data:`GATE`) are marked ``full_matrix``."""
    out = []
    for b in BACKENDS:
        version = pick_version(VERSIONS, scenario, b)
        out.append(version_param(version, b, version, id=f"{b}-etcd{version}", full_matrix=b not in GATE[scenario]))
    return out


def backends_on_subset_versions() -> list[Any]:
    """The scale-down scenario on 3.6 with etcd-v2 (see the table above)."""
    pairs = [("3.6", "etcd-v2")]
    return [version_param(v, b, v, id=f"{b}-etcd{v}") for v, b in pairs if v in SELECTED]


def _require(backend: str) -> None:
    if backend not in _installed_backends():
        pytest.skip(f"rendezvous backend {backend!r} is not installed (no torchrun.handlers entry point)")


@pytest.fixture
def jobs(tmp_path: Any) -> Iterator[Callable[..., Job]]:
    """Factory of :class:`Job` under tmp_path; every job is killed (and checked
    for leftover processes) at teardown, also when the test fails."""
    with job_factory(tmp_path) as make:
        yield make


@pytest.fixture
def etcd(backend: str, version: str) -> Iterator[EtcdServer]:
    """A fresh etcd of the version the scenario/backend pair uses."""
    _require(backend)
    server = EtcdServer(binary=ETCD_BINARIES[version])
    server.start(timeout=60)
    try:
        yield server
    finally:
        server.stop()


def _last_ckpt_before(records: list[Record], t: float) -> int:
    return max((r.step for r in records if r.kind == "ckpt" and r.t <= t), default=0)


def _first_step(records: list[Record], group: str) -> Record:
    return min(steps_of(records, group), key=lambda r: (r.step, r.t))


def _finished(records: list[Record]) -> bool:
    return any(r.kind == "done" for r in records)


# ---------------------------------------------------------------------- 1 scale-down


@pytest.mark.etcd_matrix("3.6")
@pytest.mark.parametrize(("backend", "version"), backends(1) + backends_on_subset_versions())
def test_scale_down_after_node_sigkill(
    backend: str, version: str, etcd: EtcdServer, jobs: Callable[..., Job]
) -> None:
    """3 nodes x 2 workers; one node (agent + workers) SIGKILLed mid-training.

    The survivors re-rendezvous as 2 nodes / 4 workers with torch's default
    agent-store sharing, resume from the last checkpoint and finish.
    """
    job = jobs(backend=backend, endpoint=etcd.get_endpoint(), nnodes="2:3", nproc_per_node=2)
    for i in range(3):
        job.start(f"node{i}")
    full = job.wait_for(
        "a 6-worker group that trained past a checkpoint",
        lambda rs: _trained_past_checkpoint(rs, 6),
        timeout=180,
    )
    records = job.records()
    victim_rank = 2 if backend == "etcd-v2" else 0
    victim = node_of_group_rank(records, full, victim_rank)
    survivors = {n for n in job.nodes if n != victim}

    killed_at = job.nodes[victim].kill()
    new = job.wait_for(
        "the survivors training as 4 workers",
        lambda rs: group_with(rs, world_size=4, nodes=survivors, after=killed_at),
        timeout=STEP_BUDGET,
    )
    job.finish()
    codes = job.wait_exit(sorted(survivors), timeout=STEP_BUDGET)
    records = job.records()
    assert codes == dict.fromkeys(sorted(survivors), 0), job.diagnostics()
    assert _finished(records), job.diagnostics()

    # resumed from the last checkpoint written before the kill
    start = next(r for r in records if r.group == new and r.kind == "start")
    last_ckpt = _last_ckpt_before(records, killed_at)
    assert start.resumed_from >= last_ckpt and start.resumed_from % 3 == 0, job.diagnostics()
    first = _first_step(records, new)
    assert first.step == start.resumed_from + 1
    # nothing of the dead node after the kill; the old group made no progress after it
    assert not [r for r in records if r.node == victim and r.t > killed_at]
    # A step needs every rank's all-reduce, so survivors of the old group got at most
    # one step past the victim's last logged one (the step it died in).
    victim_last = max(r.step for r in steps_of(records, full) if r.node == victim)
    assert max(r.step for r in steps_of(records, full)) <= victim_last + 1, job.diagnostics()
    assert_groups_never_overlap([r for r in records if r.t > killed_at])

    recovery = first.t - killed_at
    record_timing(
        f"scale_down/{backend}/etcd{etcd.version}",
        {
            "kill_to_rendezvous_complete_s": _rendezvous_after(job, survivors, killed_at),
            "kill_to_new_group_s": round(start.t - killed_at, 2),
            "kill_to_first_step_s": round(recovery, 2),
            "victim_group_rank": victim_rank,
            "steps_lost": (max(r.step for r in steps_of(records, full)) - start.resumed_from),
            "setup": "3 agents x 2 workers, --nnodes=2:3, keep_alive 1 s x 3, last_call 1 s, monitor 0.3 s",
        },
    )


# ---------------------------------------------------------------------- 2 scale-up


@pytest.mark.parametrize(("backend", "version"), backends(2))
def test_scale_up_fourth_node_joins(
    backend: str, version: str, etcd: EtcdServer, jobs: Callable[..., Job]
) -> None:
    """A fourth node joins a running --nnodes=2:4 job; the job re-rendezvouses and includes it.

    etcd-v2 runs with :data:`V2_CALM_CONF` (why: there). The figures record how many rounds
    the new node's agent completed until the 4-node group trained (1 when nothing churned).
    """
    conf = V2_CALM_CONF if backend == "etcd-v2" else None
    job = jobs(backend=backend, endpoint=etcd.get_endpoint(), nnodes="2:4", module=True, conf=conf)
    for i in range(3):
        job.start(f"node{i}")
    job.wait_for("a 3-node group training", lambda rs: group_with(rs, world_size=3, min_steps_done=2), 180)
    joined_at = time.time()
    job.start("node3")
    everyone = {f"node{i}" for i in range(4)}
    grown = job.wait_for(
        "a group of all 4 nodes training",
        lambda rs: group_with(rs, world_size=4, nodes=everyone, after=joined_at),
        timeout=STEP_BUDGET,
    )
    job.finish()
    codes = job.wait_exit(timeout=STEP_BUDGET)
    records = job.records()
    assert codes == dict.fromkeys(sorted(everyone), 0), job.diagnostics()
    assert _finished(records)
    assert [r for r in steps_of(records, grown) if r.node == "node3"]
    assert_groups_never_overlap(records)
    first = _first_step(records, grown)
    grown_at = min(r.t for r in records if r.group == grown)
    record_timing(
        f"scale_up/{backend}/etcd{etcd.version}",
        {
            "join_to_rendezvous_complete_s": _rendezvous_after(job, everyone, joined_at),
            "join_to_first_step_s": round(first.t - joined_at, 2),
            "resumed_from": first.step - 1,
            "rounds_until_grown": len(
                [c for c in rendezvous_completions(job.nodes["node3"]) if joined_at < c <= grown_at]
            ),
            "setup": f"3 agents + 1 x 1 worker, --nnodes=2:4, keep_alive {job.conf['keep_alive_interval']} s x "
            f"{job.conf['keep_alive_max_attempt']}, last_call {job.conf['last_call_timeout']} s, monitor 0.3 s",
        },
    )


# ---------------------------------------------------------------------- 3 exclusivity


@pytest.mark.parametrize(("backend", "version"), backends(3))
def test_frozen_node_is_dropped_and_never_trains_alongside(
    backend: str, version: str, etcd: EtcdServer, jobs: Callable[..., Job]
) -> None:
    """A node frozen (SIGSTOP) past the heartbeat timeout is dropped; after
    SIGCONT it never trains alongside the new group, and joins a later round.

    Two nodes, --nnodes=1:2 (the survivor goes on alone): the smallest job that
    shows it. The survivor's collective fails after the training script's
    --pg-timeout (6 s), its agent re-rendezvous without the frozen node."""
    job = jobs(backend=backend, endpoint=etcd.get_endpoint(), nnodes="1:2", pg_timeout=6)
    for i in range(2):
        job.start(f"node{i}")
    full = job.wait_for(
        "a 2-node group training", lambda rs: group_with(rs, world_size=2, min_steps_done=2), 180
    )
    victim = node_of_group_rank(job.records(), full, 0 if backend == "etcd-v2" else 1)
    survivors = {n for n in job.nodes if n != victim}

    job.nodes[victim].freeze()
    frozen_at = time.time()  # every process of the node is stopped by now
    job.wait_for(
        "the survivor training without the frozen node",
        lambda rs: group_with(rs, world_size=1, nodes=survivors, after=frozen_at, min_steps_done=2),
        timeout=STEP_BUDGET,
    )
    assert time.time() - frozen_at > HEARTBEAT_TIMEOUT
    thawed_at = time.time()
    job.nodes[victim].thaw()
    job.wait_for(
        "the thawed node training in a later round",
        lambda rs: group_with(rs, world_size=2, after=thawed_at),
        timeout=STEP_BUDGET,
    )
    job.finish()
    codes = job.wait_exit(timeout=STEP_BUDGET)
    records = job.records()
    # Steps whose all-reduce completed before the freeze are logged on thaw (checked just below).
    assert_groups_never_overlap(exclusive_records(records, [(victim, thawed_at)]))
    # The frozen node did nothing for the old group after the freeze. A step whose
    # all-reduce had completed may be logged on thaw, but none beyond the survivor's
    # last step in that group, and no checkpoint (train.py's round fence drops it).
    late = [r for r in records if r.node == victim and r.group == full and r.t > frozen_at]
    survivor_last = max(r.step for r in steps_of(records, full) if r.node != victim)
    assert all(r.kind == "step" and r.step <= survivor_last for r in late), late
    assert set(codes.values()) == {0}, job.diagnostics()
    assert _finished(records)
    record_timing(
        f"exclusivity/{backend}/etcd{etcd.version}",
        {
            "freeze_to_rendezvous_complete_s": _rendezvous_after(job, survivors, frozen_at),
            "freeze_to_new_group_first_step_s": round(
                min(r.t for r in steps_of(records) if r.t > frozen_at and r.group != full) - frozen_at, 2
            ),
            "thaw_to_2_node_first_step_s": round(
                min(r.t for r in steps_of(records) if r.t > thawed_at and r.world_size == 2) - thawed_at, 2
            ),
            "pg_timeout_s": 6,
        },
    )


# ---------------------------------------------------------------------- 4 etcd restart


@pytest.mark.parametrize(("backend", "version"), backends(4))
def test_job_survives_etcd_restart(
    backend: str, version: str, etcd: EtcdServer, jobs: Callable[..., Job]
) -> None:
    """etcd stopped and started again (same data dir) mid-training: the job finishes.

    etcd 3.6+ answers SIGTERM by refusing new connections at once but waiting up to its request
    timeout (5 s + 2 election timeouts) for open watch and keep-alive streams before it exits; 3.4
    and 3.5 exit at once. So the outage is the 2 s below plus up to 5.2 s of shutdown, and every
    agent's etcd calls get a deadline (read_timeout) above that.
    """
    job = jobs(backend=backend, endpoint=etcd.get_endpoint(), nnodes="2", conf={"read_timeout": 15})
    for i in range(2):
        job.start(f"node{i}")
    job.wait_for("training under way", lambda rs: group_with(rs, world_size=2, min_steps_done=2), 180)
    down_at = time.time()
    etcd.stop(keep_data=True)
    stopped_at = time.time()
    time.sleep(2.0)  # the outage: two keep-alive intervals without etcd
    etcd.start(timeout=60, num_retries=1)
    up_at = time.time()
    job.wait_for("a step after etcd came back", lambda rs: [r for r in steps_of(rs) if r.t > up_at], 120)
    job.finish()
    codes = job.wait_exit(timeout=STEP_BUDGET)
    records = job.records()
    assert codes == {"node0": 0, "node1": 0}, job.diagnostics()
    assert _finished(records)
    record_timing(
        f"etcd_restart/{backend}/etcd{etcd.version}",
        {
            "etcd_down_s": round(up_at - down_at, 2),
            "etcd_stop_s": round(stopped_at - down_at, 2),
            "worker_groups": len({r.group for r in records}),
        },
    )


# ---------------------------------------------------------------------- 5 leader killed, 6 closed


@pytest.mark.parametrize(("backend", "version"), backends(5))
def test_leader_killed_during_rendezvous_then_closed_from_outside(
    backend: str, version: str, jobs: Callable[..., Job]
) -> None:
    """Scenario 5: a 3-member etcd cluster loses its leader while a node waits in
    the rendezvous; the rendezvous completes and the job trains. Scenario 6 on the
    same job (one job for both keeps the suite short): set_closed() from a process
    outside the job, through the surviving members, ends every agent and its workers."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    _require(backend)
    cluster = EtcdCluster(3, binary=ETCD_BINARIES[version])
    cluster.start(timeout=60)
    try:
        # etcd-v2: every agent writes its heartbeat into the one state key each keep_alive_interval,
        # also while training; with FAST_CONF's 1 s the outside closer's compare-and-set lost to them
        # for its whole 10 s close_timeout on a loaded CI host (RendezvousTimeoutError). Nobody dies here.
        conf = V2_CALM_CONF if backend == "etcd-v2" else None
        job = jobs(backend=backend, endpoint=cluster.endpoint_string, nnodes="2", conf=conf)
        job.start("node0")
        client = cluster.get_client(timeout=5)
        prefix = f"{KEY_PREFIX}/{job.run_id}".encode()
        try:
            deadline = time.monotonic() + 120
            while not client.range(prefix, prefix=True, keys_only=True).kvs:  # node0 has joined
                assert job.nodes["node0"].running(), job.diagnostics()
                assert time.monotonic() < deadline, job.diagnostics()
                time.sleep(0.2)
        finally:
            client.close()
        leader = cluster.leader()
        killed_at = time.time()
        cluster.stop_member(leader, graceful=False)
        job.start("node1")
        job.wait_for(
            "scenario 5: the rendezvous completed after the leader died and the job trains",
            lambda rs: group_with(rs, world_size=2, min_steps_done=2),
            timeout=180,
        )
        first = min(r.t for r in steps_of(job.records()))
        record_timing(
            f"leader_killed/{backend}/etcd{cluster.version}",
            {"leader_kill_to_first_step_s": round(first - killed_at, 2), "killed_member": leader},
        )

        params = RendezvousParameters(
            backend=backend,
            endpoint=cluster.endpoint_string,
            run_id=job.run_id,
            min_nodes=2,
            max_nodes=2,
            **job.conf,
        )
        handler = get_rendezvous_handler(params)
        closed_at = time.time()
        handler.set_closed()
        assert handler.is_closed()
        deadline = time.monotonic() + 60
        for agent in job.nodes.values():
            agent.wait(max(0.0, deadline - time.monotonic()))
        ended_at = time.time()
        running = [n for n, a in job.nodes.items() if a.running()]
        assert not running, (
            f"scenario 6: {running} still running 60 s after set_closed()\n{job.diagnostics()}"
        )
        for name, agent in job.nodes.items():
            assert not agent.pids(), f"scenario 6: {name} left processes behind"
            assert "closed" in agent.output_tail(200).lower(), job.diagnostics()
        records = job.records()
        assert not _finished(records)
        assert not [r for r in steps_of(records) if r.t > ended_at]
        record_timing(
            f"closed/{backend}/etcd{cluster.version}",
            {
                "close_to_all_agents_exited_s": round(ended_at - closed_at, 2),
                "exit_codes": {n: a.returncode for n, a in job.nodes.items()},
            },
        )
    finally:
        cluster.stop()


# ---------------------------------------------------------------------- 7 bad input


@pytest.mark.parametrize(("backend", "version"), backends(7))
def test_bad_input_fails_fast_and_clearly(
    backend: str, version: str, etcd: EtcdServer, tmp_path: Any
) -> None:
    """Nothing listening -> a clear error within read_timeout and a non-zero exit
    of torchrun (a real agent); wrong CA -> a TLS error; corrupt state ->
    RendezvousStateError naming the key (both through the handler torchrun
    creates, in this process: the message is what torchrun would print)."""
    from helpers.certs import make_certs
    from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from etcd_store.client import EtcdClient

    dead_endpoint = f"127.0.0.1:{closed_port()}"
    cmd = torchrun_command(
        ["--log-file", str(tmp_path / "log.jsonl"), "--ckpt-dir", str(tmp_path / "ckpt")],
        nnodes="1", nproc_per_node=1, backend=backend, endpoint=dead_endpoint, run_id="bad-endpoint",
        rdzv_conf={**FAST_CONF, "join_timeout": 120, "read_timeout": 3}, max_restarts=0,
    )  # fmt: skip
    unreachable = LocalAgent("unreachable", cmd, output=str(tmp_path / "unreachable.out"))
    started = time.monotonic()
    unreachable.start()
    try:

        def attempt(endpoint: str, run_id: str, **conf: Any) -> tuple[BaseException, float]:
            params = RendezvousParameters(
                backend=backend, endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=1,
                **{**FAST_CONF, **conf},
            )  # fmt: skip
            t0 = time.monotonic()
            handler = None
            try:
                handler = get_rendezvous_handler(params)
                handler.next_rendezvous()
            except Exception as e:
                return e, time.monotonic() - t0
            finally:
                if handler is not None:
                    with contextlib.suppress(Exception):
                        handler.shutdown()
            raise AssertionError(f"{run_id}: the rendezvous succeeded")

        certs = make_certs(tmp_path / "certs")
        tls = TLSConfig(
            cert_file=certs.server_cert, key_file=certs.server_key, ca_file=certs.ca, client_cert_auth=False
        )
        with EtcdServer(tls=tls, binary=etcd.binary) as tls_server:
            err, took = attempt(f"https://{tls_server.get_endpoint()}", "bad-ca", ca_cert=certs.other_ca)
        assert "tls" in str(err).lower() or "certificate" in str(err).lower(), repr(err)
        assert took < 30, took

        state_key = _state_key(backend, "corrupt")
        with EtcdClient(etcd.get_endpoint(), timeout=5) as c:
            c.put(state_key.encode(), b"\x00not a rendezvous state{")
        err, _ = attempt(etcd.get_endpoint(), "corrupt")
        assert isinstance(err, RendezvousStateError) and state_key in str(err), repr(err)

        rc = unreachable.wait(100)
        exited_after = time.monotonic() - started
        out = unreachable.output_tail(60)
        assert rc is not None and rc != 0, out
        assert dead_endpoint in out, out
        # join_timeout is 120 s: an exit well before it means read_timeout (3 s) bounded the wait
        assert exited_after < 75, exited_after
        record_timing(
            f"bad_input/{backend}/etcd{etcd.version}",
            {
                "unreachable_agent_exit_after_start_s": round(exited_after, 1),
                "wrong_ca_error_after_s": round(took, 2),
            },
        )
    finally:
        unreachable.close()


def _rendezvous_after(job: Job, nodes: set[str], t: float) -> float | None:
    """Seconds from ``t`` until the last of ``nodes`` logged its first completed rendezvous after ``t``."""
    firsts = []
    for name in nodes:
        after = [c for c in rendezvous_completions(job.nodes[name]) if c > t]
        if not after:
            return None
        firsts.append(min(after))
    return round(max(firsts) - t, 2)




def _trained_past_checkpoint(records: list[Record], world_size: int) -> str | None:
    """A group of ``world_size`` that logged a step after one of its checkpoints."""
    for g in summarize(records):
        if g.world_size != world_size:
            continue
        ckpts = [r.step for r in records if r.group == g.group and r.kind == "ckpt"]
        if ckpts and any(r.step > max(ckpts) for r in steps_of(records, g.group)):
            return g.group
    return None


def _state_key(backend: str, run_id: str) -> str:
    """The key holding a run's rendezvous state (what a corrupt value is written to)."""
    if backend == "etcd-v3":
        return f"{KEY_PREFIX}/{run_id}/v3/ctl/sealed"
    return f"{KEY_PREFIX}/{run_id}"
