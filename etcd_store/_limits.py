"""Time and size limits of the store's requests: the store timeout as the parts read it,
deadlines, and batches that fit etcd's limits on one Txn.

Deadlines are ``time.monotonic()`` values; every RPC gets at least :data:`MIN_RPC_TIMEOUT`
seconds, even when a wait has less time left.
"""

from __future__ import annotations

import datetime
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch.distributed as dist

from .errors import EtcdTimeoutError

log = logging.getLogger(__name__)

#: etcd's default ``--max-txn-ops``.
MAX_TXN_OPS = 128
#: The shortest deadline given to one RPC, even when a wait has less time left.
MIN_RPC_TIMEOUT = 1.0
_T = TypeVar("_T")


class StoreTimeout:
    """The store timeout, read when used: torch keeps it (``set_timeout``), so it may change
    between two calls. ``read`` returns it; :meth:`of` reads a store's without keeping the
    store alive."""

    def __init__(self, read: Callable[[], datetime.timedelta]) -> None:
        self._read = read

    @classmethod
    def of(cls, store: dist.Store) -> StoreTimeout:
        ref = weakref.ref(store)

        def read() -> datetime.timedelta:
            owner = ref()
            assert owner is not None, "a part of a store outlived its store"
            timeout: datetime.timedelta = dist.Store.timeout.__get__(owner)  # type: ignore[attr-defined]
            return timeout

        return cls(read)

    def seconds(self) -> float:
        """The store timeout in seconds (how long a wait waits)."""
        return self._read().total_seconds()

    def rpc(self) -> float:
        """The deadline of a call that does not wait: the store timeout, at least :data:`MIN_RPC_TIMEOUT`."""
        return max(self.seconds(), MIN_RPC_TIMEOUT)


def budget(deadline: float) -> float:
    """The time left until ``deadline`` for one RPC, at least :data:`MIN_RPC_TIMEOUT`."""
    return max(deadline - time.monotonic(), MIN_RPC_TIMEOUT)


def check_deadline(deadline: float, what: str, seconds: float) -> None:
    """Raise :class:`EtcdTimeoutError` naming ``what`` once ``deadline`` (monotonic) passed."""
    if time.monotonic() >= deadline:
        raise EtcdTimeoutError(f"{what} did not complete within {seconds:g} s (the store timeout)")


def batches(items: Sequence[_T], size: int) -> Iterator[Sequence[_T]]:
    """``items`` in slices of at most ``size``."""
    for i in range(0, len(items), size):
        yield items[i : i + size]


def size_batches(
    items: Sequence[tuple[bytes, bytes]], max_ops: int, max_bytes: int
) -> Iterator[list[tuple[bytes, bytes]]]:
    """Key-value pairs in batches of at most ``max_ops`` pairs and (past the first) ``max_bytes``."""
    batch: list[tuple[bytes, bytes]] = []
    size = 0
    for k, v in items:
        n = len(k) + len(v)
        if batch and (len(batch) >= max_ops or size + n > max_bytes):
            yield batch
            batch, size = [], 0
        batch.append((k, v))
        size += n
    if batch:
        yield batch
