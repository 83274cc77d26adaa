"""The pure parts of B3 with torchrun agents (benchmarks/b3_torchrun.py): reading torchrun's log times,
finding the new group's first step in the training log, splitting a figure into rendezvous and start-up,
and the overlap check; and the issue-24 target rows built from a results section."""

from __future__ import annotations

import time

import pytest

from benchmarks.b3_torchrun import new_group_first_step, overlaps, split_recovery
from benchmarks.b3_torchrun_report import targets
from etcd_rdzv.testing.agents import log_line_times
from etcd_rdzv.testing.train import Record

NOW = time.mktime(time.strptime("2026 12 02 04:10:00", "%Y %m %d %H:%M:%S"))


def _at(clock: str) -> float:
    return time.mktime(time.strptime(f"2026 12 02 {clock}", "%Y %m %d %H:%M:%S"))


AGENT_LOG = """\
I1202 04:03:29.934000 18440 site-packages/torch/distributed/launcher/api.py:254] Starting elastic_operator
I1202 04:03:31.986000 18440 site-packages/torch/distributed/elastic/agent/server/api.py:553] [default] \
Rendezvous complete for workers. Result:
I1202 04:03:31.986000 18440 site-packages/torch/distributed/elastic/agent/server/api.py:553]   restart_count=0
[rank0]: Rendezvous complete for workers (a worker's line without the prefix)
I1202 04:04:34.855123 18440 site-packages/torch/distributed/elastic/agent/server/api.py:553] [default] \
Rendezvous complete for workers. Result:
"""


def test_log_line_times_reads_the_glog_prefix_of_matching_lines_only() -> None:
    times = log_line_times(AGENT_LOG, "Rendezvous complete for workers", now=NOW)
    assert times == pytest.approx([_at("04:03:31") + 0.986, _at("04:04:34") + 0.855123])
    assert log_line_times(AGENT_LOG, "no such line", now=NOW) == []


def test_log_line_times_puts_a_december_line_in_the_previous_year_on_new_years_day() -> None:
    new_year = time.mktime(time.strptime("2027 01 01 00:00:05", "%Y %m %d %H:%M:%S"))
    line = "I1231 23:59:58.500000 1 api.py:553] [default] Rendezvous complete for workers. Result:"
    [t] = log_line_times(line, "Rendezvous complete", now=new_year)
    assert new_year - t == pytest.approx(6.5)


def _rec(kind: str, t: float, group: str, node: str, step: int, world: int = 2) -> Record:
    return Record(kind=kind, t=t, round=1, group=group, rank=0, world_size=world, step=step, node=node)


def test_new_group_first_step_is_the_first_step_of_every_rank_of_a_group_on_exactly_those_nodes() -> None:
    records = [
        _rec("start", 1.0, "old", "a", 0, 3), _rec("step", 1.5, "old", "a", 1, 3),
        _rec("start", 11.0, "wrong", "a", 6), _rec("start", 11.1, "wrong", "c", 6),  # not the nodes asked
        _rec("step", 11.5, "wrong", "a", 7), _rec("step", 11.6, "wrong", "c", 7),
        _rec("start", 12.0, "new", "a", 6), _rec("start", 12.2, "new", "b", 6),
        _rec("step", 12.9, "new", "b", 7),
    ]  # fmt: skip
    assert new_group_first_step(records, 10.0, {"a", "b"}) is None  # rank a has not finished step 7 yet
    records.append(_rec("step", 13.0, "new", "a", 7))
    records.append(_rec("step", 13.4, "new", "a", 8))
    assert new_group_first_step(records, 10.0, {"a", "b"}) == (12.0, 13.0)
    assert new_group_first_step(records, 12.5, {"a", "b"}) is None  # formed before the fault asked about


def test_split_recovery_takes_each_nodes_last_completion_before_the_first_step() -> None:
    completions = {"a": [5.0, 12.0, 30.0], "b": [5.0, 11.0, 13.5]}  # 30.0: a later round
    parts = split_recovery(10.0, completions, 20.0)
    assert parts == pytest.approx({"rendezvous_s": 3.5, "startup_s": 6.5, "total_s": 10.0})


def test_split_recovery_refuses_a_node_without_a_completion_or_a_step_before_the_fault() -> None:
    with pytest.raises(ValueError, match="b: no"):
        split_recovery(10.0, {"a": [12.0], "b": [9.0]}, 20.0)
    with pytest.raises(ValueError, match="not after the fault"):
        split_recovery(10.0, {"a": [12.0]}, 9.5)


def test_overlaps_names_the_intervals_that_intersect_the_window() -> None:
    busy = [("x start", 0.0, 5.0), ("y start-up", 9.0, 11.0), ("z", 20.0, 30.0)]
    assert overlaps((5.0, 10.0), busy) == ["y start-up"]
    assert overlaps((11.0, 20.0), busy) == []


def _section(sigkill: list[float], sigterm: list[float], failed_spare: bool) -> dict[str, object]:
    figures = [{"contender": "etcd-v3", "scenario": "sigkill", "rep": i, "total_s": t, "rendezvous_s": 1.0,
                "loadavg_1m": 1.0, "error": None} for i, t in enumerate(sigkill)]
    figures += [{"contender": "etcd-v3", "scenario": "sigterm", "rep": i, "total_s": t, "rendezvous_s": 0.2,
                 "loadavg_1m": 1.0, "error": None} for i, t in enumerate(sigterm)]
    figures.append({"contender": "etcd-v3", "scenario": "spare", "rep": 0, "total_s": None, "rendezvous_s": None,
                    "loadavg_1m": 1.0, "error": "TimeoutError: x" if failed_spare else None})
    return {"contenders": ["etcd-v3"], "scenarios": ["sigkill", "sigterm", "spare"], "figures": figures}


def test_targets_are_met_only_when_every_run_is_within_the_bound() -> None:
    rows = targets(_section([6.0, 7.9], [3.0, 4.5], failed_spare=True))
    status = [r["status"] for r in rows]
    # etcd-v3's sigkill total, its rendezvous, sigterm, spare; the hang rows (etcd-v3, etcd-v2) not in this run
    assert status == ["met", "met", "not met", "not met", "not measured", "not measured"]
    assert rows[2]["figure"].startswith("4.50 s")
    assert rows[3]["note"] == "a run failed"
    assert [r["target"].split(",")[0] for r in rows[4:]] == ["B3t (issue 24): etcd-v3", "B3t (issue 29): etcd-v2"]


def test_only_b3t_takes_its_own_sizes_and_the_scenario_filter() -> None:
    from benchmarks.run import _config, build_parser

    args = build_parser().parse_args(["--only", "b3t", "--scenarios", "sigkill,spare", "--reps", "3"])
    mode, cfg = _config(args)
    assert cfg["sections"] == ["b3t"]
    assert cfg["b3t"]["scenarios"] == ["sigkill", "spare"] and cfg["b3t"]["reps"] == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--only", "b3t", "--scenarios", "sigsegv"])
