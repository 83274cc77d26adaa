"""Whether a running ``etcd-v3`` group is intact: ``num_nodes_waiting()``, and re-attach after an outage.

torch's agent calls ``num_nodes_waiting()`` every monitor interval while its workers are healthy and
restarts them (a new round) when it is positive; it never calls ``is_closed()``. :class:`GroupCheck`
answers it for one node with one read-only Txn (:func:`~etcd_rdzv.native.queries.count_waiting`);
:func:`nodes_waiting` is the pure decision on what that read found (no RPC, no clock of its own).

A closed run answers 0, as torch's handlers do: torchrun's ``shutdown()`` closes the run at the normal
end of each agent's job, and a node whose job runs longer (rank 0 writing a final checkpoint) must keep
its workers; no new round can form anyway, and a later ``next_rendezvous`` raises
``RendezvousClosedError``. The operator's stop (``etcd-rdzv close``, or ``set_closed()`` from outside the job:
:func:`~etcd_rdzv.native.protocol.abort`) also writes the abort mark, and then the answer is positive for every node: each agent stops its
workers and learns from ``next_rendezvous`` that the run is over.

A member's liveness is its join key, bound to its lease. When etcd was out of reach for longer than
the lease TTL, etcd expired every lease meanwhile although no node died. So:

* a member whose own key is gone (or whose lease session ended) **re-attaches**: a new lease and one
  Txn putting its key back, fenced on "our round is still the last sealed one and the run is open"
  (:meth:`~etcd_rdzv.native.rounds.Participant.reattach`). If that fails, a round was sealed without
  it, or the run closed: its group is over (positive answer);
* after such a sign of an outage (this node re-attached, or etcd took longer than a keep-alive
  interval, a third of the TTL, to answer the read), members missing from the round are given
  ``read_timeout + heartbeat`` (the client's timeout plus the lease TTL, :meth:`GroupCheck.grace`)
  to re-attach before they count as lost, unless a node already waits in the next round. A live
  member re-attaches at its first poll that etcd answers; the poll it had in flight during the
  outage is answered within the client's timeout, or fails, and then its agent fails too. Without
  such a sign a missing member counts at once, as before. (The sign needs a poll in flight during
  the outage, which torch's agent has while its monitor interval, 0.1 s by default, is shorter than
  the outage; an outage that expires leases lasts at least two thirds of the TTL.)

Blocks: one read Txn; after an outage one LeaseGrant and one Txn more; each bounded by the client's
timeout. Raises :class:`~etcd_store.errors.EtcdError` subclasses (the handler translates them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from etcd_store.client import EtcdClient

from . import queries
from .keys import RunKeys
from .queries import Occupancy
from .rounds import Participant
from .settings import V3Settings

log = logging.getLogger(__name__)

__all__ = ["Group", "GroupCheck", "nodes_waiting"]


@dataclass(frozen=True)
class Group:
    """This node's group as :func:`nodes_waiting` sees it: ``world`` members (0: not a member of
    the last sealed round), ``lease_ok`` (its own key and lease were intact, or it re-attached),
    ``tolerate_until``: until when missing members are assumed to be re-attaching (monotonic)."""

    world: int = 0
    lease_ok: bool = True
    tolerate_until: float = 0.0


def nodes_waiting(occ: Occupancy, group: Group, max_nodes: int, now: float) -> int:
    """The answer of ``num_nodes_waiting()`` for what a node read (see the module docstring).

    * at least 1 once the run is aborted (the agent stops its workers, then learns from
      ``next_rendezvous`` that the run is closed);
    * 0 once the run is closed (no round can form any more: healthy workers run on, whoever
      left the round);
    * for a member: at least 1 when it could not keep its place (``lease_ok`` False), or its
      round is short of its world size and somebody waits in the next round or the grace is
      over; else 0 while the round is full (torch's redundancy list);
    * otherwise the number of nodes joined in the next round.
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


class GroupCheck:
    """``num_nodes_waiting()`` of one node (see the module docstring); one call at a time."""

    def __init__(
        self, settings: V3Settings, client: EtcdClient, keys: RunKeys, node: Participant, node_id: str,
        on_member_lost: Callable[[int, int, int], None] | None = None,
    ) -> None:
        """``on_member_lost(round, active, world)`` is called when the answer is positive
        because members of our round are gone (telemetry; it must not raise)."""
        self._settings = settings
        self._on_member_lost = on_member_lost
        self._node_id = node_id
        self._client = client
        self._keys = keys
        self._node = node
        self._tolerate_until = 0.0
        self._tolerated_round: int | None = None
        self._cannot_reattach: int | None = None  # a round whose re-attach failed: the group is over

    @property
    def grace(self) -> float:
        """Seconds that members missing after an outage have to re-attach (see the module docstring)."""
        return self._client.timeout + self._settings.lease_ttl

    def nodes_waiting(self) -> int:
        node, s = self._node, self._settings
        member_round = node.standing.member_round
        started = time.monotonic()
        if member_round is None:
            round_ = queries.read_meta(self._client, self._keys).sealed.round
            occ = queries.count_waiting(self._client, self._keys, round_)
            return nodes_waiting(occ, Group(), s.max_nodes, time.monotonic())
        occ = queries.count_waiting(
            self._client, self._keys, member_round, node_key=self._keys.join_key(member_round, self._node_id)
        )
        now = time.monotonic()
        if self._tolerated_round != member_round:  # a new group: forget an older outage
            self._tolerated_round, self._tolerate_until = member_round, 0.0
        outage = now - started > s.lease_ttl / 3.0  # etcd did not answer for a keep-alive interval
        lease_ok = True
        session = node.session
        if not occ.closed and (not occ.mine or session is None or session.done().is_set()):
            reattached = None if self._cannot_reattach == member_round else node.reattach()
            lease_ok, outage = reattached is not None, True
            if reattached is None:
                self._cannot_reattach = member_round  # no second LeaseGrant for a group that is over
            else:
                occ = reattached
            now = time.monotonic()
        if outage:
            self._tolerate_until = max(self._tolerate_until, now + self.grace)
        group = Group(node.standing.member_world, lease_ok, self._tolerate_until)
        answer = nodes_waiting(occ, group, s.max_nodes, now)
        if answer > 0 and not occ.closed and occ.active < group.world and self._on_member_lost:
            self._on_member_lost(member_round, occ.active, group.world)
        if outage and answer == 0 and occ.active < group.world:
            log.warning("node %s: %d of the %d members of round %d hold their key after etcd was out "
                        "of reach; the others have %.1f s to re-attach", self._node_id, occ.active,
                        group.world, member_round, self._tolerate_until - now)
        return answer
