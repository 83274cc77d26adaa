"""End to end: real ``torchrun`` agents (torch's unmodified elastic agent) over etcd without v2.

Each scenario starts the agents as ``python -m torch.distributed.run`` in their own
process groups against the module's etcd (v2 API off), runs the gloo worker
script ``scripts/check_ranks.py`` and checks what every worker wrote. Process
groups are killed on teardown, also when a test fails.

Cost: every agent and worker imports torch; a three-agent scenario starts 9
Python processes (~20-40 s on two busy cores).
"""

from __future__ import annotations

import itertools
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.torchrun_agents import TorchrunAgents

from etcd_server import EtcdServer
from etcd_store.client import EtcdClient

SCRIPT = Path(__file__).parent / "scripts" / "check_ranks.py"
NPROC = 2
_ids = itertools.count()

# Short timeouts, but a long last call: with --nnodes=2:3 the round completes as
# soon as the third agent joins, and a slow-starting agent cannot miss it.
V2_CONF = (
    "join_timeout=120,last_call_timeout=60,close_timeout=10,heartbeat_timeout=5,"
    "keep_alive_interval=1,keep_alive_max_attempt=5,read_timeout=10"
)
LEGACY_CONF = "timeout=120,last_call_timeout=60,etcd_prefix=/e2e/legacy,read_timeout=10"


class Agents(TorchrunAgents):
    """torchrun agents running ``scripts/check_ranks.py``; :meth:`kill` ends their process groups."""

    def start(
        self, n: int, *, backend: str, endpoint: str, nnodes: str, conf: str, run_id: str,
        env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.launch(n, [
            f"--nnodes={nnodes}", f"--nproc-per-node={NPROC}",
            f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            f"--rdzv-conf={conf}", "--monitor-interval=0.5", "--max-restarts=0",
            "--local-addr=127.0.0.1", str(SCRIPT), str(self.out_dir),
        ], env=env)  # fmt: skip

    def results(self) -> list[dict[str, Any]]:
        return self.read_results("rank-*.json")


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Agents]:
    a = Agents(tmp_path)
    try:
        yield a
    finally:
        a.kill()


def _run_id(name: str) -> str:
    return f"e2e-{name}-{os.getpid()}-{next(_ids)}"


def _check_workers(agents: Agents, n_agents: int) -> list[dict[str, Any]]:
    results = agents.results()
    world = n_agents * NPROC
    assert len(results) == world, agents.log_tails()
    for r in results:
        assert r["problems"] == [], r
        assert int(r["env"]["WORLD_SIZE"]) == world
        assert r["all_reduce"] == r["expected"] == world * (world + 1) // 2
    assert len({r["pid"] for r in results}) == world
    assert {int(r["env"]["GROUP_RANK"]) for r in results} == set(range(n_agents))
    assert len({(r["env"]["MASTER_ADDR"], r["env"]["MASTER_PORT"]) for r in results}) == 1
    return results


def _only_on(server: EtcdServer, version: str) -> None:
    if not server.version.startswith(version):
        pytest.skip(f"scenario runs on etcd {version} only (the three-agent etcd-v2 one runs on every version)")


def test_etcd_serves_no_v2_api(etcd_server: EtcdServer) -> None:
    url = f"http://{etcd_server.get_endpoint()}/v2/keys/"
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=5)
    assert ei.value.code == 404


@pytest.mark.etcd_matrix("3.6")  # torchrun jobs: 3.7 and 3.6 (3.4/3.5: contract tests)
def test_three_agents_etcd_v2(etcd_server: EtcdServer, agents: Agents) -> None:
    endpoint, run_id = etcd_server.get_endpoint(), _run_id("v2")
    agents.start(3, backend="etcd-v2", endpoint=endpoint, nnodes="2:3", conf=V2_CONF, run_id=run_id)
    codes = agents.wait(timeout=240)
    assert codes == [0, 0, 0], agents.log_tails()
    results = _check_workers(agents, 3)
    assert {r["env"]["TORCHELASTIC_USE_AGENT_STORE"] for r in results} == {"True"}
    with EtcdClient(endpoint, timeout=5) as client:  # the state lives where documented
        assert client.get(f"/torch/elastic/rendezvous/{run_id}".encode()) is not None


@pytest.mark.full_matrix  # the gate: tests/integration/test_registration.py maps the name to the same handler
def test_three_agents_legacy_etcd_name(etcd_server: EtcdServer, agents: Agents) -> None:
    _only_on(etcd_server, "3.7")
    endpoint, run_id = etcd_server.get_endpoint(), _run_id("legacy")
    agents.start(3, backend="etcd", endpoint=endpoint, nnodes="2:3", conf=LEGACY_CONF, run_id=run_id)
    codes = agents.wait(timeout=240)
    assert codes == [0, 0, 0], agents.log_tails()
    _check_workers(agents, 3)
    with EtcdClient(endpoint, timeout=5) as client:  # legacy etcd_prefix was honoured
        assert client.get(f"/e2e/legacy/{run_id}".encode()) is not None


def test_fixed_size_completes_without_last_call_and_without_store_sharing(
    etcd_server: EtcdServer, agents: Agents
) -> None:
    """--nnodes=2 (min = max): the round completes when the second agent joins.

    The last call is 300 s and the agents must finish within 150 s, so a
    rendezvous that waited for the last call fails this test. Agent-store
    sharing is off here (the other scenarios run with it on).
    """
    _only_on(etcd_server, "3.7")
    conf = V2_CONF.replace("last_call_timeout=60", "last_call_timeout=300")
    agents.start(
        2, backend="etcd-v2", endpoint=etcd_server.get_endpoint(), nnodes="2", conf=conf,
        run_id=_run_id("fixed"), env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    )  # fmt: skip
    codes = agents.wait(timeout=150)
    assert codes == [0, 0], agents.log_tails()
    results = _check_workers(agents, 2)
    assert {r["env"]["TORCHELASTIC_USE_AGENT_STORE"] for r in results} == {"False"}
