"""The decision of the ``etcd-v3`` wait loop: pure functions over explicit state.

A node that joined round ``T`` waits on its watch until ``T`` is sealed, and seals it itself when
due. :func:`decide` maps ``(Barrier, JoinCounts, settings, now)`` to the next :class:`Barrier` and
one action: :class:`Check`, :class:`Seal`, :class:`TimeOut` or :class:`WaitUntil`. No clock, no
etcd, no logging, no raising: the loop (:mod:`etcd_rdzv.native.rounds`) acts. Safety does not
depend on these decisions (every seal is a fenced Txn, :mod:`etcd_rdzv.native.protocol`); they
decide *when* a node tries, so a round is sealed about once, soon after it is due.

**Candidates.** A node never sees the other joins of its round (that would be N events per node).
A joiner whose join answer showed at least ``min_nodes`` joiners is a seal *candidate*; the others
only wait for the sealed record. The latest joiner of any ``min_nodes`` present joiners saw all of
them, so whenever a seal could be due some present node is a candidate. A candidate that reads
fewer than ``min_nodes`` steps down (only a later joiner, itself a candidate, can raise the count).

A round is due when the previous round is vacated, ``min_nodes`` joined, and either ``max_nodes``
joined, ``last_call_timeout`` passed since the barrier was met, or (``fast_recovery``) it has no
more joiners than the group this node left. A candidate reads before it seals. The sealed record
then gives a :func:`verdict` (or :func:`resolved`, from the members record).

Also here: :func:`nodes_waiting`, ``num_nodes_waiting()``'s answer on what a member read, and
:class:`Standing`, a participant's bookkeeping of its joins and rounds (no lock: one rendezvous at
a time; ``forget`` may race it, as ``stop`` always could).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .protocol import Occupancy
    from .records import Membership, Sealed

__all__ = ["SEAL_BACKUP_DELAY", "Action", "Admitted", "Barrier", "Check", "Group", "JoinDeadline", "Joined", "Overflow",
           "PreviousGroup", "RoundResult", "Seal", "Standing", "JoinCounts", "TimeOut", "Undersized", "WaitUntil", "decide",
           "nodes_waiting", "resolved", "verdict"]

SEAL_BACKUP_DELAY = 1.0
"""Seconds between seal attempts by place: the candidate that saw ``min_nodes`` tries at once, the
one that saw ``min_nodes + k`` after ``k * SEAL_BACKUP_DELAY`` (standing in for slow earlier
ones), so a round costs about one seal Txn. Exception: a joiner whose own answer showed the round
due (previous round empty, and ``max_nodes`` joined or no more than its old group) tries at once:
it is the only node that knows."""


class Rules(Protocol):
    """The settings :func:`decide` reads (``V3Settings`` has them)."""

    @property
    def min_nodes(self) -> int: ...

    @property
    def max_nodes(self) -> int: ...

    @property
    def last_call_timeout(self) -> float: ...


@dataclass(frozen=True)
class JoinCounts:
    """What this node knows of its round.

    ``count``: join keys of the round, ours included; ``prev_count``: join keys left in the previous
    round; ``changes``: how often the view changed; ``fresh``: both come from a read with nothing seen
    since (a seal may use it).
    """

    count: int
    prev_count: int
    changes: int = 0
    fresh: bool = False

    @property
    def vacated(self) -> bool:
        """Whether no node remains in the previous round (so this one may be sealed)."""
        return self.prev_count <= 0

    def kept_out(self, rules: Rules) -> bool:
        """Whether a full previous group keeps this round from forming (torch's redundancy list)."""
        return self.prev_count >= rules.max_nodes


@dataclass(frozen=True)
class JoinDeadline:
    """The ``join_timeout`` deadline of one ``next_rendezvous``, across its rounds; suspended while a
    full group runs (torch's redundancy list), and a full ``seconds`` again on resuming."""

    seconds: float
    at: float
    suspended: bool = False

    @classmethod
    def start(cls, seconds: float, now: float) -> JoinDeadline:
        return cls(seconds, now + seconds)

    def suspend(self, flag: bool, now: float) -> JoinDeadline:
        if flag == self.suspended:
            return self
        return replace(self, suspended=flag, at=self.at if flag else now + self.seconds)

    def expired(self, now: float) -> bool:
        return not self.suspended and now >= self.at


@dataclass(frozen=True)
class Barrier:
    """What the wait loop remembers between two looks at its round.

    ``candidate``: see the module docstring; ``place``: our place in the seal order
    (:data:`SEAL_BACKUP_DELAY`); ``last_call_at``: when the last call ends (while ``min_nodes`` joined
    and the previous round is vacated); ``ready_since``: since when the round is due;
    ``tried_at_change``: ``JoinCounts.changes`` at our last check or seal (never twice on one view);
    ``settled``: sealed (or the run closed) by us or someone else, its event on the way;
    ``timing_out``: ``join_timeout`` passed but the round was sealed before we could withdraw.
    """

    clock: JoinDeadline
    recover_size: int | None = None
    candidate: bool = False
    place: int = 0
    last_call_at: float | None = None
    ready_since: float | None = None
    tried_at_change: int = -1
    settled: bool = False
    timing_out: bool = False

    @classmethod
    def start(
        cls, clock: JoinDeadline, counts: JoinCounts, rules: Rules, recover_size: int | None = None
    ) -> Barrier:
        """The state right after our join, whose answer gave ``counts``."""
        candidate = counts.count >= rules.min_nodes
        due_now = candidate and counts.vacated and (
            counts.count >= rules.max_nodes or (recover_size is not None and counts.count <= recover_size)
        )
        place = 0 if due_now else max(counts.count - rules.min_nodes, 0)
        return cls(clock, recover_size, candidate=candidate, place=place)

    def sealed(self, ok: bool) -> Barrier:
        """After a seal attempt: ``ok`` when our transaction sealed the round."""
        return replace(self, settled=self.settled or ok)

    def settle(self) -> Barrier:
        """A read showed the round sealed (or the run closed) by someone else."""
        return replace(self, settled=True)

    def timed_out_late(self) -> Barrier:
        """``join_timeout`` passed, but the round was sealed first: await its event."""
        return replace(self, timing_out=True)


@dataclass(frozen=True)
class Check:
    """Read the round now, then decide again."""


@dataclass(frozen=True)
class Seal:
    """Try the seal transaction now, with the read just taken."""


@dataclass(frozen=True)
class TimeOut:
    """``join_timeout`` passed while the round was not sealed."""


@dataclass(frozen=True)
class WaitUntil:
    """Wait for watch events until ``at`` (monotonic seconds; ``None``: no deadline)."""

    at: float | None


Action = Check | Seal | TimeOut | WaitUntil


def decide(state: Barrier, counts: JoinCounts, rules: Rules, now: float) -> tuple[Barrier, Action]:
    """The next state and action of the wait loop (see the module docstring)."""
    seal_at = None
    ready = False
    if state.candidate and not state.settled:
        barrier = counts.vacated and counts.count >= rules.min_nodes
        if not barrier:
            last_call_at = None
        elif state.last_call_at is None:
            last_call_at = now + rules.last_call_timeout
        else:
            last_call_at = state.last_call_at
        ready = barrier and (
            counts.count >= rules.max_nodes
            or (state.recover_size is not None and counts.count <= state.recover_size)
            or (last_call_at is not None and now >= last_call_at)
        )
        ready_since = (now if state.ready_since is None else state.ready_since) if ready else None
        state = replace(state, last_call_at=last_call_at, ready_since=ready_since)
        if ready_since is not None and state.tried_at_change != counts.changes:
            seal_at = ready_since + state.place * SEAL_BACKUP_DELAY
            if now >= seal_at:
                return replace(state, tried_at_change=counts.changes), Seal() if counts.fresh else Check()

    clock = state.clock.suspend(counts.kept_out(rules), now)
    state = replace(state, clock=clock)
    if clock.expired(now) and not state.timing_out:
        return state, TimeOut()

    trying = state.candidate and not state.settled
    wake = [t for t in (None if ready or not trying else state.last_call_at, seal_at) if t is not None]
    if not clock.suspended and not state.timing_out:
        wake.append(clock.at)
    return state, WaitUntil(min(wake) if wake else None)


@dataclass(frozen=True)
class Admitted:
    """This node is rank ``rank`` of a group of ``world_size``."""

    rank: int
    world_size: int


@dataclass(frozen=True)
class Undersized:
    """The round was sealed with fewer than ``min_nodes`` joiners: it forms no group."""

    world_size: int


@dataclass(frozen=True)
class Overflow:
    """The round was sealed without this node (``max_nodes`` came first, or it had left at the read)."""


def resolved(members: Sequence[str] | None, node_id: str, round_: int, sealed_round: int,
             rules: Rules) -> Admitted | None:
    """Our place in ``round_`` from its members record, after the wait ended without its outcome (a
    compacted watch history, a lost join answer); None if we are no member.

    Only while ``round_`` is the last sealed round: a later seal means our key was gone by then and
    the group re-formed without us. A record naming fewer than ``min_nodes`` is void.
    """
    if sealed_round != round_ or members is None or len(members) < rules.min_nodes:
        return None
    if node_id not in members:
        return None
    return Admitted(list(members).index(node_id), len(members))


def verdict(membership: Membership, seq: int, create_revision: int, rules: Rules) -> Admitted | Undersized | Overflow:
    """What the sealed record of our round means for us (``seq``, ``create_revision``: our join's)."""
    if membership.world < rules.min_nodes:
        return Undersized(membership.world)
    rank = membership.rank_of(seq, create_revision)
    return Overflow() if rank is None else Admitted(rank, membership.world)



# --------------------------------------------------------------------------- whether a running group is intact


@dataclass(frozen=True)
class Group:
    """This node's group for :func:`nodes_waiting`: ``world`` members (0: not a member of the last
    sealed round), ``lease_ok`` (own key and lease intact, or re-attached), ``tolerate_until``
    (monotonic): until when missing members are assumed to be re-attaching."""

    world: int = 0
    lease_ok: bool = True
    tolerate_until: float = 0.0


def nodes_waiting(occ: Occupancy, group: Group, max_nodes: int, now: float) -> int:
    """``num_nodes_waiting()`` for what a node read (pure).

    At least 1 once the run is aborted; 0 once it is closed (no round can form; healthy workers run
    on). For a member: at least 1 when it lost its place (``lease_ok`` False), or its round is short
    and somebody waits in the next round or the grace is over; else 0 while the round is full
    (torch's redundancy list). Otherwise the number of nodes joined in the next round.
    """
    if occ.aborted:
        return max(occ.waiting, 1)
    if occ.closed:
        return 0
    if group.world:
        if not group.lease_ok:
            return max(occ.waiting, 1)
        if occ.active < group.world:
            if occ.waiting > 0 or now >= group.tolerate_until:
                return max(occ.waiting, 1)
            return 0
    return occ.waiting if occ.active < max_nodes else 0

# --------------------------------------------------------------------------- where a node stands


@dataclass(frozen=True)
class RoundResult:
    """One node's place in a sealed round; ``seal_revision`` is the same for every member (0 when
    learnt from the members record)."""

    round: int
    rank: int
    world_size: int
    seal_revision: int
    node_id: str


@dataclass(frozen=True)
class Joined:
    """The join key this node holds in ``round``; ``member``: True, False (sealed without us), or None
    (not known yet, or the wait failed before the outcome)."""

    round: int
    key: bytes
    under: Sealed  # the sealed record the join was fenced on (round - 1 sealed at its revision)
    member: bool | None = None
    created: int = 0  # the key's create revision (0: not known, e.g. a join whose answer was lost)


@dataclass(frozen=True)
class PreviousGroup:
    """The group a node leaves at a rendezvous: round (None: none), size, and whether this node
    observes it for dead members (:func:`~etcd_rdzv.native.leases.observes`)."""

    round: int | None
    world: int
    evicts: bool


@dataclass
class Standing:
    """One node's place in the rounds.

    ``joined``: the join key it holds; ``joining``: a join Txn whose answer is not recorded yet (a
    leave at exit withdraws it too); ``member_*``: the round it is a member of, its size, our rank and
    the revision that sealed it (0: unknown); ``round_master``: rank 0's address from that record;
    ``join_value``: our latest join key's value.
    """

    joined: Joined | None = None
    joining: Joined | None = None
    member_round: int | None = None
    member_world: int = 0
    member_rank: int = 0
    member_seal: int = 0
    round_master: tuple[str, int] | None = None
    join_value: bytes = b""

    def begin(self, value: bytes, observes: bool) -> PreviousGroup:
        """Start a rendezvous with join value ``value``: forget our round and return it (a round that only
        re-forms that group may skip the last call, and its observers evict its dead); take up a join of
        the last call that ended in an error (it may have applied)."""
        prior = PreviousGroup(self.member_round, self.member_world, self.member_round is not None and observes)
        self.member_round, self.member_seal = None, 0
        self.round_master = None
        self.join_value = value
        if self.joining is not None:
            self.joined, self.joining = self.joining, None
        return prior

    def admit(self, round_: int, rank: int, world_size: int, sealed: Sealed, node_id: str) -> RoundResult:
        """We are rank ``rank`` of ``round_``, sealed by ``sealed``: remember it; our result."""
        self.member_round, self.member_world = round_, world_size
        self.member_rank = rank
        self.member_seal = sealed.revision
        self.round_master = sealed.master
        return RoundResult(round_, rank, world_size, sealed.revision, node_id)

    def mark_joined(self, member: bool) -> None:
        """The outcome of the round our join key is in: a member of it, or sealed without us."""
        if self.joined is not None:
            self.joined = replace(self.joined, member=member)

    def pending(self) -> list[Joined]:
        """The joins a leave withdraws: the one in flight, then the recorded one, unless we are a member of
        its round (a signal may land between a join Txn and recording its answer)."""
        return [j for j in (self.joining, self.joined) if j is not None and not j.member]

    def forget(self) -> None:
        """Stopped for good: no join, no round."""
        self.joined = self.joining = None
        self.member_round = None
