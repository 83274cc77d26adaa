"""Where one ``etcd-v3`` node stands in the rounds: the join it holds, the round it is a member of.

:class:`Standing` is the bookkeeping a :class:`~etcd_rdzv.native.rounds.Participant` holds
and updates as its joins and waits end: the join key it holds (:class:`Joined`), a join
Txn sent whose answer is not recorded yet, the round it is a member of (its size, its
rank, the revision that sealed it, rank 0's address) and the value of its latest join
key. It makes the :class:`RoundResult` of an admission and the :class:`Prior` group a
rendezvous leaves. No I/O, no clock, no lock (one rendezvous at a time; ``forget`` may
race it, as the participant's ``stop`` always could).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .records import Sealed

__all__ = ["Joined", "Prior", "RoundResult", "Standing"]


@dataclass(frozen=True)
class RoundResult:
    """The outcome of the barrier for one node: its place in a sealed round.

    ``seal_revision`` is the revision at which the round was sealed (the same
    for every member; 0 when it was learnt from the members record).
    """

    round: int
    rank: int
    world_size: int
    seal_revision: int
    node_id: str


@dataclass(frozen=True)
class Joined:
    """The join key this node holds in ``round``.

    ``member``: True (member of the sealed round), False (the round was sealed
    without us: over ``max_nodes`` or void), None (not known: still waiting, or
    the wait ended with an error before the outcome was seen).
    """

    round: int
    key: bytes
    under: Sealed  # the sealed record the join was fenced on (round - 1 sealed at its revision)
    member: bool | None = None


@dataclass(frozen=True)
class Prior:
    """The group a node leaves at a rendezvous: its round (None: none) and size (read only with
    a round), and whether this node observes it for dead members
    (:func:`~etcd_rdzv.native.eviction.observes`)."""

    round: int | None
    world: int
    evicts: bool


@dataclass
class Standing:
    """One node's place in the rounds (see the module docstring).

    ``joined``: the join key it holds; ``joining``: a join Txn sent whose answer is not
    recorded yet (a leave at exit withdraws it too); ``member_round``/``member_world``/
    ``member_rank``: the round it is a member of, its size and our rank; ``member_seal``:
    the revision that sealed it (0: not known); ``round_master``: rank 0's address from
    that round's sealed record; ``join_value``: the value of our latest join key.
    """

    joined: Joined | None = None
    joining: Joined | None = None
    member_round: int | None = None
    member_world: int = 0
    member_rank: int = 0
    member_seal: int = 0
    round_master: tuple[str, int] | None = None
    join_value: bytes = b""

    def begin(self, value: bytes, observes: bool) -> Prior:
        """A rendezvous starts with join value ``value``: forget the round we were a member of
        (returned: a round that only re-forms that group may skip the last call, and its
        observers evict its dead; ``observes``: whether our rank in it makes us one,
        :func:`~etcd_rdzv.native.eviction.observes`); take up a join of the last call that
        ended in an error (it may have applied)."""
        prior = Prior(self.member_round, self.member_world, self.member_round is not None and observes)
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
        """The joins a leave withdraws: the one in flight, then the recorded one, unless we are
        a member of its round (a signal may end the process between a join Txn and the
        recording of its answer, so that the key exists though ``joined`` does not name it)."""
        return [j for j in (self.joining, self.joined) if j is not None and not j.member]

    def forget(self) -> None:
        """Stopped for good: no join, no round."""
        self.joined = self.joining = None
        self.member_round = None
