"""The optional Prometheus endpoint: conf validation, the metric mapping (no etcd here)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest
from helpers.ports import closed_port
from torch.distributed.elastic.metrics import MetricData
from torch.distributed.elastic.rendezvous import RendezvousParameters

from etcd_rdzv import conf_keys, metrics

HAVE_PROMETHEUS = importlib.util.find_spec("prometheus_client") is not None
needs_prometheus = pytest.mark.skipif(
    not HAVE_PROMETHEUS, reason="prometheus_client is not installed (pip install 'etcd-rdzv[prometheus]')"
)


def params(**conf: str) -> RendezvousParameters:
    return RendezvousParameters(backend="etcd-v3", endpoint="127.0.0.1:2379", run_id="r", min_nodes=1,
                                max_nodes=1, **conf)


def test_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(conf_keys.METRICS_PORT_ENV, raising=False)
    assert metrics.maybe_start(params()) is None
    assert metrics.maybe_start(params(metrics_port=" ")) is None


@pytest.mark.parametrize("bad", ["0", "-1", "70000", "http"])
def test_a_bad_port_is_named(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(conf_keys.METRICS_PORT_ENV, raising=False)
    with pytest.raises(ValueError, match=f"'metrics_port' must be a TCP port.*{bad!r}"):
        metrics.maybe_start(params(metrics_port=bad))
    monkeypatch.setenv(conf_keys.METRICS_PORT_ENV, bad)
    with pytest.raises(ValueError, match="metrics_port"):
        metrics.maybe_start(params())


@pytest.mark.skipif(HAVE_PROMETHEUS, reason="prometheus_client is installed: the missing case cannot occur")
def test_a_port_without_prometheus_client_says_what_to_install() -> None:
    with pytest.raises(ValueError, match=r"prometheus_client is not installed.*etcd-rdzv\[prometheus\]"):
        metrics.maybe_start(params(metrics_port="9400"))


@needs_prometheus
def test_handler_maps_torch_metrics_to_prometheus() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    handler = metrics.PrometheusMetricHandler(registry)
    now = time.time()
    for name, value in [("etcd-v3.rendezvous.joins", 1), ("etcd-v3.rendezvous.joins", 1),
                        ("etcd-v2.rendezvous.joins", 1), ("etcd-v3.rendezvous.duration.ms", 120),
                        ("etcd-v3.rendezvous.duration.ms", 80), ("etcd_client.retries", 3),
                        ("etcd_client.errors.EtcdTimeoutError", 1), ("custom.thing", 7)]:
        handler.emit(MetricData(now, "etcd_rdzv", name, value))
    get = registry.get_sample_value
    assert get("etcd_rdzv_rendezvous_joins_total", {"backend": "etcd-v3"}) == 2
    assert get("etcd_rdzv_rendezvous_joins_total", {"backend": "etcd-v2"}) == 1
    assert get("etcd_rdzv_rendezvous_duration_ms", {"backend": "etcd-v3"}) == 80  # a gauge: the last
    assert get("etcd_rdzv_etcd_client_retries_total") == 3
    assert get("etcd_rdzv_etcd_client_errors_total", {"error": "EtcdTimeoutError"}) == 1
    assert get("etcd_rdzv_custom_thing") == 7


def _listening_addrs(port: int) -> set[str]:
    """The local IPv4 addresses listening on ``port`` (``/proc/net/tcp``, state 0A)."""
    found = set()
    with open("/proc/net/tcp") as f:
        for line in list(f)[1:]:
            local, state = line.split()[1], line.split()[3]
            hex_ip, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(".".join(str(int(hex_ip[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


@needs_prometheus
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc/net/tcp")
@pytest.mark.parametrize("addr, expected", [(None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")])
def test_the_endpoint_binds_loopback_unless_told_otherwise(addr: str | None, expected: str) -> None:
    # In a child process: an endpoint serves until its process exits.
    port = closed_port()
    conf = f"metrics_port='{port}'" + (f", metrics_addr='{addr}'" if addr else "")
    code = (
        "import sys\nfrom torch.distributed.elastic.rendezvous import RendezvousParameters\n"
        "from etcd_rdzv import metrics\n"
        "p = RendezvousParameters(backend='etcd-v3', endpoint='h:1', run_id='r', min_nodes=1, max_nodes=1, "
        f"{conf})\nprint(metrics.maybe_start(p), flush=True)\nsys.stdin.read()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != conf_keys.METRICS_ADDR_ENV}
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == str((expected, port))
        assert _listening_addrs(port) == {expected}
    finally:
        child.kill()
        child.wait(10)
