"""Smoke tests of the benchmark pieces (``benchmarks/``), at the smallest sizes.

The full and quick runs are executed by ``python -m benchmarks.run``; here we
check that the statistics, the report, the B1 operations (against a real etcd,
both versions) and one rendezvous through the worker pool do what they claim.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks import report
from benchmarks.common import (
    FLOOR,
    FLOOR_BARRIER,
    OURS_ETCD_V3,
    OURS_STORE,
    Series,
    percentile,
    ratio_summary,
    rotated,
)
from benchmarks.run import (
    _config,
    _parse_box,
    _parse_conf,
    _parse_contenders,
    _parse_ints,
    broken_contenders,
    build_parser,
)


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


def test_box_option_sets_every_or_one_contender() -> None:
    assert _parse_box("60") == ("*", 60.0)
    assert _parse_box("etcd-v3=240") == (OURS_ETCD_V3, 240.0)
    for bad in ("0", "x", "etcd-v9=5", "etcd-v3=-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            _parse_box(bad)
    _, cfg = _config(build_parser().parse_args(["--scale", "--only", "b2", "--box", "60", "--box", "etcd-v3=240"]))
    assert cfg["b2"]["box"] == {"*": 60.0, OURS_ETCD_V3: 240.0}  # the bare number replaced the mode's boxes
    assert max(cfg["b2"]["ns"]) == 4096
    assert _parse_contenders("etcd-v3, floor-barrier") == [OURS_ETCD_V3, FLOOR_BARRIER]
    with pytest.raises(argparse.ArgumentTypeError, match="etcd-v9"):
        _parse_contenders("etcd-v3,etcd-v9")


def test_v3_conf_option_gives_b6_its_rdzv_conf() -> None:
    assert _parse_conf("renew_interval=5") == ("renew_interval", "5")
    for bad in ("renew_interval", "=5"):
        with pytest.raises(argparse.ArgumentTypeError):
            _parse_conf(bad)
    args = build_parser().parse_args(["--only", "b6", "--v3-conf", "renew_interval=5", "--v3-conf", "evict_misses=3"])
    assert dict(args.v3_conf) == {"renew_interval": "5", "evict_misses": "3"}


def _fake_results() -> dict[str, Any]:
    def fig(x: float | None) -> dict[str, Any]:
        return {"median": x, "p99": x, "lo": x, "hi": x, "n": 1, "runs": 1}

    def watch(mean: float, most: int) -> dict[str, Any]:
        return {"events_mean": mean, "events_max": most, "bytes_mean": mean * 100, "bytes_max": most * 100,
                "rounds": 1}

    return {
        "mode": "test",
        "machine": {"machine": "test box", "cores": 2, "versions": {}},
        "b2": {
            "ns": [64, 1024, 2048], "contenders": [OURS_ETCD_V3, FLOOR, FLOOR_BARRIER], "conf": {}, "workers": 1,
            "note": "", "box_s": {OURS_ETCD_V3: 120.0, FLOOR: 120.0, FLOOR_BARRIER: 120.0},
            "rows": [
                {"n": 64, "contender": OURS_ETCD_V3, "ms": fig(300.0), "etcd_writes": 70, "revisions": 64,
                 "failures": [], "failed_runs": 0, "watch": watch(2.5, 3),
                 f"ratio_vs_{FLOOR}": {"ratio": 2.5, "lo": 2.5, "hi": 2.5, "runs": 1},
                 f"ratio_vs_{FLOOR_BARRIER}": {"ratio": 1.5, "lo": 1.5, "hi": 1.5, "runs": 1}},
                {"n": 64, "contender": FLOOR, "ms": fig(None), "etcd_writes": None, "revisions": None,
                 "failures": ["boom"], "failed_runs": 1},
                {"n": 64, "contender": FLOOR_BARRIER, "ms": fig(200.0), "etcd_writes": 65, "revisions": 65,
                 "failures": [], "failed_runs": 0, "watch": watch(1.0, 1)},
                {"n": 1024, "contender": OURS_ETCD_V3, "ms": fig(None), "etcd_writes": None, "revisions": None,
                 "failures": ["did not finish in 120 s"], "failed_runs": 1, "did_not_finish": 120.0},
                {"n": 1024, "contender": FLOOR, "ms": fig(1000.0), "etcd_writes": 1024, "revisions": 1024,
                 "failures": [], "failed_runs": 0, "watch": watch(512.0, 1023)},
                {"n": 1024, "contender": FLOOR_BARRIER, "ms": fig(1200.0), "etcd_writes": 1025,
                 "revisions": 1025, "failures": [], "failed_runs": 0, "watch": watch(1.0, 1)},
                {"n": 2048, "contender": OURS_ETCD_V3, "ms": fig(None), "etcd_writes": None, "revisions": None,
                 "failures": [], "failed_runs": 0, "skipped": "not run: did not finish in 120 s at N=1024"},
                {"n": 2048, "contender": FLOOR, "ms": fig(4000.0), "etcd_writes": 2048, "revisions": 2048,
                 "failures": [], "failed_runs": 0},
                {"n": 2048, "contender": FLOOR_BARRIER, "ms": fig(4100.0), "etcd_writes": 2049,
                 "revisions": 2049, "failures": [], "failed_runs": 0, "watch": watch(1.0, 1)},
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
    assert by_name["B2 N=64: etcd-v3 within 2× of the barrier floor"]["status"] == "met"
    assert by_name["B2 N=256: etcd-v3 within 2× of the barrier floor"]["status"] == "not measured"
    dnf = by_name["B2 N=1024: etcd-v3 within 2× of the barrier floor"]
    assert (dnf["status"], dnf["note"]) == ("not met", "did not finish in 120 s")
    assert by_name["B2 N=2048: etcd-v3 within 2× of the barrier floor"]["status"] == "not met"
    assert by_name["B2 N=1024→2048: etcd-v3 time grows at most 2.5×"]["status"] == "not met"
    assert by_name["B2 N=2: etcd-v3 under 20 ms"]["status"] == "not measured"
    events = by_name["B2 N=64: etcd-v3 watch events per waiting node ≤ 3 (+ nodes that left: none)"]
    assert (events["status"], events["figure"]) == ("met", "mean 2.5, max 3")
    # etcd-v3 has no figure at 1024 and 2048, but one at 64: not broken. The floor failed its only N=64 run.
    assert broken_contenders(results) == []
    report.write_all(results, str(tmp_path))
    text = (tmp_path / "results.md").read_text()
    assert "| B2 N=64: etcd-v3 within 2× of the floor | 2.50× | **not met** |" in text
    assert "| 1024 | did not finish in 120 s | 1,000 | 1,200 |" in text
    assert "| 2048 | not run: did not finish in 120 s at N=1024 |" in text
    assert "| 64 | 2.5 / 3 | n/a | 1.0 / 1 | 250 / 300 | n/a | 100 / 100 |" in text
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
    from benchmarks.b1_waits import WAIT_OPS

    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    res = run_b1(_OneServer(etcd_server), f"127.0.0.1:{tcp.port}",  # type: ignore[arg-type]
                 [OURS_STORE, FLOOR, "TCPStore"], reps=1, ops=3, late_ops=1, batch_budget=5.0)
    rows = {(r["op"], r["contender"]): r for r in res["rows"]}
    base_ops = [op for op in OPS if op not in WAIT_OPS]
    for op in base_ops:
        for c in (OURS_STORE, FLOOR, "TCPStore"):
            assert rows[(op, c)]["us"]["median"] > 0, (op, c, rows[(op, c)].get("na"))
    # The waits with other ranks: EtcdStore and TCPStore (torch's barrier needs a c10d Store).
    for c in (OURS_STORE, "TCPStore"):
        assert rows[("wake_busy", c)]["us"]["median"] is not None, rows[("wake_busy", c)].get("na")
        assert rows[("barrier_4", c)]["us"]["median"] > 0, rows[("barrier_4", c)].get("na")
    assert all("not implemented" in rows[(op, FLOOR)]["na"] for op in WAIT_OPS)
    # The floor's RPC counts are the documented minimum for each operation.
    expected = {"set": 1, "get": 1, "add": 1, "compare_set": 1, "wait": 1, "wait_later": 2,
                "multi_get_16": 1, "multi_get_256": 2, "num_keys": 1}
    assert {op: rows[(op, FLOOR)]["rpcs_per_op"] for op in base_ops} == expected
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

    res = measure_round(pool, FLOOR, 3, etcd_server, "", {}, 30.0, 2)
    assert res["error"] is None
    assert res["elapsed"] > 0
    assert res["delta"]["revision"] == 3  # one Put per node, nothing else
    # Each node watches from after its own Range: it sees only the later joins (0 to 2 of them).
    assert res["watch"] is not None and 0 <= res["watch"]["events_max"] <= 2
    assert all(p.alive for p in pool.workers)


@pytest.mark.parametrize("clients", ["process", "node"])
def test_barrier_floor_delivers_one_event_per_waiting_node(pool: Any, etcd_server: Any, clients: str) -> None:
    """Also when the three nodes of each worker share one client: events are counted per node."""
    from benchmarks.b2_rendezvous import measure_round

    n = 6
    res = measure_round(pool, FLOOR_BARRIER, n, etcd_server, "", {}, 30.0, 2, clients=clients)
    assert res["error"] is None, res["error"]
    assert res["delta"]["revision"] == n + 1  # n joins and the go key
    w = res["watch"]
    assert w is not None and w["nodes"] == n
    # Every waiting node got the go event and nothing else; the last joiner (which put go)
    # may or may not have seen its own put before it closed the watch.
    assert w["events_max"] == 1
    assert (n - 1) / n <= w["events_mean"] <= 1.0
    assert 0 < w["bytes_max"] < 200


def test_a_round_over_its_box_is_reported_as_not_finished(pool: Any, etcd_server: Any) -> None:
    from benchmarks.b2_rendezvous import measure_round

    # A round of 3 where one node never comes cannot finish: the box (its join timeout) ends it.
    res = measure_round(pool, FLOOR_BARRIER, 3, etcd_server, "", {}, 30.0, 2, box=2.0, missing=1)
    assert res["did_not_finish"] == 2.0
    assert re.match(r"did not finish in 2 s \(node [01]: TimeoutError: floor-barrier: no go after 2 s "
                    r"\(rank [01]\) \(and 1 more node\(s\)\)\)$", res["error"]), res["error"]
    assert res["elapsed"] is None
    assert all(p.alive for p in pool.workers)


@pytest.mark.parametrize("clients", ["process", "node"])
def test_etcd_v3_nodes_report_their_watch_events(pool: Any, etcd_server: Any, clients: str) -> None:
    from benchmarks.b2_rendezvous import measure_round

    res = measure_round(pool, OURS_ETCD_V3, 4, etcd_server, "", {}, 30.0, 2, clients=clients)
    assert res["error"] is None, res["error"]
    w = res["watch"]
    # The handler's client is found inside it (c10d and torch's etcd-v2 give None), and each
    # node's watches counted (also with two nodes per shared client): bytes come with events only.
    assert w is not None and w["nodes"] == 4
    assert 1 <= w["events_max"] <= 3
    assert (w["events_max"] > 0) == (w["bytes_max"] > 0)


def test_b6_targets_judge_many_jobs_idle_load_and_the_cli() -> None:
    from benchmarks.targets import _b6_targets

    def fig(x: float) -> dict[str, Any]:
        return {"median": x, "p99": x * 1.5, "lo": x, "hi": x, "n": 10, "runs": 1}

    cmd = {"seconds": 1.0, "rc": 0}
    b6 = {"jobs": [1, 10], "nodes_per_job": 8,
          "rows": [{"jobs": 1, "ms": fig(40.0), "failed_jobs": 0, "failures": []},
                   {"jobs": 10, "ms": fig(100.0), "failed_jobs": 0, "failures": []}],
          "ratio": {"ratio": 2.5, "lo": 2.5, "hi": 2.5, "runs": 1},
          "idle": {"revisions_per_min": 0.0, "keepalives_per_s": 16.0, "leases": 90,
                   "raft_entries_per_min": 0.0, "window_s": 5.0},
          "cli": {"made": {"runs": 20}, "live_jobs": 10, "unsure_jobs": 0,
                  "expected": {"listed": 33, "removed": 21, "listed_after_gc": 12},
                  "commands": {"startup": cmd, "list": {**cmd, "runs_listed": 33},
                               "gc": {**cmd, "seconds": 12.0, "runs_removed": 21},
                               "list_after_gc": {**cmd, "runs_listed": 12}}}}
    status = {t["target"].split(":")[0].split(" over")[0]: t["status"] for t in _b6_targets(b6)}
    assert status == {"B6 J=10×8 nodes": "not met", "B6 J=10 idle jobs": "met",
                      "B6 etcd-rdzv list": "met", "B6 etcd-rdzv gc": "not met"}  # gc over its 10 s


def test_b6_many_jobs_on_a_3_member_cluster(pool: Any, etcd_binary: str) -> None:
    """B6 at its smallest: 1 and 2 jobs of 8 nodes, a 6 s idle window (every lease of TTL 15 s is
    renewed at least once in it: each 5 s), 4 ended runs for the CLI."""
    from benchmarks.b6_many_jobs import run_b6
    from benchmarks.targets import _b6_targets

    res = run_b6(pool, etcd_binary, [1, 2], reps=1, solo_rounds=1, window=6.0, cli_runs=4, timeout=60.0,
                 workers=2)
    rows = {r["jobs"]: r for r in res["rows"]}
    assert rows[2]["ms"]["n"] == 2 and rows[2]["failed_jobs"] == 0, rows[2]
    assert rows[1]["revisions_per_job"] > 0 and res["ratio"]["ratio"] > 0
    idle = res["idle"]
    assert idle["revisions_per_min"] == 0 and idle["keepalives_per_s"] >= 16 / 6.0
    assert idle["leases"] >= 16  # a lease per node of the two running jobs
    cli = res["cli"]
    assert all(c["rc"] == 0 for c in cli["commands"].values()), cli["commands"]
    assert cli["commands"]["gc"]["runs_removed"] == cli["expected"]["removed"]
    assert cli["commands"]["list_after_gc"]["runs_listed"] == cli["expected"]["listed_after_gc"]
    assert all(t["status"] != "not measured" for t in _b6_targets(res))
