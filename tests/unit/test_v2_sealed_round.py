"""etcd-v2's sealed-round fix (issue 22) against torch's handler, on an in-memory CAS backend.

Each case runs torch's unmodified ``DynamicRendezvousHandler`` and our
``EtcdRendezvousHandler`` through the same timeline (controlled clock, gated join
polls: ``tests/helpers/sealed_rounds.py``, cases in ``tests/helpers/sealed_cases.py``)
and asserts torch's defect and our correct outcome side by side. The same cases
run against a real etcd in ``tests/integration/test_v2_sealed_round_etcd.py``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from datetime import timedelta

import pytest
from helpers import sealed_cases as cases
from helpers.sealed_rounds import OURS, TORCH, Clock, MemoryBackend, MemoryCell, install, stored_state
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from etcd_rdzv.dynamic.state import SealedRoundStateHolder, check_torch_internals
from etcd_rdzv.plugin import EtcdRdzvPluginError


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return install(monkeypatch)


def memory_run() -> Callable[[], RendezvousBackend]:
    cell = MemoryCell()
    return lambda: MemoryBackend(cell)


def test_case_a_a_member_whose_heartbeat_aged_while_the_round_sealed_stays_in_it(clock: Clock) -> None:
    torch = cases.case_a(TORCH, clock, memory_run)
    ours = cases.case_a(OURS, clock, memory_run)
    # torch: n0 finishes with world 2, its heartbeat stores the round without n2, and
    # nobody waits: n2 (world 3) is stuck for good
    assert torch.worlds == {"n0": (0, 2), "n1": (1, 3), "n2": (2, 3)}
    assert torch.stored == ["n0", "n1"]
    assert torch.waiting == {"n0": 0, "n1": 0, "n2": 0}
    assert cases.problems(torch)
    assert ours.worlds == {"n0": (0, 3), "n1": (1, 3), "n2": (2, 3)}
    assert ours.stored == ["n0", "n1", "n2"]
    assert ours.waiting == {"n0": 0, "n1": 0, "n2": 0}
    assert cases.problems(ours) == []


def test_case_b_a_stalled_reader_does_not_reopen_a_sealed_round(clock: Clock) -> None:
    torch = cases.case_b(TORCH, clock, memory_run)
    ours = cases.case_b(OURS, clock, memory_run)
    # torch: n0 removed everyone, re-opened the round and made round 1 global;
    # n1 and n2 train in round 0 (world 3), out of the state, nobody waiting
    assert torch.rounds == {"n0": 1, "n1": 0, "n2": 0}
    assert torch.worlds["n0"] is None
    assert (torch.stored_round, torch.stored) == (1, ["n0"])
    assert torch.waiting == {"n1": 0, "n2": 0}
    assert cases.problems(torch)
    assert ours.worlds == {"n0": (0, 3), "n1": (1, 3), "n2": (2, 3)}
    assert (ours.stored_round, ours.stored) == (0, ["n0", "n1", "n2"])
    assert cases.problems(ours) == []


def test_case_c_a_dead_member_makes_the_survivors_re_rendezvous(clock: Clock) -> None:
    torch = cases.case_c(TORCH, clock, memory_run)
    ours = cases.case_c(OURS, clock, memory_run)
    # torch (pytorch#111646): nobody ever reports a waiting node
    assert torch.within_grace == torch.dead == {"n0": 0, "n1": 0}
    assert torch.after is None
    # ours: not within the heartbeat window + 1 s read cache, then on both survivors
    assert ours.within_grace == {"n0": 0, "n1": 0}
    assert ours.dead == {"n0": 1, "n1": 1}
    assert ours.after is not None
    assert ours.after.worlds == {"n0": (0, 2), "n1": (1, 2)}
    assert (ours.after.stored_round, ours.after.stored) == (1, ["n0", "n1"])
    assert cases.problems(ours.after) == []


@pytest.mark.parametrize("kind", [TORCH, OURS], ids=["torch", "ours"])
def test_case_c_a_replacement_takes_the_dead_members_place(clock: Clock, kind: type) -> None:
    """--nnodes=3:3: ours keeps the dead member in the sealed round (the replacement waits
    as redundant) until the survivors leave; both kinds admit the replacement."""
    outcome = cases.case_c_replacement(kind, clock, memory_run)
    assert outcome.worlds == {"n0": (0, 3), "n1": (1, 3), "r": (2, 3)}
    assert (outcome.stored_round, outcome.stored) == (1, ["n0", "n1", "r"])
    assert cases.problems(outcome) == []


def test_a_member_whose_entry_another_node_removed_reports_a_waiting_node(clock: Clock) -> None:
    assert cases.case_removed(TORCH, clock, memory_run) == {"n0": 0, "n1": 0}
    assert cases.case_removed(OURS, clock, memory_run) == {"n0": 0, "n1": 1}


def test_dead_waiters_and_redundant_nodes_are_still_pruned_from_a_sealed_round(clock: Clock) -> None:
    settings = dr.RendezvousSettings("r", 2, 2, dr.RendezvousTimeout(), timedelta(seconds=5), 3)
    gen = dr._NodeDescGenerator()
    me, member, waiter, spare, fresh = (gen.generate(a) for a in ("me", "member", "waiter", "spare", "fresh"))
    state = dr._RendezvousState()
    state.complete = True
    state.participants = {me: 0, member: 1}
    state.wait_list = {waiter, fresh}
    state.redundancy_list = {spare}
    state.last_heartbeats = {n: clock.now() for n in (me, member, waiter, spare, fresh)}
    backend = MemoryBackend(MemoryCell())
    assert backend.set_state(pickle.dumps(state)) is not None
    clock.at(16.5)  # 16.5 s: every heartbeat dead by torch's window (15 s) and ours (16 s)
    state.last_heartbeats[fresh] = clock.now()
    backend.set_state(pickle.dumps(state), 1)
    holder = SealedRoundStateHolder(backend, settings, me)
    holder.sync()
    got = holder.state
    assert got.participants == {me: 0, member: 1}  # a sealed round keeps its members
    assert (got.wait_list, got.redundancy_list) == ({fresh}, set())
    assert set(got.last_heartbeats) == {me, member, fresh}
    assert holder.dead_members() == [member]  # what num_nodes_waiting() reports
    holder.leave_round()  # this node re-rendezvouses: now its dead members go
    assert holder.state.participants == {me: 0}
    assert stored_state(backend).participants == {me: 0, member: 1}  # nothing written by itself


def test_the_torch_internals_the_fix_relies_on_are_present() -> None:
    """Fails on a torch whose dynamic rendezvous changed the private names we use."""
    check_torch_internals()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda mp: mp.delattr(dr, "_remove_participant_epilogue"), "_remove_participant_epilogue"),
        (lambda mp: mp.delattr(dr._BackendRendezvousStateHolder, "_sanitize"), "no longer calls _sanitize"),
        (lambda mp: mp.setattr(dr._BackendRendezvousStateHolder, "sync", lambda self: None), "no longer calls"),
        (lambda mp: mp.delattr(dr.DynamicRendezvousHandler, "_keep_alive"), "lacks _keep_alive"),
        (lambda mp: mp.delattr(dr, "_BackendRendezvousStateHolder"), "no _BackendRendezvousStateHolder"),
    ],
    ids=["epilogue", "sanitize", "sync", "keep_alive", "holder"],
)
def test_a_torch_without_them_gets_a_plugin_error_naming_the_change(
    monkeypatch: pytest.MonkeyPatch, change: Callable[[pytest.MonkeyPatch], None], named: str
) -> None:
    change(monkeypatch)
    with pytest.raises(EtcdRdzvPluginError, match="etcd-v2 handler cannot run on torch") as e:
        check_torch_internals()
    assert named in str(e.value)
    if hasattr(dr, "_BackendRendezvousStateHolder"):  # else torch's own from_backend fails first
        with pytest.raises(EtcdRdzvPluginError):
            OURS.from_backend("r", None, MemoryBackend(MemoryCell()), 1, 1)
