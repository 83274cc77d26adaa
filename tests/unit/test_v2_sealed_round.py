"""etcd-v2's sealed-round fix (issue 22) against torch's handler, on an in-memory CAS backend.

Each case runs torch's unmodified ``DynamicRendezvousHandler`` and our
``EtcdRendezvousHandler`` through the same timeline (controlled clock, gated join
polls: ``tests/helpers/sealed_rounds.py``, cases in ``tests/helpers/sealed_cases.py``)
and asserts torch's defect and our correct outcome side by side. The same cases
run against a real etcd in ``tests/integration/test_v2_sealed_round_etcd.py``.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from helpers import sealed_cases as cases
from helpers.sealed_rounds import OURS, TORCH, Clock, MemoryBackend, MemoryCell, Run, install, stored_state
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
    # ours: not within the heartbeat window + 1 s read cache (16 s), then on both
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


@pytest.mark.parametrize("kind", [TORCH, OURS], ids=["torch", "ours"])
def test_case_c_survivors_that_left_at_once_get_a_new_round_once_the_member_is_dead(
    clock: Clock, kind: type
) -> None:
    """The sealed round is left with only its dead member: a waiter prunes it once dead."""
    outcome = cases.case_c_early(kind, clock, memory_run)
    assert outcome.worlds == {"n0": (0, 2), "n1": (1, 2)}
    assert (outcome.stored_round, outcome.stored) == (1, ["n0", "n1"])


def test_a_member_whose_entry_another_node_removed_reports_a_waiting_node(clock: Clock) -> None:
    assert cases.case_removed(TORCH, clock, memory_run) == {"n0": 0, "n1": 0}
    # n0 reports one too: a member left its completed round (as a failed agent's shutdown() does,
    # issue 30), so both re-form at once instead of n0's workers waiting for their collective timeout.
    assert cases.case_removed(OURS, clock, memory_run) == {"n0": 1, "n1": 1}


def _sealed(clock: Clock, *members: str, waiting: tuple[str, ...] = (), spare: tuple[str, ...] = ()) -> Any:
    """A completed round of ``members``, every heartbeat at the clock's now; the descriptors by name."""
    gen = dr._NodeDescGenerator()
    nodes = {a: gen.generate(a) for a in (*members, *waiting, *spare, "reader")}
    state = dr._RendezvousState()
    state.complete = True
    state.participants = {nodes[a]: i for i, a in enumerate(members)}
    state.wait_list = {nodes[a] for a in waiting}
    state.redundancy_list = {nodes[a] for a in spare}
    state.last_heartbeats = {nodes[a]: clock.now() for a in (*members, *waiting, *spare)}
    return state, nodes


def _read_as(reader: Any, state: Any) -> SealedRoundStateHolder:
    """A holder of ``reader`` that has read ``state`` (stored in a new memory cell)."""
    backend = MemoryBackend(MemoryCell())
    assert backend.set_state(pickle.dumps(state)) is not None
    holder = SealedRoundStateHolder(backend, SETTINGS, reader)
    holder.sync()
    return holder


SETTINGS = dr.RendezvousSettings("r", 2, 3, dr.RendezvousTimeout(), timedelta(seconds=5), 3)


def test_dead_waiters_and_redundant_nodes_are_still_pruned_from_a_sealed_round(clock: Clock) -> None:
    state, n = _sealed(clock, "me", "member", waiting=("waiter", "fresh"), spare=("spare",))
    clock.at(16.5)  # every heartbeat dead by torch's window (15 s) and by ours (16 s)...
    state.last_heartbeats[n["fresh"]] = clock.now()  # ...but this one
    state.last_heartbeats[n["me"]] = clock.now()  # and the reader's own (a stale reader judges nobody)
    holder = _read_as(n["me"], state)
    got = holder.state
    assert got.participants == {n["me"]: 0, n["member"]: 1}  # a sealed round keeps its members
    assert (got.wait_list, got.redundancy_list) == ({n["fresh"]}, set())
    assert set(got.last_heartbeats) == {n["me"], n["member"], n["fresh"]}
    assert holder.dead_members() == [n["member"]]  # what num_nodes_waiting() reports


def test_a_reader_whose_own_heartbeat_is_stale_calls_no_member_dead(clock: Clock) -> None:
    """Every heartbeat old, the reader's own too: the problem is the reader or etcd (an outage, a stall),
    not the members, so nobody is reported dead (partition scenario e: a 10 s etcd outage)."""
    state, n = _sealed(clock, "me", "member")
    clock.at(21.5)  # the reader's own heartbeat older than 4 intervals: a stale reader
    assert _read_as(n["me"], state).dead_members() == []
    state.last_heartbeats[n["me"]] = clock.now()
    assert _read_as(n["me"], state).dead_members() == [n["member"]]


