"""The start of a sealed etcd-v3 round (etcd_rdzv/native/start.py): the pure decision of each member."""

from __future__ import annotations

from etcd_rdzv.native.start import GO, VOID, Fate, StartRead, decide


def read(acks: int, present: int, start: bytes | None = None, mine: bool = True, acked: bool = True,
         aborted: bool = False) -> StartRead:
    return StartRead(revision=10, acks=acks, present=present, start=start, mine=mine, acked=acked,
                     aborted=aborted)


def test_a_decided_fate_wins_over_any_count() -> None:
    assert decide(read(0, 0, GO, mine=False), 3) is Fate.STARTED  # we acked, then our lease ended
    assert decide(read(3, 3, VOID), 3) is Fate.VOIDED


def test_go_without_our_ack_is_not_ours() -> None:
    """Identity by etcd: a node whose key the seal did not name (evicted before the seal, and then a
    round of others sealed with its old sequence number) never acked, so a go is the others' round.
    Before: STARTED, and two nodes took rank 0 of the same round."""
    assert decide(read(2, 2, GO, mine=False, acked=False), 2) is Fate.OUT
    assert decide(read(2, 2, mine=False, acked=False), 2) is Fate.OUT  # every member acked, not us


def test_an_abort_ends_the_start_wait() -> None:
    """etcd-rdzv close during the start barrier: the wait ends at the abort's event, whatever the counts
    (before: the watch did not cover ctl/, and a member waited out the dead member's TTL)."""
    assert decide(read(1, 3, aborted=True), 3) is Fate.ABORTED
    assert decide(read(3, 3, GO, aborted=True), 3) is Fate.ABORTED


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
    """The start wait watches ``[ctl/, join/T+1/)``: the fate's copy, an abort and the round's join keys;
    the acks and the newcomers of ``T + 1`` sort outside it, so a round of W members costs each of them
    one event (the fate), not W, nor one per newcomer or overflow joiner's join of ``T + 1``."""
    from etcd_rdzv.native.records import RunKeys

    keys = RunKeys.for_run("/torchelastic/p2p", "job")
    lo, hi = keys.start_watch_range(7)
    assert lo <= keys.join_key(7, "n1") < hi and lo <= keys.fate < hi and lo <= keys.abort < hi
    assert not lo <= keys.ack(7, "n1") < hi
    assert not lo <= keys.join_key(8, "n1") < hi and not lo <= keys.start(7) < hi
    assert keys.ack(7, "n1").startswith(keys.round_prefix(7))  # removed with its round
