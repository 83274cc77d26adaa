"""End to end: an agent that fails does not close the run (issue 30), on both backends.

Real ``torchrun`` agents, ``--nnodes=2:3``, one worker each. Agent A's worker exits 3 and
A runs with ``--max-restarts=0``: torch's ``launch_agent`` raises ``ChildFailedError`` and
calls ``rdzv_handler.shutdown()`` in its ``finally``. torch's own handlers close the run
there (pytorch/pytorch#67616, #123678): the healthy agent B runs on alone and a restarted
node gets ``RendezvousClosedError``. Ours only leave: B's agent sees the departure
(``num_nodes_waiting() > 0``) and re-rendezvous, the restarted node C joins it, and the run
closes only when B and C end normally. The workers do no collective after the first round's
init, so B learns of A's departure from the rendezvous alone, never from a gloo error.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.torchrun_agents import TorchrunAgents

from etcd_server import EtcdServer
from etcd_store.client import EtcdClient

pytestmark = pytest.mark.timeout(400)

_ids = itertools.count()

WORKER = r'''
import json, os, sys, time
from datetime import timedelta
import torch.distributed as dist

out_dir, stop_file = sys.argv[1], sys.argv[2]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
dist.barrier()
path = os.path.join(out_dir, f"started-{world}-{rank}-{os.getpid()}.json")
with open(path + ".tmp", "w") as f:
    json.dump({"agent": os.getppid(), "world": world}, f)
os.replace(path + ".tmp", path)
if os.environ.get("FAIL_NODE") == "1":
    sys.exit(3)  # this node's job fails (no restart left: its agent ends with ChildFailedError)
while not os.path.exists(stop_file):
    time.sleep(0.05)
'''

CONF = {
    "etcd-v3": "join_timeout=120,last_call_timeout=2,close_timeout=10,heartbeat=30,read_timeout=10",
    "etcd-v2": ("join_timeout=120,last_call_timeout=2,close_timeout=10,heartbeat_timeout=30,"
                "keep_alive_interval=1,keep_alive_max_attempt=30,read_timeout=10"),
}


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[TorchrunAgents]:
    a = TorchrunAgents(tmp_path)
    try:
        yield a
    finally:
        a.kill()


def _wait_for(agents: TorchrunAgents, what: str, found: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = found()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what}\n{agents.log_tails()}")


@pytest.mark.parametrize("backend", ["etcd-v3", "etcd-v2"])
def test_an_agent_that_fails_leaves_and_a_restarted_node_joins(
    etcd_server: EtcdServer, agents: TorchrunAgents, backend: str
) -> None:
    if not etcd_server.version.startswith("3.7"):
        pytest.skip("runs on etcd 3.7")
    endpoint, run_id = etcd_server.get_endpoint(), f"e2e-failed-{backend}-{os.getpid()}-{next(_ids)}"
    prefix = f"/e2e-failed-{time.monotonic_ns() % 10**9}"
    stop_file = agents.tmp_path / "stop"
    script = agents.tmp_path / "worker.py"
    script.write_text(WORKER)

    def args(max_restarts: int) -> list[str]:
        return [
            "--nnodes=2:3", "--nproc-per-node=1",
            f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            f"--rdzv-conf={CONF[backend]},key_prefix={prefix}", "--monitor-interval=0.5",
            f"--max-restarts={max_restarts}", "--local-addr=127.0.0.1",
            str(script), str(agents.out_dir), str(stop_file),
        ]  # fmt: skip

    try:
        agents.launch(1, args(0), env={"FAIL_NODE": "1"})  # A
        agents.launch(1, args(3))  # B
        a, b = agents.procs
        _wait_for(agents, "A's agent never ended", lambda: a.poll() is not None, 240)
        assert a.returncode != 0, agents.log_tails()
        assert len(agents.read_results("started-2-*.json")) == 2, agents.log_tails()
        time.sleep(3.0)  # B's agent polls num_nodes_waiting() every 0.5 s
        assert b.poll() is None, agents.log_tails()
        with EtcdClient(endpoint, timeout=5) as client:
            if backend == "etcd-v3":
                assert client.get(f"{prefix}/{run_id}/v3/ctl/closed".encode()) is None, agents.log_tails()

        first = {p.name for p in agents.out_dir.glob("started-*.json")}
        agents.launch(1, args(3))  # C: A's node restarted (a pod restart), healthy this time
        c = agents.procs[2]

        def second_round() -> list[dict[str, Any]]:
            found = [json.loads(p.read_text()) for p in agents.out_dir.glob("started-2-*.json")
                     if p.name not in first]
            return found if len(found) == 2 else []

        second = _wait_for(agents, "B and C never formed a round", second_round, 180)
        assert {r["agent"] for r in second} == {b.pid, c.pid}
        stop_file.write_text("stop")
        codes = agents.wait(timeout=120)
        assert codes[1:] == [0, 0], agents.log_tails()
        if backend == "etcd-v3":  # a normal end closes the run
            with EtcdClient(endpoint, timeout=5) as client:
                assert client.get(f"{prefix}/{run_id}/v3/ctl/closed".encode()) is not None
    finally:
        stop_file.write_text("stop")