def test_a_sealed_round_is_pruned_only_by_a_reader_outside_it_once_every_member_is_dead(clock: Clock) -> None:
    state, n = _sealed(clock, "a", "b", waiting=("w",))
    clock.at(15.5)  # dead by torch's window, not by ours
    assert _read_as(n["w"], state).state.participants == state.participants
    clock.at(16.5)
    assert _read_as(n["a"], state).state.participants == state.participants  # a member: alive
    state.last_heartbeats[n["w"]] = state.last_heartbeats[n["b"]] = clock.now()
    assert _read_as(n["w"], state).state.participants == state.participants  # b is alive
    state.last_heartbeats[n["b"]] = state.last_heartbeats[n["a"]]
    pruned = _read_as(n["w"], state).state  # all dead: torch's rule, the round advances
    assert (pruned.participants, pruned.complete, pruned.round) == ({}, False, 1)
    assert pruned.wait_list == {n["w"]}


class _WithEpoch(dr._RendezvousState):
    """A torch whose state has a field the holder would not carry (it builds torch's state from
    the checked fields only)."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch = 0


@dataclasses.dataclass(eq=True, order=True, frozen=True)
class _NodeWithRole:
    addr: str
    pid: int
    local_id: int
    role: str = ""


def test_the_torch_internals_the_fix_relies_on_are_present() -> None:
    """Fails on a torch whose dynamic rendezvous changed the private names we use."""
    check_torch_internals()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda mp: mp.setattr(dr, "_RendezvousState", object), "_RendezvousState lacks closed, complete"),
        (lambda mp: mp.setattr(dr, "_RendezvousState", _WithEpoch), "_RendezvousState has new fields epoch"),
        (lambda mp: mp.setattr(dr, "_NodeDesc", _NodeWithRole), "_NodeDesc is no longer a dataclass"),
        (lambda mp: mp.delattr(dr._BackendRendezvousStateHolder, "_sanitize"), "no longer calls _sanitize"),
        (lambda mp: mp.setattr(dr._BackendRendezvousStateHolder, "sync", lambda self: None), "no longer calls"),
        (lambda mp: mp.delattr(dr.DynamicRendezvousHandler, "_keep_alive"), "lacks _keep_alive"),
        (lambda mp: mp.delattr(dr, "_BackendRendezvousStateHolder"), "no _BackendRendezvousStateHolder"),
    ],
    ids=["state", "new state field", "node", "sanitize", "sync", "keep_alive", "holder"],
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


class _TickTimer:
    """torch's ``_PeriodicTimer`` as the test's: it waits ``interval`` from :meth:`start` (when
    the clock moves on by 1 ms: starting a thread takes time) and ticks when the test says."""

    made: list[_TickTimer] = []

    def __init__(self, interval: timedelta, function: Callable[..., None], *args: Any) -> None:
        self.interval, self.function, self.args = interval.total_seconds(), function, args
        self.started: float | None = None
        _TickTimer.made.append(self)

    def set_name(self, name: str) -> None:
        pass

    def start(self) -> None:
        self.started = _clock.t
        _clock.advance(0.001)

    def cancel(self) -> None:
        pass

    def tick(self) -> None:
        """The first tick: one interval after the start."""
        assert self.started is not None
        _clock.at(self.started + self.interval)
        self.function(*self.args)


_clock = Clock()


@pytest.mark.parametrize("kind", [TORCH, OURS], ids=["torch", "ours"])
def test_the_keep_alive_timers_first_tick_sends_a_heartbeat(
    monkeypatch: pytest.MonkeyPatch, clock: Clock, kind: type
) -> None:
    """--nnodes=2:2: n0's heartbeat ages 6 s while the round seals; after its join, the keep-alive
    timer's first tick (one interval after it started) stores a heartbeat: a live member's
    stored heartbeat is never two intervals old (ours refreshed it after starting the timer,
    so the tick found it younger than the interval and skipped it: fails before)."""
    global _clock
    _clock = clock
    _TickTimer.made = []
    monkeypatch.setattr(dr, "_PeriodicTimer", _TickTimer)
    run = Run(kind, clock, memory_run(), (2, 2))
    n0, n1 = run.node("n0"), run.node("n1")
    n0.join()  # t=0: n0's heartbeat
    clock.at(6)
    n1.join()  # the round seals (max_nodes); n1's join ends, its timer starts
    n0.step()  # n0 reads the sealed round at t=6 and starts its timer
    assert n0.world == (0, 2)
    timer = _TickTimer.made[-1]
    timer.tick()
    beat = stored_state(run.backend_factory()).last_heartbeats
    assert {n.addr: b for n, b in beat.items()}["n0"] == clock.now()


def test_the_first_exit_ends_a_sealed_round(clock: Clock) -> None:
    """n2 of a sealed world-3 round dies; the survivors re-form round 1 (world 2) after the last
    call (2 s here), not after n2's heartbeat expired (t > 17): fails before (round 0 stayed)."""
    torch = cases.case_first_exit(TORCH, clock, memory_run)
    ours = cases.case_first_exit(OURS, clock, memory_run)
    assert torch.round_after_exit == 0
    assert torch.formed_at > 1 + 15
    assert ours.round_after_exit == 1
    assert ours.waiting == {"n1": 1}  # n1 still trains in round 0: it sees the round move on
    assert ours.formed_at < 10
    for o in (torch, ours):
        assert o.after.worlds == {"n0": (0, 2), "n1": (1, 2)}
        assert (o.after.stored_round, o.after.stored) == (1, ["n0", "n1"])
        assert cases.problems(o.after) == []


