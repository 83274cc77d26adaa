"""End to end: real ``torchrun`` agents with ``--rdzv-backend=etcd-v3``.

The agents run as ``python -m torch.distributed.run`` (torch's unmodified elastic
agent, which finds the backend through the ``torchrun.handlers`` entry point),
each in its own process group, killed at teardown also when a test fails. The
gloo worker script (written next to the test's files) checks ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and ``GROUP_RANK`` against an all-gather, checks an
``all_reduce`` and writes one JSON file per worker and world size.

Cost: each agent and worker imports torch (three agents = nine processes,
~20-40 s on two busy cores).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO_ROOT
from helpers.elastic import log_line_times, record_timing
from helpers.torchrun_agents import TorchrunAgents

from etcd_rdzv.conf_keys import DEFAULT_LEASE_TTL
from etcd_server import EtcdServer
from etcd_store.client import EtcdClient

pytestmark = pytest.mark.timeout(400)

NPROC = 2
_ids = itertools.count()

WORKER = r'''
import json, os, signal, sys
from datetime import timedelta
import torch
import torch.distributed as dist

out_dir, kill_on_first = sys.argv[1], sys.argv[2] == "1"
agent = os.getppid()  # read now: a sibling may kill the agent before this worker writes (then it is 1)
env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
       "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
       "TORCHELASTIC_USE_AGENT_STORE")}
rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
local_rank, local_world = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
group_rank = int(env["GROUP_RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
problems = []
if (dist.get_rank(), dist.get_world_size()) != (rank, world):
    problems.append("process group rank/size differ from RANK/WORLD_SIZE")
if rank != group_rank * local_world + local_rank:
    problems.append("RANK != GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK")
mine = torch.tensor([rank, local_rank, group_rank], dtype=torch.int64)
rows = [torch.zeros_like(mine) for _ in range(world)]
dist.all_gather(rows, mine)
rows = [[int(v) for v in t.tolist()] for t in rows]
if sorted(r[0] for r in rows) != list(range(world)):
    problems.append(f"ranks are not 0..{world - 1}")
if sorted(r[1] for r in rows) != sorted(list(range(local_world)) * (world // local_world)):
    problems.append("local ranks are not 0..LOCAL_WORLD_SIZE-1 on every node")
total = torch.tensor([rank + 1], dtype=torch.int64)
dist.all_reduce(total)
expected = world * (world + 1) // 2
if int(total.item()) != expected:
    problems.append(f"all_reduce gave {int(total.item())}, expected {expected}")
path = os.path.join(out_dir, f"world-{world}-rank-{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump({"env": env, "pid": os.getpid(), "agent": agent, "all_reduce": int(total.item()),
               "expected": expected, "problems": problems}, f)
os.replace(path + ".tmp", path)
if kill_on_first and world == 3 * local_world and group_rank == 0:
    # The node hosting rank 0 (and MASTER_ADDR/MASTER_PORT) dies: agent and workers.
    if local_rank == 0:
        os.kill(os.getppid(), signal.SIGKILL)
    os._exit(0)
dist.barrier()
dist.destroy_process_group()
sys.exit(1 if problems else 0)
'''

CONF = "join_timeout=120,last_call_timeout=60,close_timeout=10,heartbeat=3,read_timeout=10"


class Agents(TorchrunAgents):
    """torchrun agents (etcd-v3, ``--nnodes=2:3``) running :data:`WORKER`."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        self.script = tmp_path / "worker.py"
        self.script.write_text(WORKER)

    def start(
        self, n: int, *, endpoint: str, run_id: str, conf: str, key_prefix: str,
        max_restarts: int = 0, kill_rank0_host: bool = False,
    ) -> None:  # fmt: skip
        self.launch(n, [
            "--nnodes=2:3", f"--nproc-per-node={NPROC}",
            "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            f"--rdzv-conf={conf},key_prefix={key_prefix}", "--monitor-interval=0.5",
            f"--max-restarts={max_restarts}", "--local-addr=127.0.0.1",
            str(self.script), str(self.out_dir), "1" if kill_rank0_host else "0",
        ])  # fmt: skip

    def results(self, world: int) -> list[dict[str, Any]]:
        return self.read_results(f"world-{world}-rank-*.json")


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Agents]:
    a = Agents(tmp_path)
    try:
        yield a
    finally:
        a.kill()


