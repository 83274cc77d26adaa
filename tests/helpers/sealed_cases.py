"""Cases A, B and C of issue 22 as timelines on :mod:`helpers.sealed_rounds`, for any backend.

Each case runs one run of one handler kind (torch's ``DynamicRendezvousHandler`` or
our ``EtcdRendezvousHandler``) from a fresh backend and returns an :class:`Outcome`:
what every node's join returned, the stored round, and what ``num_nodes_waiting()``
said afterwards. Times are seconds on the test's clock; torch's defaults apply
(heartbeat every 5 s, a node dead after 15 s; ours: a member dead after 16 s, :data:`EXPIRY`).
:func:`problems` names what is wrong with an outcome: nodes that disagree on
their round or world, or a node that trains in a round that no longer holds it
while nobody reports a waiting node (it is stuck for good).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from helpers.sealed_rounds import ATTEMPTS, KEEP_ALIVE_S, Clock, Run, stored_state

EXPIRY = KEEP_ALIVE_S * ATTEMPTS + 1
"""Seconds after its last heartbeat when our handler calls a sealed round's member dead
(``SealedRoundStateHolder.member_expiry``: torch's window plus the 1 s read cache)."""

Backends = Callable[[], Callable[[], RendezvousBackend]]
"""Returns the backend factory of a new run (each call: a new run)."""


@dataclass
class Outcome:
    worlds: dict[str, tuple[int, int] | None]  # (rank, world size) each join returned; None: still joining
    rounds: dict[str, int]  # the round each node holds
    stored_round: int
    stored: list[str]  # members of the stored round
    waiting: dict[str, int] = field(default_factory=dict)  # num_nodes_waiting() at the end

    @classmethod
    def of(cls, run: Run, *names: str, waiting: dict[str, int] | None = None) -> Outcome:
        state = stored_state(run.backend_factory())
        return cls(
            worlds={n: run[n].world for n in names},
            rounds={n: run[n].round for n in names},
            stored_round=state.round,
            stored=run.participants(),
            waiting=waiting or {},
        )


def problems(o: Outcome) -> list[str]:
    """What is wrong with ``o`` (``[]``: every node in one round of one world, none stuck)."""
    found = []
    joined = {n: w for n, w in o.worlds.items() if w is not None}
    if len({w[1] for w in joined.values()}) > 1:
        found.append(f"world sizes differ: {joined}")
    if len(set(o.rounds.values())) > 1:
        found.append(f"rounds differ: {o.rounds}")
    if len(joined) < len(o.worlds):
        found.append(f"still joining: {sorted(set(o.worlds) - set(joined))}")
    dropped = sorted(n for n in joined if o.rounds[n] != o.stored_round or n not in o.stored)
    if dropped and not any(o.waiting.values()):
        found.append(f"{dropped} train in a round that no longer holds them, none waiting: stuck")
    return found


def case_a(kind: type, clock: Clock, backends: Backends) -> Outcome:
    """``--nnodes=3:3``: n2's stored heartbeat ages while the round seals; n2 reads the
    sealed round in time, n0 reads it 0.4 s later (n2's heartbeat then 15.3 s old)."""
    clock.reset()
    run = Run(kind, clock, backends(), (3, 3))
    n0, n1, n2 = run.node("n0"), run.node("n1"), run.node("n2")
    n0.join()
    n2.join()  # t=0: both members of the forming round, heartbeats at 0
    clock.at(10)
    n0.step()  # n0's join loop refreshes its heartbeat; n2 is stalled (not stepped)
    clock.at(14.8)
    n1.join()  # the third member seals the round (max_nodes)
    clock.at(14.9)
    n2.step()  # n2 reads the sealed round
    clock.at(15.3)
    n0.step()  # n0 reads it
    clock.at(20.5)
    run.heartbeat("n0", "n1", "n2")  # the keep-alive timers fire
    clock.at(21.6)
    return Outcome.of(run, "n0", "n1", "n2", waiting=run.waiting("n0", "n1", "n2"))


def case_b(kind: type, clock: Clock, backends: Backends) -> Outcome:
    """``--nnodes=2:3``: the round seals at t=1; n0 reads it at t=2 and stalls 16 s before
    acting on it (no other write lands meanwhile), so every heartbeat looks old to it."""
    clock.reset()
    run = Run(kind, clock, backends(), (2, 3))
    n0, n1, n2 = run.node("n0"), run.node("n1"), run.node("n2")
    n0.join()
    n1.join()
    clock.at(1)
    n2.join()  # the third member seals the round (max_nodes)
    clock.at(2)
    n1.step()
    n0.backend.stall_next_read(16)
    n0.step()  # t=2 -> 18 between n0's read and its _sanitize
    clock.at(19.1)
    run.heartbeat("n1", "n2")
    clock.at(20.2)
    outcome = Outcome.of(run, "n0", "n1", "n2", waiting=run.waiting("n1", "n2"))
    run.close()
    return outcome


def _seal_three_then_lose_n2(run: Run, clock: Clock, until: float = 20) -> None:
    """n0, n1, n2 seal a round at t=1; n0 and n1 heartbeat every 5 s up to ``until``; n2 is dead
    (since t=1, its last heartbeat)."""
    n0, n1, n2 = run.node("n0"), run.node("n1"), run.node("n2")
    n0.join()
    n1.join()
    clock.at(1)
    n2.join()
    clock.at(2)
    n0.step()
    n1.step()
    for t in range(5, int(until) + 1, 5):
        clock.at(t)
        run.heartbeat("n0", "n1")


def _rejoin(run: Run, clock: Clock, t: float, *names: str) -> None:
    """The agents of ``names`` restart at ``t``: ``next_rendezvous`` until every join returned."""
    clock.at(t)
    for name in names:
        run[name].join()
    run.drive()


@dataclass
class CaseC:
    within_grace: dict[str, int]  # num_nodes_waiting() with n2 silent EXPIRY - 0.5 s
    dead: dict[str, int]  # ... silent EXPIRY + 0.6 s
    after: Outcome | None  # after the survivors re-rendezvoused (None: nobody reported a waiting node)


def case_c(kind: type, clock: Clock, backends: Backends) -> CaseC:
    """``--nnodes=2:3``, no replacement: member n2 of a sealed world-3 round dies. The
    survivors re-rendezvous if (and when) their ``num_nodes_waiting()`` turns positive."""
    clock.reset()
    run = Run(kind, clock, backends(), (2, 3))
    _seal_three_then_lose_n2(run, clock, until=EXPIRY)
    clock.at(1 + EXPIRY - 0.5)
    grace = run.waiting("n0", "n1")
    clock.at(1 + EXPIRY + 0.6)
    dead = run.waiting("n0", "n1")
    if not any(dead.values()):
        return CaseC(grace, dead, None)
    _rejoin(run, clock, 1 + EXPIRY + 1.7, "n0", "n1")
    return CaseC(grace, dead, Outcome.of(run, "n0", "n1"))


def case_c_early(kind: type, clock: Clock, backends: Backends) -> Outcome:
    """``--nnodes=2:3``: n2 of the sealed round dies at t=1 and the survivors' workers fail at
    once: both agents re-rendezvous at t=3, long before n2's heartbeat expires."""
    clock.reset()
    run = Run(kind, clock, backends(), (2, 3))
    n0, n1, n2 = run.node("n0"), run.node("n1"), run.node("n2")
    n0.join()
    n1.join()
    clock.at(1)
    n2.join()
    clock.at(2)
    n0.step()
    n1.step()
    _rejoin(run, clock, 3, "n0", "n1")
    return Outcome.of(run, "n0", "n1")


def case_c_replacement(kind: type, clock: Clock, backends: Backends) -> Outcome:
    """``--nnodes=3:3``: n2 of the sealed round dies, replacement r arrives at t=22.6; the
    survivors re-rendezvous once their ``num_nodes_waiting()`` is positive."""
    clock.reset()
    run = Run(kind, clock, backends(), (3, 3))
    _seal_three_then_lose_n2(run, clock)
    clock.at(22.6)
    run.node("r").join()
    clock.at(23.7)
    waiting = run.waiting("n0", "n1")
    if any(waiting.values()):
        _rejoin(run, clock, 24.8, "n0", "n1")
    outcome = Outcome.of(run, "n0", "n1", "r", waiting=waiting)
    run.close()
    return outcome


def case_removed(kind: type, clock: Clock, backends: Backends) -> dict[str, int]:
    """``--nnodes=2:2``: after the round sealed, another node's write removes n1's entry
    (as torch's ``_sanitize`` on a torch agent does); ``num_nodes_waiting()`` of both."""
    clock.reset()
    run = Run(kind, clock, backends(), (2, 2))
    n0, n1 = run.node("n0"), run.node("n1")
    n0.join()
    n1.join()
    clock.at(1.1)
    n0.step()
    backend = run.backend_factory()
    found = backend.get_state()
    assert found is not None
    state = pickle.loads(found[0])
    gone = next(n for n in state.participants if n.addr == "n1")
    del state.participants[gone], state.last_heartbeats[gone]
    assert backend.set_state(pickle.dumps(state), found[1]) is not None
    clock.at(2.2)
    return run.waiting("n0", "n1")


@dataclass
class FirstExit:
    round_after_exit: int  # the stored round right after the first survivor's exit
    waiting: dict[str, int]  # num_nodes_waiting() of the members still training then
    formed_at: float  # the clock when every join of the next round had returned
    after: Outcome


def case_first_exit(kind: type, clock: Clock, backends: Backends) -> FirstExit:
    """``--nnodes=2:3``: n2 of the sealed round dies at t=1; n0's workers fail and its agent
    re-rendezvouses at t=3; n1 (workers still training) re-rendezvouses once its
    ``num_nodes_waiting()`` is positive (else when n0 is in the wait list). Ours: n0's exit ends
    round 0, the next round forms after the last call; torch: only once n2's heartbeat expired."""
    clock.reset()
    run = Run(kind, clock, backends(), (2, 3))
    n0, n1, n2 = run.node("n0"), run.node("n1"), run.node("n2")
    n0.join()
    n1.join()
    clock.at(1)
    n2.join()
    clock.at(2)
    n0.step()
    n1.step()
    clock.at(3)
    n0.join()
    round_after = stored_state(run.backend_factory()).round
    clock.advance(1.1)
    waiting = run.waiting("n1")
    n1.join()
    run.drive()
    return FirstExit(round_after, waiting, clock.t, Outcome.of(run, "n0", "n1"))


def case_hot_spare(kind: type, clock: Clock, backends: Backends) -> FirstExit:
    """``--nnodes=2:2`` and a spare ``r`` in the redundancy list: n1 dies at t=2, n0's agent
    re-rendezvouses at t=3. Ours: n0's exit ends round 0, n0 and r fill round 1 (max_nodes, no
    last call) at once; torch: once n1's heartbeat expired."""
    clock.reset()
    run = Run(kind, clock, backends(), (2, 2))
    n0, n1 = run.node("n0"), run.node("n1")
    n0.join()
    n1.join()  # seals (max_nodes)
    clock.at(1.1)
    n0.step()
    clock.at(2)
    run.node("r").join()  # parks in the redundancy list
    clock.at(3)
    n0.join()
    round_after = stored_state(run.backend_factory()).round
    run.drive()
    outcome = Outcome.of(run, "n0", "r")
    return FirstExit(round_after, {}, clock.t, outcome)


def case_exit_before_a_member_read(kind: type, clock: Clock, backends: Backends) -> Outcome:
    """``--nnodes=2:3``: n2 seals round 0 at t=1 and n0 reads it at t=2; n1 has not read it yet
    when n0 re-rendezvouses at t=3. n1 must never train in round 0 once it ended: every node ends
    in one round of one world (n2 re-rendezvouses once its ``num_nodes_waiting()`` says so)."""
    clock.reset()
    run = Run(kind, clock, backends(), (2, 3))
    n0, n1, n2 = run.node("n0"), run.node("n1"), run.node("n2")
    n0.join()
    n1.join()
    clock.at(1)
    n2.join()
    clock.at(2)
    n0.step()
    clock.at(3)
    n0.join()  # its exit
    clock.advance(1.1)
    waiting = run.waiting("n2")
    if any(waiting.values()):
        n2.join()
    run.drive()
    outcome = Outcome.of(run, "n0", "n1", "n2", waiting=waiting)
    run.close()
    return outcome
