"""The pure decision of ``num_nodes_waiting()`` (etcd_rdzv.native.barrier.nodes_waiting): no etcd."""

from __future__ import annotations

import pytest

from etcd_rdzv.native.barrier import Group, nodes_waiting
from etcd_rdzv.native.protocol import Occupancy

MAX = 4
NOW = 100.0


def occ(waiting: int, active: int, closed: bool = False, aborted: bool = False) -> Occupancy:
    return Occupancy(waiting, active, closed or aborted, True, aborted=aborted)


@pytest.mark.parametrize(
    ("o", "group", "want"),
    [
        (occ(0, 3), Group(3), 0),  # intact
        (occ(0, 2), Group(3), 1),  # a member is gone, no outage seen: at once
        (occ(0, 2), Group(3, tolerate_until=NOW + 5), 0),  # after an outage: it may re-attach
        (occ(0, 2), Group(3, tolerate_until=NOW), 1),  # the grace is over
        (occ(2, 2), Group(3, tolerate_until=NOW + 5), 2),  # somebody waits in the next round: at once
        (occ(0, 3), Group(3, lease_ok=False), 1),  # could not re-attach: the group is over
        # closed (a peer's shutdown() at the end of its job): healthy workers run on, as with
        # torch's handlers, also when the others left the round or a node waits
        (occ(0, 3, closed=True), Group(3), 0),
        (occ(0, 1, closed=True), Group(3), 0),
        (occ(2, 3, closed=True), Group(3), 0),
        (occ(0, 1, closed=True), Group(3, lease_ok=False), 0),
        (occ(0, 0, closed=True), Group(), 0),
        # aborted (etcd-rdzv close): every agent stops its workers now
        (occ(0, 3, aborted=True), Group(3), 1),
        (occ(2, 3, aborted=True), Group(3), 2),
        (occ(0, 0, aborted=True), Group(), 1),
        (occ(1, 3), Group(3), 1),  # a newcomer, room in the round (max 4)
        (occ(1, 4), Group(4), 0),  # a newcomer, the round is full: redundancy list
        (occ(2, 1), Group(), 2),  # not a member: the joiners of the next round
    ],
)
def test_nodes_waiting(o: Occupancy, group: Group, want: int) -> None:
    assert nodes_waiting(o, group, MAX, NOW) == want