def _completed_after(log: str, after: float, default: float) -> float:
    """When the agent whose log is ``log`` first logged torchrun's "Rendezvous complete" line after
    ``after`` (epoch seconds); ``default`` if it did not."""
    return min((t for t in log_line_times(log, "Rendezvous complete for workers") if t > after), default=default)


def _check_group(results: list[dict[str, Any]], nodes: int, log: str) -> None:
    world = nodes * NPROC
    assert len(results) == world, log
    for r in results:
        assert r["problems"] == [], r
        assert int(r["env"]["WORLD_SIZE"]) == world
        assert r["all_reduce"] == r["expected"] == world * (world + 1) // 2
        assert r["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert len({r["pid"] for r in results}) == world
    assert {int(r["env"]["GROUP_RANK"]) for r in results} == set(range(nodes))
    assert len({(r["env"]["MASTER_ADDR"], r["env"]["MASTER_PORT"]) for r in results}) == 1


@pytest.mark.etcd_matrix("3.6")  # torchrun jobs: 3.7 and 3.6 (3.4/3.5: contract tests)
@pytest.mark.full_matrix("3.6")  # the gate runs etcd-v2's three agents on 3.6 (test_torchrun_e2e.py)
def test_three_agents_etcd_v3(etcd_server: EtcdServer, agents: Agents) -> None:
    endpoint, run_id = etcd_server.get_endpoint(), f"e2e-v3-{os.getpid()}-{next(_ids)}"
    prefix = f"/e2e-v3-{time.monotonic_ns() % 10**9}"
    agents.start(3, endpoint=endpoint, run_id=run_id, conf=CONF, key_prefix=prefix)
    codes = agents.wait(timeout=300)
    assert codes == [0, 0, 0], agents.log_tails()
    _check_group(agents.results(3 * NPROC), 3, agents.log_tails())
    with EtcdClient(endpoint, timeout=5) as client:
        root = f"{prefix}/{run_id}/v3".encode()
        assert client.get(root + b"/ctl/closed") is not None  # shutdown closed the run
        assert client.range(root + b"/join/", prefix=True, count_only=True).count == 0
        # the last node out removed the counters and older rounds; the last sealed round's records (its
        # store, members, acks) stay on the run lease, which ends a TTL after the last node stopped
        sealed = client.get(root + b"/ctl/sealed")
        assert sealed is not None
        last = root + b"/rounds/%010d/" % json.loads(sealed.value)["round"]
        left = client.range(root + b"/rounds/", prefix=True).kvs
        assert all(kv.key.startswith(last) and kv.lease == sealed.lease for kv in left), [kv.key for kv in left]
        assert client.range(root + b"/seq/", prefix=True, count_only=True).count == 0


def test_rank0_host_dies_and_the_others_re_rendezvous(etcd_server: EtcdServer, agents: Agents) -> None:
    """The agent hosting rank 0 is SIGKILLed after the first round; the other two
    re-rendezvous (after its lease TTL + the last call: their agents learn of the
    loss from num_nodes_waiting, or from their workers failing, whichever comes
    first) and bootstrap from a new host."""
    if not etcd_server.version.startswith("3.7"):
        pytest.skip("node-loss scenario runs on etcd 3.7 only (the three-agent one runs on every version)")
    endpoint, run_id = etcd_server.get_endpoint(), f"e2e-v3-loss-{os.getpid()}-{next(_ids)}"
    prefix = f"/e2e-v3-{time.monotonic_ns() % 10**9}"
    conf = CONF.replace("last_call_timeout=60", "last_call_timeout=15")
    agents.start(3, endpoint=endpoint, run_id=run_id, conf=conf, key_prefix=prefix,
                 max_restarts=1, kill_rank0_host=True)  # fmt: skip
    codes = agents.wait(timeout=300)
    first = agents.results(3 * NPROC)
    _check_group(first, 3, agents.log_tails())
    assert sorted(codes, key=lambda c: -1 if c is None else c) == [-signal.SIGKILL, 0, 0], agents.log_tails()
    second = agents.results(2 * NPROC)
    _check_group(second, 2, agents.log_tails())
    # Round 2 runs on the two surviving agents, its MASTER_ADDR/MASTER_PORT published anew
    # by its own rank 0 (the host of round 1's master is dead).
    dead_agent = {r["agent"] for r in first if int(r["env"]["GROUP_RANK"]) == 0}
    assert len(dead_agent) == 1
    assert not dead_agent & {r["agent"] for r in second}
    assert {r["agent"] for r in second} == {r["agent"] for r in first} - dead_agent
    assert first[0]["env"]["MASTER_PORT"] != second[0]["env"]["MASTER_PORT"]


TRAINER = r'''
import json, os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist

out_dir, stop_file = sys.argv[1], sys.argv[2]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
step = 0
while True:
    # one training step: needs every rank of the group; the ranks also agree on when to stop (a rank
    # that stopped alone would leave the others' all_reduce to fail)
    t = torch.tensor([1, int(os.path.exists(stop_file))], dtype=torch.int64)
    dist.all_reduce(t)
    step += 1
    if step == 1:
        path = os.path.join(out_dir, f"first-{world}-{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"t": time.time(), "agent": os.getppid(), "sum": int(t[0].item())}, f)
        os.replace(path + ".tmp", path)
    if int(t[1].item()) > 0:
        break
    time.sleep(0.05)
dist.destroy_process_group()
'''


def _first_steps(agents: Agents, world: int, want: int, timeout: float) -> list[dict[str, Any]]:
    """The first-step records of a group of ``world`` workers, once ``want`` exist (deadline)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = agents.read_results(f"first-{world}-*.json")
        if len(found) >= want:
            return found
        if all(p.poll() is not None for p in agents.procs):
            break
        time.sleep(0.1)
    raise AssertionError(f"no group of {world} workers trained\n{agents.log_tails()}")


@pytest.mark.parametrize(
    "how",
    # SIGKILL of a whole etcd-v3 node: the gate runs it in test_elastic_faults.py (scale-down)
    ["sigterm", pytest.param("sigkill", marks=pytest.mark.full_matrix)],
)
def test_a_node_that_ends_leaves_and_the_others_train_again(
    etcd_server: EtcdServer, agents: Agents, how: str
) -> None:
    """One of three agents ends: SIGTERM (torchrun skips shutdown(), the handler
    leaves at exit: its lease is revoked at once) or SIGKILL of its whole process
    group (nothing revoked: a survivor evicts it, native/leases.py). The other two
    re-form a group and train again; the figure is recorded (tests/elastic.py
    ``record_timing``). heartbeat is 30 s for SIGTERM (so only the leave can explain
    a fast recovery); SIGKILL runs with the default settings (heartbeat 15 s, last
    call 30 s), so a re-formed group well before 15 s can only come from an eviction."""
    if not etcd_server.version.startswith("3.7"):
        pytest.skip("runs on etcd 3.7")
    heartbeat = 30 if how == "sigterm" else DEFAULT_LEASE_TTL
    endpoint, run_id = etcd_server.get_endpoint(), f"e2e-v3-{how}-{os.getpid()}-{next(_ids)}"
    prefix = f"/e2e-v3-{time.monotonic_ns() % 10**9}"
    stop_file = agents.tmp_path / "stop"
    agents.script.write_text(TRAINER)
    if how == "sigterm":
        conf = CONF.replace("heartbeat=3", f"heartbeat={heartbeat}").replace("last_call_timeout=60", "last_call_timeout=2")
    else:  # the defaults of every setting that bears on recovery
        conf = "join_timeout=120,close_timeout=10,read_timeout=10"
    agents.launch(3, [
        "--nnodes=2:3", f"--nproc-per-node={NPROC}",
        "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
        f"--rdzv-conf={conf},key_prefix={prefix}", "--monitor-interval=0.5",
        "--max-restarts=3", "--local-addr=127.0.0.1",
        str(agents.script), str(agents.out_dir), str(stop_file),
    ])  # fmt: skip
    try:
        full = _first_steps(agents, 3 * NPROC, 3 * NPROC, timeout=240)
        assert {r["sum"] for r in full} == {3 * NPROC}
        victim = agents.procs[2]
        ended_at = time.time()
        if how == "sigterm":
            victim.send_signal(signal.SIGTERM)  # the agent alone, as Kubernetes does
        else:
            ended_at = agents.agents[2].kill()  # the whole node: its agent and its workers (own sessions)
        again = _first_steps(agents, 2 * NPROC, 2 * NPROC, timeout=120)
        assert {r["sum"] for r in again} == {2 * NPROC}
        assert victim.pid not in {r["agent"] for r in again}  # (the agent is the worker's parent)
        recovery = max(r["t"] for r in again) - ended_at
        # The survivors' agents log "Rendezvous complete" (torchrun's INFO log) when their
        # new round is sealed: what is left of the figure is worker start-up.
        completes = [_completed_after(log.read_text(errors="replace"), ended_at, float("nan"))
                     for log in agents.logs[:2]]
        rendezvous = max(completes) - ended_at
        # The first survivor's agent decides to restart (its workers failed, or num_nodes_waiting() > 0):
        # what comes before is worker failure detection (gloo, the worker's exit, the monitor interval).
        noticed = min((t for log in agents.logs[:2] for t in log_line_times(
            log.read_text(errors="replace"), "will restart worker group") if t > ended_at), default=float("nan"))
        record_timing(f"v3_node_ends/{how}/etcd{etcd_server.version}", {
            "end_to_first_step_s": round(recovery, 2), "heartbeat_s": heartbeat,
            "end_to_rendezvous_complete_s": round(rendezvous, 2),
            "end_to_restart_decided_s": round(noticed - ended_at, 2),
            "rendezvous_complete_to_first_step_s": round(recovery - rendezvous, 2),
            "setup": "3 torchrun agents x 2 workers, --nnodes=2:3, monitor 0.5 s, "
                     + ("last_call 2 s" if how == "sigterm" else "default rdzv settings"),
        })  # fmt: skip
        print(f"[recovery] {how}: restart decided {noticed - ended_at:.2f} s, rendezvous complete "
              f"{rendezvous:.2f} s, first step {recovery:.2f} s after the end (heartbeat {heartbeat} s)")
        # The protocol's part, not worker start-up (seconds of CPU per worker, which parallel test lanes
        # stretch): a leave re-forms well inside the 30 s TTL; after a kill a survivor evicted the dead
        # node (its lease was still alive: it renewed up to a second before the kill) rather than
        # waiting for the lease. The figures themselves are benchmark output (python -m benchmarks.recovery).
        assert rendezvous < (15 if how == "sigterm" else heartbeat + 10), agents.log_tails()
        if how == "sigkill":
            evictions = [line for log in agents.logs[:2] for line in log.read_text(errors="replace").splitlines()
                         if ": evicted " in line]
            assert len(evictions) == 1, agents.log_tails()
        stop_file.write_text("stop")
        codes = agents.wait(timeout=120)
        assert codes[:2] == [0, 0], agents.log_tails()
        assert codes[2] != 0
        with EtcdClient(endpoint, timeout=5) as client:
            root = f"{prefix}/{run_id}/v3".encode()
            assert client.get(root + b"/ctl/closed") is not None  # the survivors' shutdown closed it
    finally:
        stop_file.write_text("stop")


SLOW_END = r'''
import os, sys, time
from datetime import timedelta
import torch.distributed as dist

out_dir, stop_file = sys.argv[1], sys.argv[2]
group_rank, restarts = os.environ["GROUP_RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
dist.barrier()
dist.destroy_process_group()
open(os.path.join(out_dir, f"started-{group_rank}-{restarts}-{os.getpid()}"), "w").close()
if group_rank == "0":  # the slow node: a final checkpoint longer than the others' exit barrier
    while not os.path.exists(stop_file):
        time.sleep(0.05)
    open(os.path.join(out_dir, "slow-done"), "w").close()
'''

SHORT_EXIT_BARRIER = r'''
import sys
from torch.distributed.elastic.agent.server import local_elastic_agent

_init = local_elastic_agent.LocalElasticAgent.__init__


def _init_short_barrier(self, *args, **kwargs):
    kwargs["exit_barrier_timeout"] = 1.0  # torch's default is 300 s: the slow node outlives it
    _init(self, *args, **kwargs)


local_elastic_agent.LocalElasticAgent.__init__ = _init_short_barrier
from torch.distributed.run import main

sys.exit(main())
'''


def test_a_normal_end_leaves_a_slow_node_running_and_the_operators_close_stops_it(
    etcd_server: EtcdServer, agents: Agents
) -> None:
    """Two agents: the fast node's job ends (its workers succeed, its exit barrier of 1 s
    times out, torchrun calls shutdown(), which closes the run); the slow node's workers
    run on, not restarted (num_nodes_waiting() is 0 for a closed run, as with torch's
    handlers). Then ``etcd-rdzv close`` stops the slow node's agent and its workers at once."""
    if not etcd_server.version.startswith(("3.5", "3.7")):
        pytest.skip("runs on etcd 3.5 and 3.7")
    from etcd_rdzv.cli import main

    endpoint, run_id = etcd_server.get_endpoint(), f"e2e-v3-end-{os.getpid()}-{next(_ids)}"
    prefix = f"/e2e-v3-{time.monotonic_ns() % 10**9}"
    stop_file = agents.tmp_path / "stop"
    agents.script.write_text(SLOW_END)
    runner = agents.tmp_path / "torchrun_short_exit_barrier.py"
    runner.write_text(SHORT_EXIT_BARRIER)
    # No node dies here, so the default lease: with CONF's 3 s one, starved keep-alives (four heavy e2e
    # files side by side on two cores) once let the fast node's lease lapse during its exit barrier, the
    # slow node saw a member gone, restarted and met the closed run: a death, not this scenario.
    conf = CONF.replace("last_call_timeout=60", "last_call_timeout=2").replace(
        "heartbeat=3", f"heartbeat={DEFAULT_LEASE_TTL}")
    agents.launch(2, [
        "--nnodes=2", "--nproc-per-node=1",
        "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
        f"--rdzv-conf={conf},key_prefix={prefix}", "--monitor-interval=0.2",
        "--max-restarts=3", "--local-addr=127.0.0.1",
        str(agents.script), str(agents.out_dir), str(stop_file),
    ], runner=[str(runner)], env={"PYTHONPATH": REPO_ROOT})  # fmt: skip (the runner's directory is no checkout)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not any(p.poll() is not None for p in agents.procs):
            time.sleep(0.1)
        ended = [p for p in agents.procs if p.poll() is not None]
        assert len(ended) == 1 and ended[0].returncode == 0, agents.log_tails()
        (slow,) = [p for p in agents.procs if p.poll() is None]
        with EtcdClient(endpoint, timeout=5) as client:
            assert client.get(f"{prefix}/{run_id}/v3/ctl/closed".encode()) is not None  # the fast one closed it
        time.sleep(3.0)  # 15 monitor intervals of the slow agent, each a num_nodes_waiting() poll
        assert slow.poll() is None, agents.log_tails()
        started = sorted(p.name.rsplit("-", 1)[0] for p in agents.out_dir.glob("started-*"))
        assert started == ["started-0-0", "started-1-0"], (started, agents.log_tails())  # no restart
        assert not (agents.out_dir / "slow-done").exists()

        stopped_at = time.monotonic()
        assert main(["--endpoints", endpoint, "--key-prefix", prefix, "close", run_id]) == 0
        slow.wait(timeout=60)
        assert time.monotonic() - stopped_at < 30, agents.log_tails()
        assert slow.returncode != 0  # its next_rendezvous raised RendezvousClosedError
        assert not (agents.out_dir / "slow-done").exists()  # its worker was stopped, not finished
        assert "closed" in agents.logs[agents.procs.index(slow)].read_text(errors="replace").lower()
    finally:
        stop_file.write_text("stop")


