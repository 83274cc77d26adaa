"""The start of a sealed etcd-v3 round (etcd_rdzv/native/start.py): the pure decision of each member."""

from __future__ import annotations

from etcd_rdzv.native.start import GO, VOID, Fate, StartRead, decide


def read(acks: int, present: int, start: bytes | None = None, mine: bool = True) -> StartRead:
    return StartRead(revision=10, acks=acks, present=present, start=start, mine=mine)


def test_a_decided_fate_wins_over_any_count() -> None:
    assert decide(read(0, 0, GO, mine=False), 3) is Fate.STARTED
    assert decide(read(3, 3, VOID), 3) is Fate.VOIDED


def test_every_ack_counted_means_go_even_if_a_member_left_since() -> None:
    """A member that acked and then died does not undo the round: all acked, so go (its death is then
    torch's ordinary failure, found by num_nodes_waiting())."""
    assert decide(read(3, 3), 3) is Fate.PUT_GO
    assert decide(read(3, 2), 3) is Fate.PUT_GO


def test_a_gone_key_before_every_ack_means_void() -> None:
    assert decide(read(2, 2), 3) is Fate.PUT_VOID  # a member's key went before it acked
    assert decide(read(1, 3, mine=False), 3) is Fate.PUT_VOID  # our own key went (lease lost)


def test_otherwise_wait() -> None:
    """Fewer acks than members and every key present: some member has not confirmed yet. Joiners beyond
    the members (a node kept out, still in the round's keys) do not make it go."""
    assert decide(read(2, 3), 3) is Fate.WAIT
    assert decide(read(2, 4), 3) is Fate.WAIT


def test_a_member_hears_the_fate_and_departures_not_every_ack() -> None:
    """The start wait watches ``[join/T/, rounds/T/start]``; the acks sort outside it, so a round of W
    members costs each of them one event (the fate), not W (before: B2's 4-node round delivered 6 events
    per waiting node, over its budget of 3)."""
    from etcd_rdzv.native.records import RunKeys

    keys = RunKeys.for_run("/torchelastic/p2p", "job")
    lo, hi = keys.join_prefix(7), keys.start(7) + b"\0"
    assert lo <= keys.join_key(7, "n1") < hi and lo <= keys.start(7) < hi
    assert not lo <= keys.ack(7, "n1") < hi
    assert keys.ack(7, "n1").startswith(keys.round_prefix(7))  # removed with its round
