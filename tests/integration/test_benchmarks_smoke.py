"""Smoke tests of the benchmark pieces (``benchmarks/``), at the smallest sizes.

The full and quick runs are executed by ``python -m benchmarks.run``; here we
check that the statistics, the report, the B1 operations (against a real etcd,
both versions) and one rendezvous through the worker pool do what they claim.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks import report
from benchmarks.common import FLOOR, OURS_ETCD_V3, OURS_STORE, Series, percentile, ratio_summary, rotated
from benchmarks.run import _parse_ints, broken_contenders


def test_series_summary_and_ratios() -> None:
    a, b = Series(), Series()
    a.add_run([1.0, 2.0, 3.0])
    a.add_run([10.0])
    b.add_run([2.0, 2.0])
    b.add_run([5.0])
    s = a.summary(scale=1000.0)
    assert s["median"] == pytest.approx(2500.0)
    assert (s["lo"], s["hi"], s["runs"], s["n"]) == (2000.0, 10000.0, 2, 4)
    r = ratio_summary(a, b)
    assert r is not None
    assert r["ratio"] == pytest.approx(1.5)  # per-run ratios 1.0 and 2.0
    assert (r["lo"], r["hi"]) == (1.0, 2.0)
    assert Series().summary()["median"] is None
    assert percentile([1, 2, 3, 4], 100) == 4
    assert rotated(["a", "b", "c"], 1) == ["b", "c", "a"]


def test_parse_ints_rejects_bad_lists() -> None:
    assert _parse_ints("2,4, 8") == [2, 4, 8]
    for bad in ("0,2", "a", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            _parse_ints(bad)


def _fake_results() -> dict[str, Any]:
    def fig(x: float | None) -> dict[str, Any]:
        return {"median": x, "p99": x, "lo": x, "hi": x, "n": 1, "runs": 1}

    return {
        "mode": "test",
        "machine": {"machine": "test box", "cores": 2, "versions": {}},
        "b2": {
            "ns": [64], "contenders": [OURS_ETCD_V3, FLOOR], "conf": {}, "workers": 1, "note": "",
            "rows": [
                {"n": 64, "contender": OURS_ETCD_V3, "ms": fig(300.0), "etcd_writes": 70, "revisions": 64,
                 "failures": [], "failed_runs": 0,
                 f"ratio_vs_{FLOOR}": {"ratio": 2.5, "lo": 2.5, "hi": 2.5, "runs": 1}},
                {"n": 64, "contender": FLOOR, "ms": fig(None), "etcd_writes": None, "revisions": None,
                 "failures": ["boom"], "failed_runs": 1},
            ],
        },
        "b4": {"ns": [8], "window_s": 60, "settle_s": 2, "conf": {}, "note": "", "rows": [
            {"n": 8, "contender": OURS_ETCD_V3, "revisions_per_min": 0.0, "raft_entries_per_min": 0.0,
             "db_growth_bytes_per_min": 0.0, "etcd_cpu_pct": 0.1},
        ]},
    }


def test_targets_and_markdown_state_met_and_not_met(tmp_path: Any) -> None:
    results = _fake_results()
    by_name = {t["target"]: t for t in report.targets(results)}
    assert by_name["B2 N=64: etcd-v3 within 2× of the floor"]["status"] == "not met"
    assert by_name["B4 N=8: etcd-v3 idle job makes 0 revisions/min"]["status"] == "met"
    assert by_name["B2 N=512: etcd-v3 under 1 s on 16 cores"]["status"] == "not measured"
    assert broken_contenders(results) == [f"B2: {FLOOR}"]
    report.write_all(results, str(tmp_path))
    text = (tmp_path / "results.md").read_text()
    assert "| B2 N=64: etcd-v3 within 2× of the floor | 2.50× | **not met** |" in text
    assert (tmp_path / "b2_rendezvous.png").stat().st_size > 1000


class _OneServer:
    """Stands in for EtcdFarm: every contender uses the fixture's server."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def get(self, contender: str) -> Any:
        return self.server


def test_b1_operations_against_real_etcd(etcd_server: Any) -> None:
    import torch.distributed as dist

    from benchmarks.b1_store import OPS, run_b1

    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    res = run_b1(_OneServer(etcd_server), f"127.0.0.1:{tcp.port}",  # type: ignore[arg-type]
                 [OURS_STORE, FLOOR, "TCPStore"], reps=1, ops=3, late_ops=1, batch_budget=5.0)
    rows = {(r["op"], r["contender"]): r for r in res["rows"]}
    for op in OPS:
        for c in (OURS_STORE, FLOOR, "TCPStore"):
            assert rows[(op, c)]["us"]["median"] > 0, (op, c, rows[(op, c)].get("na"))
    # The floor's RPC counts are the documented minimum for each operation.
    expected = {"set": 1, "get": 1, "add": 1, "compare_set": 1, "wait": 1, "wait_later": 2,
                "multi_get_16": 1, "multi_get_256": 2, "num_keys": 1}
    assert {op: rows[(op, FLOOR)]["rpcs_per_op"] for op in OPS} == expected
    # wait (written 10 ms later) cannot return before the write.
    assert rows[("wait_later", OURS_STORE)]["us"]["median"] >= 10_000
    assert rows[("set", OURS_STORE)][f"ratio_vs_{FLOOR}"] is not None


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    from benchmarks.workers import Pool

    with Pool(2) as p:
        yield p


def test_floor_rendezvous_through_the_worker_pool(pool: Any, etcd_server: Any) -> None:
    from benchmarks.b2_rendezvous import measure_round

    res = measure_round(pool, FLOOR, 3, etcd_server, "", {"join_timeout": "30"}, 30.0, 2)
    assert res["error"] is None
    assert res["elapsed"] > 0
    assert res["delta"]["revision"] == 3  # one Put per node, nothing else
    assert all(p.alive for p in pool.workers)
