"""Teardown shared by the in-process handler harnesses of the integration tests."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure


def shut_down_all(handlers: Iterable[Any], pool: ThreadPoolExecutor) -> None:
    """``shutdown()`` every handler (best effort: a test's failure is already reported), then
    stop the pool that ran their rendezvous calls, cancelling what had not started."""
    for h in handlers:
        try:
            h.shutdown()
        except Exception:
            pass
    pool.shutdown(wait=True, cancel_futures=True)


def shutdown_failing(handler: Any) -> Any:
    """``handler.shutdown()`` as torch's ``launch_agent`` calls it when its agent failed: in the
    ``finally`` after ``agent.run()`` while ``ChildFailedError`` (restarts exhausted) propagates.
    Returns what ``shutdown()`` returned."""
    returned: list[Any] = []
    failure = ChildFailedError("train.py", {0: ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="")})
    with pytest.raises(ChildFailedError):
        try:
            raise failure
        finally:
            returned.append(handler.shutdown())
    return returned[0]
