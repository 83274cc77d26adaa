"""torch rendezvous events and elastic metrics of both backends, against real etcd.

Events are collected the way torch delivers them: a logging handler registered
as torch's ``dynamic_rendezvous`` event destination (the destination
``construct_and_record_rdzv_event`` writes to). Metrics are collected by a
``MetricHandler`` configured with ``torch.distributed.elastic.metrics.configure``
for the ``etcd_rdzv`` group. Nodes run in threads of this process.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.nodes import ETCD_V3, Nodes
from helpers.ports import closed_port
from torch.distributed.elastic import events as torch_events
from torch.distributed.elastic import metrics as torch_metrics
from torch.distributed.elastic.events import NodeState, RdzvEvent
from torch.distributed.elastic.events import handlers as event_handlers
from torch.distributed.elastic.metrics import api as metrics_api
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from etcd_rdzv import metrics
from etcd_server import AuthConfig, EtcdServer
from etcd_store.client import EtcdClient
from etcd_store.errors import EtcdLeaseNotFound

pytestmark = pytest.mark.timeout(120)

_ids = itertools.count()
WAIT = 30.0
V3_CONF = {"join_timeout": "30", "last_call_timeout": "0.5", "close_timeout": "5",
           "heartbeat": "3", "read_timeout": "10"}
V2_CONF = {"join_timeout": "30", "last_call_timeout": "1", "close_timeout": "5",
           "heartbeat_timeout": "5", "keep_alive_interval": "1", "keep_alive_max_attempt": "4",
           "read_timeout": "5"}


class _Events(logging.Handler):
    """torch's ``dynamic_rendezvous`` event destination for the test: keeps every event."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[RdzvEvent] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        event = RdzvEvent.deserialize(record.getMessage())
        with self._lock:
            self.events.append(event)

    def of(self, host_node: str, method: str, state: NodeState | None = None) -> list[RdzvEvent]:
        """Events of one node (its id is in the message) for ``EtcdV3RendezvousHandler.<method>``."""
        with self._lock:
            return [e for e in self.events if e.name.endswith(f"EtcdV3RendezvousHandler.{method}")
                    and f"'{host_node}'" in e.message and (state is None or e.node_state == state)]


class _Metrics(torch_metrics.MetricHandler):
    def __init__(self) -> None:
        self.data: list[torch_metrics.MetricData] = []
        self._lock = threading.Lock()

    def emit(self, metric_data: torch_metrics.MetricData) -> None:
        with self._lock:
            self.data.append(metric_data)

    def values(self, name: str) -> list[int]:
        with self._lock:
            return [d.value for d in self.data if d.name == name and d.group_name == metrics.GROUP]


@pytest.fixture
def rdzv_events() -> Iterator[_Events]:
    """Register a collecting handler as torch's ``dynamic_rendezvous`` event destination."""
    collector = _Events()
    previous = event_handlers._log_handlers["dynamic_rendezvous"]
    event_handlers._log_handlers["dynamic_rendezvous"] = collector
    logger = torch_events._get_or_create_logger("dynamic_rendezvous")
    logger.addHandler(collector)  # a no-op if torch just created the logger with it
    try:
        yield collector
    finally:
        logger.removeHandler(collector)
        event_handlers._log_handlers["dynamic_rendezvous"] = previous


@pytest.fixture
def recorded_metrics() -> Iterator[_Metrics]:
    handler = _Metrics()
    previous = metrics_api._metrics_map.get(metrics.GROUP)
    torch_metrics.configure(handler, group=metrics.GROUP)
    try:
        yield handler
    finally:
        if previous is None:
            metrics_api._metrics_map.pop(metrics.GROUP, None)
        else:
            torch_metrics.configure(previous, group=metrics.GROUP)


def v3_nodes(endpoint: str) -> Nodes:
    """etcd-v3 handlers of one run, each with its own client, run in threads."""
    return Nodes(endpoint, ETCD_V3, conf=V3_CONF, name="events-run")


@pytest.fixture
def v3run(etcd_endpoint: str) -> Iterator[Nodes]:
    run = v3_nodes(etcd_endpoint)
    try:
        yield run
    finally:
        run.close()


