"""The compare-and-swap engine of :class:`~etcd_store.EtcdStore`: ``add``, ``append``,
``compare_set`` and the fenced, leased Txn that ``queue_pop`` uses too.

Each operation is one Txn when the store's cached view of the key is right;
a failed compare returns the current value, and the next Txn starts from it
(no sleeps). Replays by the client after a lost reply are detected with the
thread's :class:`_Marker`, so each operation applies exactly once.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from ._base import StoreBase, _as_bytes, _dist_errors
from ._values import ChunkedValues, _gen_of
from .client import (
    PutResult,
    RangeResult,
    TxnResult,
    compare_create,
    compare_mod,
    compare_value,
    op_get,
    op_put,
)
from .errors import EtcdError

#: Values up to this size are remembered to make the next add/append one Txn.
_REMEMBER_BYTES = 1024
_REMEMBER_KEYS = 4096


class _Marker:
    """Per store thread: the key recording this thread's last add/append/queue_pop.

    Those three are not idempotent, so their Txn also writes a unique op id
    here and requires this key unchanged since the thread last saw it. A Txn
    whose reply was lost and that the client replays then fails, and its
    failure branch shows the op id: the op was applied exactly once.
    """

    __slots__ = ("key", "mod", "seq")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.mod = 0
        self.seq = 0

    def next_id(self) -> bytes:
        self.seq += 1
        return str(self.seq).encode()


class ReadModifyWrite(ChunkedValues, StoreBase):
    """``add``, ``append``, ``compare_set`` and the store's fenced, leased Txn."""

    def add(self, key: str | bytes, amount: int) -> int:  # type: ignore[override]
        """Add ``amount`` to the integer at ``key`` (created at ``amount``); returns the sum.

        One Txn when the key is new or unchanged since this store last saw it;
        otherwise the failed Txn returns the current value and the next one
        retries from it (no sleep). Raises ``DistStoreError`` if the value is not
        an integer.
        """
        return self._add(key, amount)[0]

    def append(self, key: str | bytes, value: str | bytes) -> None:  # type: ignore[override]
        """Append ``value`` to ``key`` (created if missing). Same cost as :meth:`add`."""
        k = self._layout.key(key)
        v = _as_bytes(value, "value")
        with _dist_errors(f"append({key!r})"):
            self._update(k, lambda old: (old or b"") + v)

    def compare_set(  # type: ignore[override]
        self, key: str | bytes, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``; return the value now.

        As TCPStore: a missing key is created when ``expected_value`` is empty and
        left missing otherwise (``expected_value`` is returned); a mismatch returns
        the current value. One Txn.
        """
        k = self._layout.key(key)
        expected = _as_bytes(expected_value, "expected_value")
        desired = _as_bytes(desired_value, "desired_value")
        with _dist_errors(f"compare_set({key!r})"):
            return self._compare_set(k, expected, desired)

    def _compare_set(self, k: bytes, expected: bytes, desired: bytes) -> bytes:
        t = self._rpc_timeout()
        guard: list[Any] | None
        if expected == b"":
            guard = [compare_create(k, "==", 0)]
        elif self._inline(expected):
            guard = [compare_value(k, "==", expected)]
        else:
            guard = None  # a chunked expected value: compare after reading
        while True:
            if guard is None:
                res = self._client.range(k, timeout=t)
                if not res.kvs:
                    return expected
                current = self._decode(res.kvs[0])
                if current is None:
                    continue
                if current != expected:
                    return current
                guard = [compare_mod(k, "==", res.kvs[0].mod_revision)]
            stored, txn = self._leased_txn(
                desired, guard, lambda stored, lease: [op_put(k, stored, lease=lease, prev_kv=True)],
                [op_get(k)], t,
            )
            if txn.succeeded:
                put = txn.responses[0]
                assert isinstance(put, PutResult)
                self._remember(k, txn.revision, desired)
                self._drop_replaced(put.prev_kv, _gen_of(stored))
                return desired
            rng = txn.responses[0]
            assert isinstance(rng, RangeResult)
            if not rng.kvs:
                return expected
            kv = rng.kvs[0]
            if kv.value == stored:
                return desired  # our own write, replayed by the client after a lost reply
            self._discard(stored)
            current = self._decode(kv)
            if current is None:
                guard = None
                continue
            if current == expected:  # b"" present, or a chunked value equal to expected
                guard = [compare_mod(k, "==", kv.mod_revision)]
                continue
            self._remember(k, kv.mod_revision, current)
            return current

    def _add(self, key: str | bytes, amount: int) -> tuple[int, int]:
        k = self._layout.key(key)
        try:
            delta = operator.index(amount)
        except TypeError:
            raise TypeError(f"EtcdStore.add amount must be an int, got {amount!r}") from None

        def plus(old: bytes | None) -> bytes:
            if old is None:
                return str(delta).encode()
            try:
                number = int(old)
            except ValueError:
                raise dist.DistStoreError(
                    f"EtcdStore.add({key!r}): the value {old[:64]!r} is not an integer"
                ) from None
            return str(number + delta).encode()

        with _dist_errors(f"add({key!r}, {amount!r})"):
            new, revision = self._update(k, plus)
        return int(new), revision

    def _update(self, k: bytes, compute: Callable[[bytes | None], bytes]) -> tuple[bytes, int]:
        """Read-modify-write ``k`` with a compare-and-swap Txn; returns (new value, revision)."""
        t = self._rpc_timeout()
        marker = self._marker()
        op_id = marker.next_id()
        with self._lock:
            known: tuple[int, bytes | None] = self._known.get(k, (0, None))
        while True:
            base_mod, base = known
            new = compute(base)
            stored, txn = self._leased_txn(
                new,
                [compare_mod(k, "==", base_mod), compare_mod(marker.key, "==", marker.mod)],
                lambda stored, lease: [op_put(k, stored, lease=lease, prev_kv=True),
                                       op_put(marker.key, op_id, lease=lease)],
                [op_get(k), op_get(marker.key)],
                t,
            )
            if txn.succeeded:
                marker.mod = txn.revision
                put = txn.responses[0]
                assert isinstance(put, PutResult)
                self._remember(k, txn.revision, new)
                self._drop_replaced(put.prev_kv, _gen_of(stored))
                return new, txn.revision
            current, mark = txn.responses
            assert isinstance(current, RangeResult) and isinstance(mark, RangeResult)
            if mark.kvs and mark.kvs[0].value == op_id:
                # An earlier attempt was applied; the client replayed it after a lost reply.
                marker.mod = mark.kvs[0].mod_revision
                self._remember(k, marker.mod, new)
                return new, marker.mod
            self._discard(stored)
            marker.mod = mark.kvs[0].mod_revision if mark.kvs else 0
            if not current.kvs:
                known = (0, None)
                continue
            kv = current.kvs[0]
            value = self._decode(kv)
            while value is None:  # chunks compacted away: read the key afresh
                fresh = self._client.range(k, timeout=t)
                if not fresh.kvs:
                    break
                kv = fresh.kvs[0]
                value = self._decode(kv)
            known = (kv.mod_revision, value) if value is not None else (0, None)

    def _marker(self) -> _Marker:
        marker: _Marker | None = getattr(self._tls, "marker", None)
        if marker is None:
            with self._lock:
                number = next(self._thread_numbers)
            marker = _Marker(self._layout.marker_key(self._id, number))
            self._tls.marker = marker
        return marker

    def _leased_txn(
        self, value: bytes | None, compare: Sequence[Any],
        success: Callable[[bytes, int], list[Any]], failure: Sequence[Any], t: float,
    ) -> tuple[bytes, TxnResult]:
        """One guarded Txn whose writes ride on the namespace lease; (stored value, result).

        ``value`` is stored first (its chunks, when it is large: see :meth:`_encode`);
        ``success(stored, lease)`` builds the success ops. If etcd lost the lease, the
        lease is renewed and the Txn sent again; chunks of a Txn that failed are deleted.
        """

        def attempt(lease: int) -> tuple[bytes, TxnResult]:
            stored = b"" if value is None else self._encode(value, lease, t)
            try:
                # Fenced (compares on the key and the thread's marker): safe to replay.
                return stored, self._client.txn(
                    compare, success(stored, lease), failure, timeout=t, idempotent=True
                )
            except EtcdError:
                self._discard(stored)
                raise

        return self._shared.lease.attached(attempt, t)

    def _remember(self, k: bytes, revision: int, value: bytes) -> None:
        with self._lock:
            if len(value) > _REMEMBER_BYTES:
                self._known.pop(k, None)
                return
            if len(self._known) >= _REMEMBER_KEYS and k not in self._known:
                self._known.clear()
            self._known[k] = (revision, value)

    def _forget(self, k: bytes) -> None:
        with self._lock:
            self._known.pop(k, None)
