"""``shutdown()``'s decision: close the run on a normal end, only leave it on a failure (issue 30)."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from etcd_rdzv.ending import Ending, decide, exception_in_flight


def _child_failed() -> ChildFailedError:
    """What torch's launch_agent raises when the workers failed and the restarts ran out."""
    return ChildFailedError("train.py", {0: ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="")})


def test_no_exception_in_flight_closes() -> None:
    assert decide(None) is Ending.CLOSE


@pytest.mark.parametrize("error", [
    _child_failed(),  # restarts exhausted: launch_agent raises it in its try
    RendezvousTimeoutError("join timed out"),
    RuntimeError("DistStoreError: barrier timed out"),  # torch's _assign_worker_ranks
    KeyboardInterrupt(),
    SystemExit(1),
])  # fmt: skip
def test_an_exception_in_flight_leaves(error: BaseException) -> None:
    assert decide(error) is Ending.LEAVE


def test_a_lost_etcd_leaves_even_on_a_normal_end() -> None:
    assert decide(None, etcd_lost=True) is Ending.LEAVE


def _launch_agent(fail: bool) -> tuple[BaseException | None, list[BaseException | None]]:
    """torch's launch_agent shape: ``shutdown()`` in a ``finally`` after ``agent.run()``."""
    seen: list[BaseException | None] = []

    def shutdown() -> None:  # a function called from the finally, as rdzv_handler.shutdown() is
        seen.append(exception_in_flight())

    error = _child_failed()
    try:
        try:
            if fail:
                raise error
        finally:
            shutdown()
    except ChildFailedError:
        pass
    return error, seen


def test_exception_in_flight_sees_what_a_finally_propagates() -> None:
    error, seen = _launch_agent(fail=True)
    assert seen == [error]
    assert decide(seen[0]) is Ending.LEAVE


def test_exception_in_flight_is_none_on_a_normal_end() -> None:
    _, seen = _launch_agent(fail=False)
    assert seen == [None]
    assert decide(seen[0]) is Ending.CLOSE
    assert exception_in_flight() is None


def test_exception_in_flight_sees_a_handled_exception() -> None:
    try:
        raise ValueError("x")
    except ValueError as e:
        assert exception_in_flight() is e