def test_v3_two_nodes_record_join_complete_departure_close(
    v3run: Nodes, rdzv_events: _Events, recorded_metrics: _Metrics
) -> None:
    a, b = v3run.new(2, 2), v3run.new(2, 2)
    infos = [f.result(WAIT) for f in [v3run.pool.submit(h.next_rendezvous) for h in (a, b)]]
    assert sorted(i.rank for i in infos) == [0, 1]
    for h, info in zip((a, b), infos, strict=True):
        started = rdzv_events.of(h.node_id, "next_rendezvous", NodeState.RUNNING)
        assert "attempts to join" in started[0].message
        done = [e for e in started if e.rank is not None]
        assert len(done) == 1 and done[0].rank == info.rank, done
        assert "round 1" in done[0].message and "world of size 2" in done[0].message
        assert done[0].master_endpoint.startswith("127.0.0.1:")
        assert done[0].run_id == v3run.run_id and done[0].hostname == "127.0.0.1"
        joins = rdzv_events.of(h.node_id, "join")
        assert [("round 1" in e.message) for e in joins] == [True]
    assert recorded_metrics.values("etcd-v3.rendezvous.joins") == [1, 1]
    assert recorded_metrics.values("etcd-v3.rendezvous.completed") == [1, 1]
    assert recorded_metrics.values("etcd-v3.rendezvous.world_size") == [2, 2]
    durations = recorded_metrics.values("etcd-v3.rendezvous.duration.ms")
    assert len(durations) == 2 and all(0 <= d < WAIT * 1000 for d in durations)

    # b leaves for good (as at interpreter exit): a departure for both of them.
    assert b.leave()
    assert [e.node_state for e in rdzv_events.of(b.node_id, "leave")] == [NodeState.SUCCEEDED]
    assert a.num_nodes_waiting() >= 1
    assert a.num_nodes_waiting() >= 1  # reported once per round
    lost = rdzv_events.of(a.node_id, "num_nodes_waiting")
    assert len(lost) == 1 and "1 of 2 members of round 1" in lost[0].message
    assert recorded_metrics.values("etcd-v3.members.lost") == [1]

    # a closes the run: a close event; a later next_rendezvous records its failure.
    assert a.shutdown()
    closed = rdzv_events.of(a.node_id, "set_closed")
    assert [e.node_state for e in closed] == [NodeState.SUCCEEDED]
    c = v3run.new(2, 2)
    with pytest.raises(RendezvousClosedError):
        c.next_rendezvous()
    failed = rdzv_events.of(c.node_id, "next_rendezvous", NodeState.FAILED)
    assert len(failed) == 1 and failed[0].message.startswith("RendezvousClosedError")
    assert "RendezvousClosedError" in failed[0].error_trace
    assert recorded_metrics.values("etcd-v3.rendezvous.failures") == [1]


def test_v3_timeout_and_lost_lease_are_recorded(
    v3run: Nodes, rdzv_events: _Events, recorded_metrics: _Metrics, etcd_endpoint: str
) -> None:
    lonely = v3run.new(2, 2, join_timeout="1")
    with pytest.raises(RendezvousTimeoutError):
        lonely.next_round()
    failed = rdzv_events.of(lonely.node_id, "next_rendezvous", NodeState.FAILED)
    assert len(failed) == 1 and failed[0].message.startswith("RendezvousTimeoutError")
    assert recorded_metrics.values("etcd-v3.rendezvous.timeouts") == [1]

    solo = v3run.new(1, 1)
    solo.next_round()
    session = solo._node.session
    assert session is not None
    with EtcdClient(etcd_endpoint, timeout=10) as other:
        other.lease_revoke(session.id)  # the node's lease is gone, as after an expiry
    assert session.lost.wait(WAIT)
    # Its round still runs (nothing sealed since): it re-attaches with a new lease.
    assert solo.num_nodes_waiting() == 0
    assert solo._node.session is not None and solo._node.session is not session
    assert len(rdzv_events.of(solo.node_id, "lease")) == 1
    assert recorded_metrics.values("etcd-v3.lease.lost") == [1]


def test_client_retries_and_errors_reach_the_metrics(etcd_endpoint: str, recorded_metrics: _Metrics) -> None:
    # The first endpoint refuses connections: every call that starts there is retried on the next.
    with EtcdClient([f"127.0.0.1:{closed_port()}", etcd_endpoint], timeout=10) as client:
        metrics.watch_client(client.stats)
        metrics.watch_client(client.stats)  # idempotent: each retry counts once
        client.put(b"/events/retry", b"1")
        retries = client.stats.snapshot().retries
        assert retries >= 1
        assert sum(recorded_metrics.values("etcd_client.retries")) == retries
        with pytest.raises(EtcdLeaseNotFound):
            client.put(b"/events/no-lease", b"1", lease=0x7E57)  # etcd: requested lease not found
        assert client.stats.snapshot().errors == {"EtcdLeaseNotFound": 1}
        assert recorded_metrics.values("etcd_client.errors.EtcdLeaseNotFound") == [1]


