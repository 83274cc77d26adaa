"""The etcd-v3 interleaving checker's liveness invariants (tests/helpers/v3_model.py) on made-up runs:
"a live node is never dropped unless it stalled past the bound" and "torch's rank barrier holds a live
group" each fail on the run that breaks them and pass where the model has an excuse (a judge that cannot
fail checks nothing). The checker against a real etcd: tests/integration/test_v3_interleavings.py."""

from __future__ import annotations

import pytest
from helpers.v3_model import RunModel, Seen
from helpers.v3_world import Node, NodeConf

CONF = NodeConf(min_nodes=1, max_nodes=3, heartbeat=6, read_timeout=8.0)


def _member(model: RunModel, name: str, round_: int, rank: int, world: int) -> Node:
    node = Node(name, handler=None, status="member")  # type: ignore[arg-type]  # the model reads no handler
    node.result = (round_, rank, world, 10 * round_, "127.0.0.1", 29500)
    model.results.setdefault(round_, []).append((node, node.result))
    return node


def _run(world1: int = 2) -> tuple[RunModel, list[Node]]:
    """Round 1 sealed at t=100 with ``world1`` members."""
    model = RunModel(CONF, slack=10.0)
    model.saw_seal(Seen(1, 10, world1, ("127.0.0.1", 29500), at=100.0))
    return model, [_member(model, f"n{i}", 1, i, world1) for i in range(world1)]


def _seal_two(model: RunModel, at: float, world: int = 1) -> None:
    model.saw_seal(Seen(2, 20, world, ("127.0.0.1", 29500), at=at))


def _texts(model: RunModel, now: float) -> list[str]:
    return [what for what, _ in model.violations([], now)]


def test_the_bounds_follow_the_lease_and_the_eviction_rule() -> None:
    assert RunModel(CONF, 1.0).spared_stall() == pytest.approx(2.5)  # min(6, L=4) - 1 - 0.5
    assert RunModel(CONF, 1.0).dropping_stall() == pytest.approx(6.5)  # past the lease
    short = NodeConf(heartbeat=2)
    assert RunModel(short, 1.0).spared_stall() == pytest.approx(2 - 2 / 3 - 0.5)  # the lease comes first


def test_a_live_member_left_behind_by_the_next_seal_is_dropped() -> None:
    model, (a, b) = _run()
    model.member_gone(b, 1, 105.0)  # b re-joined round 2 (its group failed); a never left round 1
    model.left_at[(b.name, 1)] = 104.0
    model.node_stall(a, 104.0, 106.5, long=False)  # within the spared bound
    _seal_two(model, at=108.0)
    (what,) = _texts(model, 109.0)
    assert what.startswith("n0, a live member of round 1 that nothing sent off, was dropped") and "[2.5]" in what
    assert _texts(model, 110.0) == []  # reported once


@pytest.mark.parametrize("excuse", ["left before the seal", "long stall", "etcd fault", "lease revoked", "dead"])
def test_a_member_with_an_excuse_is_not_reported(excuse: str) -> None:
    model, (a, b) = _run()
    model.left_at[(b.name, 1)] = 104.0
    if excuse == "left before the seal":
        model.left_at[(a.name, 1)] = 107.0
    elif excuse == "long stall":
        model.node_stall(a, 104.0, 111.0, long=True)
    elif excuse == "etcd fault":
        model.faults.append((90.0, 95.0))  # ended within read_timeout + TTL before round 1's seal
    elif excuse == "lease revoked":
        model.disturbed.add(1)
    elif excuse == "dead":
        a.status = "killed"
        model.left_at[(a.name, 1)] = 103.0
    _seal_two(model, at=108.0)
    assert _texts(model, 109.0) == []


def test_a_departure_after_the_seal_does_not_excuse_the_drop() -> None:
    model, (a, b) = _run()
    model.left_at[(b.name, 1)] = 104.0
    _seal_two(model, at=108.0)
    model.member_gone(a, 1, 120.0)  # sent off only after round 2 had been sealed without it
    assert len(_texts(model, 109.0)) == 1


def _barrier_fails(model: RunModel, node: Node, at: float) -> None:
    model.barrier_failed(node, 1, at)


def test_a_rank_barrier_that_fails_in_a_live_group_is_reported_once_the_round_settled() -> None:
    model, (a, b) = _run()
    _barrier_fails(model, a, 101.0)
    _barrier_fails(model, b, 101.2)
    assert _texts(model, 105.0) == []  # within read_timeout + 2 s: members may still be returning
    (what,) = _texts(model, 112.0)
    assert what.startswith("torch's rank barrier of round 1 failed on ['n0', 'n1'], with every member")


@pytest.mark.parametrize("excuse", ["a member left first", "a member never returned", "long stall", "etcd fault"])
def test_a_rank_barrier_failure_with_an_excuse_is_not_reported(excuse: str) -> None:
    world = 3 if excuse == "a member never returned" else 2
    model, members = _run(world)
    if excuse == "a member never returned":
        model.results[1].pop()
    elif excuse == "a member left first":
        model.left_at[(members[1].name, 1)] = 100.5
    elif excuse == "long stall":
        model.node_stall(members[1], 99.0, 107.0, long=True)
    elif excuse == "etcd fault":
        model.faults.append((100.2, 100.8))
    _barrier_fails(model, members[0], 104.0)
    assert _texts(model, 120.0) == []
