"""The nemesis suite's judge (tests/helpers/nemesis.py) on made-up histories: each invariant fails
on the history that breaks it, and a clean history passes (a judge that cannot fail checks nothing)."""

from __future__ import annotations

from helpers.nemesis import KINDS, Fault, schedule, stalls, violations

from etcd_rdzv.testing.train import Record


def _group(name: str, t0: float, resumed: int, steps: range, ckpt_every: int = 3) -> list[Record]:
    base = {"round": 0, "group": name, "rank": 0, "world_size": 2}
    out = [Record(kind="start", t=t0, step=resumed, resumed_from=resumed, **base)]
    for i, s in enumerate(steps):
        t = t0 + 1 + i
        out.append(Record(kind="step", t=t, step=s, **base))
        out.append(Record(kind="step", t=t, step=s, **{**base, "rank": 1}))
        if s % ckpt_every == 0:
            out.append(Record(kind="ckpt", t=t + 0.1, step=s, **base))
    return out


def _fault(kind: str, start: float, end: float) -> Fault:
    return Fault(kind, end - start, "n1", start, end)


def test_a_clean_history_passes() -> None:
    # g1 does 1..7 (checkpoints 3, 6), a node dies at t=20, g2 resumes from 6 and goes on.
    records = _group("g1", 0, 0, range(1, 8)) + _group("g2", 30, 6, range(7, 12))
    assert violations(records, [_fault("kill_node", 20, 22)], since=10) == []


def test_a_group_resuming_from_an_older_checkpoint_lost_steps() -> None:
    records = _group("g1", 0, 0, range(1, 8)) + _group("g2", 30, 3, range(4, 12))
    (v,) = violations(records, [_fault("kill_node", 20, 22)], since=10)
    assert "not the newest checkpoint 6" in v


def test_a_group_resuming_past_the_last_step_done_invented_steps() -> None:
    records = _group("g1", 0, 0, range(1, 8)) + _group("g2", 30, 9, range(10, 12))
    (v,) = violations(records, [_fault("kill_node", 20, 22)], since=10)
    assert "past the last step done (7)" in v


def test_a_skipped_step() -> None:
    # g2 resumes from the checkpoint of 3 and logs 5..7: step 4 was never done
    skipped = _group("g1", 0, 0, range(1, 4)) + _group("g2", 30, 3, range(5, 8))
    (v,) = violations(skipped, [_fault("kill_node", 20, 22)], since=10)
    assert "logged steps 5..7 (3): not each step after it once" in v
    gap = _group("g1", 0, 0, [1, 2, 4, 5])  # type: ignore[arg-type]
    (v,) = violations(gap, [], since=10)
    assert "not each step after it once" in v


def test_a_group_with_no_fault_that_may_restart_it_is_a_false_eviction() -> None:
    records = _group("g1", 0, 0, range(1, 8)) + _group("g2", 30, 6, range(7, 12))
    for kind in ("stop_follower", "quorum_loss", "cpu_hog", "kill_leader"):
        (v,) = violations(records, [_fault(kind, 20, 25)], since=10)
        assert "false eviction" in v and kind in v
    # too long after the fault that may restart it
    (v,) = violations(records, [_fault("kill_node", 20, 22)], since=10, explain_s=5)
    assert "false eviction" in v
    # the job forming before the faults needs none
    assert violations(records, [], since=40) == []


def test_stalls_measure_the_longest_time_without_a_step_after_each_fault() -> None:
    records = _group("g1", 0, 0, range(1, 8)) + _group("g2", 30, 6, range(7, 12))
    # steps at t = 1..7 and 31..35: a fault at 7.5 costs 31 - 7.5; one at 32 only the 1 s step pace
    got = stalls(records, [_fault("kill_node", 7.5, 9), _fault("stop_follower", 32, 33)], until=40)
    assert got == [23.5, 1.0]
    # a fault after which nothing was done until the end costs all of it
    assert stalls(records, [_fault("kill_node", 36, 37)], until=50) == [14.0]


def test_a_schedule_is_the_seeds_and_each_kind_comes_first_once() -> None:
    a = schedule(7, "etcd-v2", len(KINDS) + 4)
    assert [(f.kind, f.hold) for f in a] == [(f.kind, f.hold) for f in schedule(7, "etcd-v2", len(KINDS) + 4)]
    assert sorted(f.kind for f in a[: len(KINDS)]) == sorted(KINDS)
    assert [f.kind for f in schedule(8, "etcd-v2", 5)] != [f.kind for f in a[:5]]
    for f in a:
        lo, hi = KINDS[f.kind].hold
        assert lo <= f.hold <= hi
    assert {f.kind for f in schedule(1, "etcd-v3", 6, ["kill_node", "cut_node"])} <= {"kill_node", "cut_node"}