DIE_BEFORE_ACK = r'''
import os, signal, sys, time
from etcd_rdzv.native import start


def _die(*args, **kwargs):
    # Named in a seal, the node dies instead of confirming the round (no worker runs yet).
    with open(os.environ["DIED_AT_FILE"], "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


start.acknowledge = _die
from torch.distributed.run import main

sys.exit(main())
'''


def test_a_dead_joiner_named_in_a_seal_does_not_end_the_job(etcd_server: EtcdServer, agents: Agents) -> None:
    """Issue 30 item 2b through torch's agent: two live agents and a third node start together
    (``--nnodes=2:3``); the seal names all three and the third is SIGKILLed (its agent, before any
    worker) instead of confirming the round. Before the start barrier the live agents were handed a
    round of 3, waited in torch's rank barrier (_assign_worker_ranks) for the dead one until the
    store's timeout and failed. Now the round is voided once the dead member's key goes (its 30 s
    lease), the two complete a rendezvous of 2 within the lease TTL and a few seconds of the death and
    train as a group of 2 (the issue's target, the death to their result within the TTL + 20 s, is
    benchmark output); the run stays open until their normal end.

    The node places its own death (a wrapper of the ack), not the test after a poll: whatever the
    order of the joins, it is named. A kill right after its join was either too early (start-up under
    CI's parallel lanes took ~28 s: the key was evicted or expired before the live ones joined) or,
    when its join was the third, too late for the round's due seal (only the joiner that reaches
    ``max_nodes`` knows it, and the others wait for the last call)."""
    if not etcd_server.version.startswith("3.7"):
        pytest.skip("runs on etcd 3.7")
    ttl = 30
    endpoint, run_id = etcd_server.get_endpoint(), f"e2e-v3-deadjoin-{os.getpid()}-{next(_ids)}"
    prefix = f"/e2e-v3-{time.monotonic_ns() % 10**9}"
    conf = f"join_timeout=120,last_call_timeout=60,close_timeout=10,heartbeat={ttl},read_timeout=10"
    args = ["--nnodes=2:3", f"--nproc-per-node={NPROC}", "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}", "--monitor-interval=0.5", "--max-restarts=0", "--local-addr=127.0.0.1"]
    script = [str(agents.script), str(agents.out_dir), "0"]
    runner = agents.tmp_path / "torchrun_die_before_ack.py"
    runner.write_text(DIE_BEFORE_ACK)
    died_file = agents.tmp_path / "died-at"
    # Joined, the live ones wait in the last call (60 s) for a third: the round is due once it joins.
    agents.launch(2, [*args, f"--rdzv-conf={conf},key_prefix={prefix}", *script])
    agents.launch(1, [*args, f"--rdzv-conf={conf},key_prefix={prefix}", *script],
                  runner=[str(runner)], env={"PYTHONPATH": REPO_ROOT, "DIED_AT_FILE": str(died_file)})
    codes = agents.wait(timeout=ttl + 180)
    assert codes == [0, 0, -signal.SIGKILL], agents.log_tails()
    died_at = float(died_file.read_text())
    took = max(os.path.getmtime(p) for p in agents.out_dir.glob("world-*-rank-*.json")) - died_at
    with EtcdClient(endpoint, timeout=10) as client:
        closed = client.get(f"{prefix}/{run_id}/v3/ctl/closed".encode())
    _check_group(agents.results(2 * NPROC), 2, agents.log_tails())
    assert agents.results(3 * NPROC) == []
    assert closed is not None  # by the normal end of the two, not by a failure
    logs = [log.read_text(errors="replace") for log in agents.logs[:2]]
    # The scenario happened: the first seal named the dead node (3 members), and a live member voided it.
    assert any("round 1 of 3 members is void" in log for log in logs), agents.log_tails()
    # The protocol's part: both live agents' "Rendezvous complete" (torchrun's INFO line, once their group of
    # 2 is sealed and started) within the dead joiner's lease TTL and a few seconds of its death. What
    # follows is worker start-up (seconds of CPU per worker, which parallel test lanes stretch: 29 s once
    # in CI), a figure for the benchmark (python -m benchmarks.recovery), not for an assertion.
    rendezvous = max(_completed_after(log, died_at, float("inf")) for log in logs) - died_at
    assert rendezvous < ttl + 10, agents.log_tails()
    record_timing("dead-joiner/etcd-v3", {
        "death_to_rendezvous_complete_s": round(rendezvous, 2), "death_to_group_of_2_result_s": round(took, 2),
        "lease_ttl_s": ttl,
    })  # fmt: skip
