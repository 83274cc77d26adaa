"""The decision of the ``etcd-v3`` wait loop: pure functions over explicit state.

A node that joined round ``T`` waits on its watch of ``ctl/`` until ``T`` is
sealed, and seals it itself when due. What it knows of the round is a
:class:`Tally` (taken from its :class:`~etcd_rdzv.native.view.RoundView`);
what it remembers between two looks is a :class:`Barrier`. :func:`decide` maps
``(barrier, tally, settings, now)`` to the next barrier and one action:

* :class:`Seal`: try the seal transaction now (the loop then records the outcome
  with :meth:`Barrier.sealed`);
* :class:`TimeOut`: ``join_timeout`` passed; withdraw (if the round is still
  unsealed) and raise, or, if it was sealed meanwhile, :meth:`Barrier.timing_out`
  and wait for the sealed event;
* :class:`WaitUntil`: wait for the next watch event, at most until ``at``
  (``None``: no deadline).

When the sealed event of ``T`` arrives, :func:`verdict` says what it means for
this node: :class:`Admitted` (rank, world size), :class:`Void` (fewer than
``min_nodes`` joiners were left at the seal revision) or :class:`Overflow`
(sealed with ``max_nodes`` joiners that came before us).

Nothing here reads a clock, contacts etcd, logs or raises: the handler
(:mod:`etcd_rdzv.native.handler`) acts, this module decides. Safety does not
depend on these decisions (every seal is a fenced transaction, see
:mod:`etcd_rdzv.native.protocol`); they decide *when* a node tries, so that a
round is sealed about once, soon after it is due.

When a round is due: the previous round is vacated, ``min_nodes`` joined, and
either ``max_nodes`` joined, or ``last_call_timeout`` passed since the barrier
was first met, or (``fast_recovery``: ``recover_size`` is the size of the group
this node left) the round has no more joiners than that group had.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Protocol

log = logging.getLogger(__name__)

__all__ = [
    "SEAL_BACKUP_DELAY",
    "Action",
    "Admitted",
    "Barrier",
    "JoinClock",
    "Overflow",
    "Seal",
    "Tally",
    "TimeOut",
    "Void",
    "WaitUntil",
    "decide",
    "verdict",
]

SEAL_BACKUP_DELAY = 1.0
"""Seconds between seal attempts by position: once the round is ready, the first
joiner tries at once, the k-th joiner after ``k * SEAL_BACKUP_DELAY`` (it stands
in for earlier joiners that are alive but slow; a dead one's key is gone, which
moves everyone up a place at once). This keeps a round at about one seal
transaction, not one per node, even when the first joiner lags behind.