def test_the_first_exit_admits_a_hot_spare_at_once(clock: Clock) -> None:
    torch = cases.case_hot_spare(TORCH, clock, memory_run)
    ours = cases.case_hot_spare(OURS, clock, memory_run)
    assert torch.formed_at > 15  # n1 sent its last heartbeat at t=0
    assert ours.round_after_exit == 1
    assert ours.formed_at < 3 + 3 * 1.1  # r's polls (1.1 s each here), no last call
    for o in (torch, ours):
        assert o.after.worlds == {"n0": (0, 2), "r": (1, 2)}
        assert (o.after.stored_round, o.after.stored) == (1, ["n0", "r"])


def test_a_member_that_had_not_read_the_sealed_round_joins_the_next_one(clock: Clock) -> None:
    """The first exit lands before n1 read round 0: n1 gets no world from round 0; all three
    form round 1 (world 3), none stranded."""
    ours = cases.case_exit_before_a_member_read(OURS, clock, memory_run)
    assert ours.waiting == {"n2": 1}
    assert ours.worlds == {"n0": (0, 3), "n1": (1, 3), "n2": (2, 3)}
    assert ours.rounds == {"n0": 1, "n1": 1, "n2": 1}
    assert (ours.stored_round, ours.stored) == (1, ["n0", "n1", "n2"])
    assert cases.problems(ours) == []


@pytest.mark.parametrize("kind", [TORCH, OURS], ids=["torch", "ours"])
def test_events_are_named_without_inspecting_the_stack(
    monkeypatch: pytest.MonkeyPatch, clock: Clock, kind: type
) -> None:
    """torch names every rendezvous event with ``inspect.stack()`` (twice), also where the event is
    then dropped (the default): milliseconds of CPU per event inside the read-modify-write window of
    each state change, seconds on a loaded host, where a node joining a sealed round's wait list lost
    every compare-and-swap to the members' 1 s heartbeats (e2e test_partitions scenario a: 40 s, or a
    join timeout). Ours record the same events (same names, after the class) without it."""
    import inspect
    import sys

    stacks: list[int] = []

    def counted_stack(context: int = 1) -> Any:  # inspect.stack(), counted
        stacks.append(1)
        return inspect.getouterframes(sys._getframe(1), context)

    events: list[tuple[str, str]] = []

    def record(**kw: Any) -> None:
        cls, _, method = kw["name"].partition(".")
        events.append((method, kw["message"].split("'")[0]))

    import etcd_rdzv.dynamic.state as ours_state

    for module in (dr, ours_state):  # ours record through state.record_event
        monkeypatch.setattr(module, "construct_and_record_rdzv_event", lambda **kw: record(**kw))
    monkeypatch.setattr(inspect, "stack", counted_stack)
    run = Run(kind, clock, memory_run(), (2, 2))
    n0, n1 = run.node("n0"), run.node("n1")
    try:
        n0.join()
        n1.join()
        run.drive()
        assert (n0.world, n1.world) == ((0, 2), (1, 2))
        clock.advance(6)
        run.heartbeat("n0", "n1")
    finally:
        run.close()
    named = {method for method, _ in events}
    assert {"_add_to_participants", "_keep_alive", "_mark_rendezvous_complete", "next_rendezvous", "run"} <= named
    assert "_record" not in named
    assert bool(stacks) == (kind is TORCH)
