"""Where an ``etcd-v3`` node stands (:class:`etcd_rdzv.native.barrier.Standing`), without etcd."""

from __future__ import annotations

from etcd_rdzv.native.barrier import Joined, PreviousGroup, RoundResult, Standing
from etcd_rdzv.native.records import Sealed


def test_an_admission_is_remembered_and_the_next_rendezvous_leaves_it() -> None:
    st = Standing(joined=Joined(3, b"k3", Sealed(round=2, revision=7)))
    sealed = Sealed(round=3, revision=12, master=("h", 29500))
    assert st.admit(3, 0, 2, sealed, "me") == RoundResult(3, 0, 2, 12, "me")
    assert (st.member_round, st.member_world, st.member_rank, st.member_seal) == (3, 2, 0, 12)
    assert st.round_master == ("h", 29500)
    prior = st.begin(b"v2", observes=True)
    assert prior == PreviousGroup(3, 2, evicts=True)
    assert (st.member_round, st.member_seal, st.round_master, st.join_value) == (None, 0, None, b"v2")
    again = st.begin(b"v3", observes=True)  # no group left this time
    assert (again.round, again.evicts) == (None, False)


def test_a_join_in_flight_is_taken_up_and_withdrawn_at_a_leave() -> None:
    """A join Txn whose answer was never recorded (an error, a signal) may have applied: the
    next rendezvous takes it up as its join, and a leave withdraws it; a member's join is kept."""
    first, second = Joined(1, b"k1", Sealed()), Joined(2, b"k2", Sealed(round=1, revision=3))
    st = Standing(joined=first, joining=second)
    assert st.pending() == [second, first]
    st.begin(b"v", observes=False)
    assert (st.joined, st.joining) == (second, None)
    st.mark_joined(True)
    assert st.pending() == []
    st.mark_joined(False)
    assert st.pending() == [Joined(2, b"k2", Sealed(round=1, revision=3), member=False)]
    st.forget()
    assert (st.joined, st.joining, st.member_round) == (None, None, None)