One exception: the node whose join filled the round (its join answer showed
``max_nodes`` joiners and the previous round empty) seals at once, from that
answer, before any watch event; the others then stand in one place later. It is
the only node that knows the round is full without first reading every other
join from its watch, which at hundreds of nodes takes longer than the seal."""


class Rules(Protocol):
    """The settings :func:`decide` reads (``NativeSettings`` has them)."""

    @property
    def min_nodes(self) -> int: ...

    @property
    def max_nodes(self) -> int: ...

    @property
    def last_call_timeout(self) -> float: ...


@dataclass(frozen=True)
class Tally:
    """What this node's watch shows of its round.

    ``count``: join keys of the round, ours included; ``before``: those created
    before ours (our rank if sealed now); ``prev_count``: join keys left in the
    previous round; ``changes``: how many join events of either round were seen.
    """

    count: int
    before: int
    prev_count: int
    changes: int = 0

    @property
    def vacated(self) -> bool:
        """Whether no node remains in the previous round (so this one may be sealed)."""
        return self.prev_count <= 0

    def kept_out(self, rules: Rules) -> bool:
        """Whether a full previous group keeps this round from forming (torch's redundancy list)."""
        return self.prev_count >= rules.max_nodes


@dataclass(frozen=True)
class JoinClock:
    """The ``join_timeout`` deadline of one ``next_rendezvous``, across the rounds it joins.

    Suspended while a full group runs (torch's redundancy list); resuming starts
    a full ``seconds`` again.
    """

    seconds: float
    at: float
    suspended: bool = False

    @classmethod
    def start(cls, seconds: float, now: float) -> JoinClock:
        return cls(seconds, now + seconds)

    def suspend(self, flag: bool, now: float) -> JoinClock:
        if flag == self.suspended:
            return self
        return replace(self, suspended=flag, at=self.at if flag else now + self.seconds)

    def expired(self, now: float) -> bool:
        return not self.suspended and now >= self.at


@dataclass(frozen=True)
class Barrier:
    """What the wait loop remembers between two looks at its round.

    ``last_call_at``: when the last call ends (set when ``min_nodes`` joined and the
    previous round is vacated; cleared when that stops holding); ``ready_since``:
    since when the round is due; ``tried_at_change``: the ``Tally.changes`` of our
    last seal attempt (no second attempt on an unchanged view); ``sealed_by_me``:
    our seal transaction succeeded; ``timing_out``: ``join_timeout`` passed but the
    round was sealed before we could withdraw; ``filled_it``: our own join filled
    the round (we seal first, see :data:`SEAL_BACKUP_DELAY`).
    """

    clock: JoinClock
    recover_size: int | None = None
    filled_it: bool = False
    last_call_at: float | None = None
    ready_since: float | None = None
    tried_at_change: int = -1
    sealed_by_me: bool = False
    timing_out: bool = False

    @classmethod
    def start(
        cls, clock: JoinClock, tally: Tally, rules: Rules, recover_size: int | None = None
    ) -> Barrier:
        """The state right after our join, whose answer gave ``tally``."""
        return cls(clock, recover_size, filled_it=tally.vacated and tally.count >= rules.max_nodes)

    def sealed(self, ok: bool) -> Barrier:
        """After a seal attempt: ``ok`` when our transaction sealed the round."""
        return replace(self, sealed_by_me=ok)

    def timed_out_late(self) -> Barrier:
        """``join_timeout`` passed, but the round was sealed first: await its event."""
        return replace(self, timing_out=True)


@dataclass(frozen=True)
class Seal:
    """Try the seal transaction now."""


@dataclass(frozen=True)
class TimeOut:
    """``join_timeout`` passed while the round was not sealed."""


@dataclass(frozen=True)
class WaitUntil:
    """Wait for watch events until ``at`` (monotonic seconds; ``None``: no deadline)."""

    at: float | None


Action = Seal | TimeOut | WaitUntil


def _seal_at(state: Barrier, tally: Tally, rules: Rules) -> float | None:
    """When this node should try to seal (None: not now, nor at a known time)."""
    if state.ready_since is None or state.sealed_by_me or state.tried_at_change == tally.changes:
        return None
    place = tally.before
    if state.filled_it:
        place = 0
    elif tally.count >= rules.max_nodes:
        place += 1  # the node that filled the round seals first
    return state.ready_since + place * SEAL_BACKUP_DELAY


def decide(state: Barrier, tally: Tally, rules: Rules, now: float) -> tuple[Barrier, Action]:
    """The next state and action of the wait loop (see the module docstring)."""
    barrier = tally.vacated and tally.count >= rules.min_nodes
    if not barrier:
        last_call_at = None
    elif state.last_call_at is None:
        last_call_at = now + rules.last_call_timeout
    else:
        last_call_at = state.last_call_at
    ready = barrier and (
        tally.count >= rules.max_nodes
        or (state.recover_size is not None and tally.count <= state.recover_size)
        or (last_call_at is not None and now >= last_call_at)
    )
    ready_since = (now if state.ready_since is None else state.ready_since) if ready else None
    state = replace(state, last_call_at=last_call_at, ready_since=ready_since)

    seal_at = _seal_at(state, tally, rules)
    if seal_at is not None and now >= seal_at:
        return replace(state, tried_at_change=tally.changes), Seal()

    clock = state.clock.suspend(tally.kept_out(rules), now)
    state = replace(state, clock=clock)
    if clock.expired(now) and not state.timing_out:
        return state, TimeOut()

    wake = [t for t in (None if ready else last_call_at, seal_at) if t is not None]
    if not clock.suspended and not state.timing_out:
        wake.append(clock.at)
    return state, WaitUntil(min(wake) if wake else None)


@dataclass(frozen=True)
class Admitted:
    """This node is rank ``rank`` of a group of ``world_size``."""

    rank: int
    world_size: int


@dataclass(frozen=True)
class Void:
    """The round was sealed with fewer than ``min_nodes`` joiners: it forms no group."""

    world_size: int


@dataclass(frozen=True)
class Overflow:
    """The round was sealed with ``max_nodes`` joiners that came before this node."""


def verdict(tally: Tally, rules: Rules) -> Admitted | Void | Overflow:
    """What the sealed event of our round means for us; ``tally`` as of the seal revision."""
    world_size = min(tally.count, rules.max_nodes)
    if world_size < rules.min_nodes:
        return Void(world_size)
    if tally.before < rules.max_nodes:
        return Admitted(tally.before, world_size)
    return Overflow()