def test_the_client_layer_does_not_import_torch() -> None:
    code = "import sys, etcd_store.client; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_v2_reports_metrics_and_torch_records_its_events(
    etcd_endpoint: str, rdzv_events: _Events, recorded_metrics: _Metrics
) -> None:
    run_id = f"events-v2-{next(_ids)}"
    params = RendezvousParameters(backend="etcd-v2", endpoint=etcd_endpoint, run_id=run_id, min_nodes=2,
                                  max_nodes=2, local_addr="127.0.0.1", **V2_CONF)
    handlers = [get_rendezvous_handler(params) for _ in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            infos = [f.result(WAIT) for f in [pool.submit(h.next_rendezvous) for h in handlers]]
        assert sorted(i.rank for i in infos) == [0, 1]
    finally:
        for h in handlers:
            h.shutdown()
    assert recorded_metrics.values("etcd-v2.rendezvous.joins") == [1, 1]
    assert recorded_metrics.values("etcd-v2.rendezvous.completed") == [1, 1]
    assert recorded_metrics.values("etcd-v2.rendezvous.world_size") == [2, 2]
    ranks = sorted(e.rank for e in rdzv_events.events
                   if e.run_id == run_id and e.rank is not None and "has joined round" in e.message)
    assert ranks == [0, 1]


_PROMETHEUS_AGENT = """
import sys, urllib.request
from torch.distributed.elastic.rendezvous import RendezvousParameters
from etcd_rdzv.plugin import create_etcd_v3_rdzv_handler
from etcd_server import AuthConfig, EtcdServer
endpoint, port, prefix = sys.argv[1:]
params = RendezvousParameters(
    backend="etcd-v3", endpoint=endpoint, run_id="prom", min_nodes=1, max_nodes=1, local_addr="127.0.0.1",
    key_prefix=prefix, metrics_port=port, metrics_addr="127.0.0.1", last_call_timeout="0.5", join_timeout="30")
handler = create_etcd_v3_rdzv_handler(params)
handler.next_round()
handler.shutdown()
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
print(opener.open(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
"""


def test_prometheus_endpoint_serves_the_rendezvous_metrics(etcd_endpoint: str) -> None:
    pytest.importorskip("prometheus_client", reason="prometheus_client is not installed "
                        "(pip install 'etcd-rdzv[prometheus]'): no endpoint to test")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop("ETCD_RDZV_METRICS_PORT", None)
    port = closed_port()
    out = subprocess.run(
        [sys.executable, "-c", _PROMETHEUS_AGENT, etcd_endpoint, str(port), f"/prom{next(_ids)}"],
        env=env, capture_output=True, text=True, timeout=90,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert 'etcd_rdzv_rendezvous_joins_total{backend="etcd-v3"} 1.0' in out.stdout
    assert 'etcd_rdzv_rendezvous_completed_total{backend="etcd-v3"} 1.0' in out.stdout
    assert 'etcd_rdzv_rendezvous_world_size{backend="etcd-v3"} 1.0' in out.stdout


def test_no_secret_in_logs_events_or_metrics(
    etcd_binary: str, tmp_path: Path, rdzv_events: _Events, recorded_metrics: _Metrics,
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret, wrong = "s3cr3t-Pw-1", "wr0ng-Pw-2"
    auth = AuthConfig("r00t-Pw-3", user="alice", password=secret, prefix=b"/jobs/alice/")
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text(secret + "\n")
    bad.write_text(wrong + "\n")
    caplog.set_level(logging.DEBUG)
    with EtcdServer(binary=etcd_binary, auth=auth) as server:
        run = v3_nodes(server.get_endpoint())
        run.prefix = "/jobs/alice/rdzv"
        try:
            # A local etcd without TLS: the password goes in plain text only with the opt-in.
            ok = run.new(1, 1, user="alice", password_file=str(good), allow_insecure_auth="1")
            assert ok.next_round().round == 1
            refused = run.new(1, 1, user="alice", password_file=str(bad), read_timeout="5",
                              allow_insecure_auth="1")
            with pytest.raises(RendezvousConnectionError, match="alice"):
                refused.next_round()
            assert ok.shutdown()
        finally:
            run.close()
    assert rdzv_events.of(refused.node_id, "next_rendezvous", NodeState.FAILED)
    assert recorded_metrics.values("etcd_client.errors.EtcdAuthError")
    seen = [r.getMessage() for r in caplog.records]
    seen += [e.serialize() for e in rdzv_events.events]
    seen += [str(d) for d in recorded_metrics.data]
    assert len(seen) > 10
    for password in (secret, wrong, "r00t-Pw-3"):
        assert not [line for line in seen if password in line]
