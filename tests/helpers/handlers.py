"""Teardown shared by the in-process handler harnesses of the integration tests."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def shut_down_all(handlers: Iterable[Any], pool: ThreadPoolExecutor) -> None:
    """``shutdown()`` every handler (best effort: a test's failure is already reported), then
    stop the pool that ran their rendezvous calls, cancelling what had not started."""
    for h in handlers:
        try:
            h.shutdown()
        except Exception:
            pass
    pool.shutdown(wait=True, cancel_futures=True)
