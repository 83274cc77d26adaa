"""torch's API conventions for :class:`~etcd_store.EtcdStore`'s arguments and errors.

The facade (:mod:`etcd_store.store`) converts arguments with these helpers and wraps every
call in :func:`dist_errors`, the one place where client errors become torch's store errors.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed as dist

from .errors import EtcdConnectionError, EtcdError

log = logging.getLogger(__name__)

Timeout = datetime.timedelta | float | int


@contextlib.contextmanager
def dist_errors(what: str) -> Iterator[None]:
    """Re-raise client errors as the exception types torch's stores raise.

    :class:`EtcdConnectionError` (timeouts included) becomes ``DistNetworkError``, any other
    :class:`EtcdError` ``DistStoreError``; both name ``EtcdStore.<what>``. Other exceptions
    pass unchanged.
    """
    try:
        yield
    except EtcdConnectionError as e:
        raise dist.DistNetworkError(f"EtcdStore.{what} failed: {e}") from e
    except EtcdError as e:
        raise dist.DistStoreError(f"EtcdStore.{what} failed: {e}") from e


def as_bytes(value: Any, what: str) -> bytes:
    """A value or key given as str (UTF-8) or bytes-like; ``TypeError`` naming ``what`` otherwise."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"EtcdStore {what} must be str or bytes, got {type(value).__name__}")


def seconds(timeout: Timeout, what: str = "timeout") -> float:
    """A timeout in seconds (``timedelta`` or a number); ``TypeError``/``ValueError`` if invalid."""
    if isinstance(timeout, datetime.timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise TypeError(f"EtcdStore {what} must be a datetime.timedelta, got {timeout!r}")
    if value < 0:
        raise ValueError(f"EtcdStore {what} must not be negative, got {timeout!r}")
    return value


def key_list(keys: Sequence[str | bytes]) -> list[str | bytes]:
    """A list of keys; ``TypeError`` for a single key passed where a list is expected."""
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"EtcdStore expected a list of keys, got a single key {keys!r}")
    return list(keys)
