"""The compare-and-swap engine of :class:`~etcd_store.EtcdStore`: ``add``, ``append``,
``compare_set`` and the fenced, leased Txn that every write of the store uses.

Each operation is one Txn when the store's cached view of the key is right;
a failed compare returns the current value, and the next Txn starts from it
(no sleeps), until the store timeout. Replays by the client after a lost reply
are detected with the thread's :class:`_Marker`, so each write applies exactly
once (:meth:`ReadModifyWrite._fenced_txn`).
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ._base import StoreBase, _as_bytes, _dist_errors
from ._values import ChunkedValues, _gen_of, check_deadline
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

log = logging.getLogger(__name__)

#: Values up to this size are remembered to make the next add/append one Txn.
_REMEMBER_BYTES = 1024
_REMEMBER_KEYS = 4096


class _Marker:
    """Per store thread: the key recording this thread's last write.

    Every write Txn of the store writes a unique op id here and requires this key
    unchanged since the thread last saw it. A Txn whose reply was lost and that
    the client resends then fails, and its failure branch shows the op id: the
    write was applied exactly once.
    """

    __slots__ = ("key", "mod", "seq")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.mod = 0
        self.seq = 0

    def next_id(self) -> bytes:
        self.seq += 1
        return str(self.seq).encode()


@dataclass(frozen=True)
class Fenced:
    """The outcome of :meth:`ReadModifyWrite._fenced_txn`.

    ``txn``: the Txn's result, the marker read left out of a failure branch.
    ``replayed``: an earlier send of this Txn was applied (its reply lost) and
    ``txn`` is the failed resend, so the success results are unknown.
    ``revision``: the revision at which the Txn was applied (or, if it was not, read).
    """

    stored: bytes
    txn: TxnResult
    replayed: bool
    revision: int

    @property
    def applied(self) -> bool:
        return self.txn.succeeded or self.replayed


class ReadModifyWrite(ChunkedValues, StoreBase):
    """``add``, ``append``, ``compare_set`` and the store's fenced, leased Txn."""

    def add(self, key: str | bytes, amount: int) -> int:  # type: ignore[override]
        """Add ``amount`` to the integer at ``key`` (created at ``amount``); returns the sum.

        One Txn when the key is new or unchanged since this store last saw it;
        otherwise the failed Txn returns the current value and the next one
        retries from it (no sleep), until the store timeout. Raises
        ``DistStoreError`` if the value is not an integer or on timeout.
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
        the current value. One Txn; applied at most once even when resent.
        """
        k = self._layout.key(key)
        expected = _as_bytes(expected_value, "expected_value")
        desired = _as_bytes(desired_value, "desired_value")
        with _dist_errors(f"compare_set({key!r})"):
            return self._compare_set(k, expected, desired)

    def _compare_set(self, k: bytes, expected: bytes, desired: bytes) -> bytes:
        t = self._rpc_timeout()
        deadline = time.monotonic() + t
        what = f"compare_set of {k!r}"
        guard: list[Any] | None
        if expected == b"":
            guard = [compare_create(k, "==", 0)]
        elif self._inline(expected):
            guard = [compare_value(k, "==", expected)]
        else:
            guard = None  # a chunked expected value: compare after reading
        while True:
            check_deadline(deadline, what, t)
            if guard is None:
                res = self._client.range(k, timeout=self._budget(deadline))
                if not res.kvs:
                    if expected == b"":  # missing now: created, as by TCPStore
                        guard = [compare_create(k, "==", 0)]
                        continue
                    return expected
                current = self._decode(res.kvs[0], deadline)
                if current is None:
                    continue
                if current != expected:
                    return current
                guard = [compare_mod(k, "==", res.kvs[0].mod_revision)]
            out = self._fenced_txn(
                desired, guard, lambda stored, lease: [op_put(k, stored, lease=lease, prev_kv=True)],
                [op_get(k)], deadline, what,
            )
            if out.applied:
                self._remember(k, out.revision, desired)
                if out.txn.succeeded:
                    self._drop_replaced(_put_of(out.txn).prev_kv, _gen_of(out.stored))
                return desired
            rng = out.txn.responses[0]
            assert isinstance(rng, RangeResult)
            if not rng.kvs:
                if expected == b"":  # deleted since it was read: created, as by TCPStore
                    guard = [compare_create(k, "==", 0)]
                    continue
                return expected
            kv = rng.kvs[0]
            current = self._decode(kv, deadline)
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
        """Read-modify-write ``k`` with a compare-and-swap Txn; returns (new value, revision).

        Retries from the value each failed Txn returns until the store timeout
        (then ``EtcdTimeoutError``).
        """
        t = self._rpc_timeout()
        deadline = time.monotonic() + t
        what = f"read-modify-write of {k!r}"
        with self._lock:
            known: tuple[int, bytes | None] = self._known.get(k, (0, None))
        while True:
            base_mod, base = known
            new = compute(base)
            out = self._fenced_txn(
                new, [compare_mod(k, "==", base_mod)],
                lambda stored, lease: [op_put(k, stored, lease=lease, prev_kv=True)],
                [op_get(k)], deadline, what,
            )
            if out.applied:
                self._remember(k, out.revision, new)
                if out.txn.succeeded:
                    self._drop_replaced(_put_of(out.txn).prev_kv, _gen_of(out.stored))
                return new, out.revision
            check_deadline(deadline, what, t)
            current = out.txn.responses[0]
            assert isinstance(current, RangeResult)
            known = (0, None)
            if current.kvs:
                value = self._decode(current.kvs[0], deadline)
                if value is not None:  # None: replaced since; the next Txn fails and shows it
                    known = (current.kvs[0].mod_revision, value)

    def _marker(self) -> _Marker:
        marker: _Marker | None = getattr(self._tls, "marker", None)
        if marker is None:
            with self._lock:
                number = next(self._thread_numbers)
            marker = _Marker(self._layout.marker_key(self._id, number))
            self._tls.marker = marker
        return marker

    def _fenced_txn(
        self, value: bytes | None, compare: Sequence[Any],
        success: Callable[[bytes, int], list[Any]], failure: Sequence[Any],
        deadline: float, what: str,
    ) -> Fenced:
        """One Txn, applied exactly once, whose writes ride on the namespace lease.

        ``value`` is stored first (its chunks, when it is large: see :meth:`_encode`);
        ``success(stored, lease)`` builds the success ops (once per lease). The Txn also requires this
        thread's marker unchanged and writes a fresh op id there, so the client may
        resend it safely: a resend of an applied Txn fails and shows the op id
        (``replayed``). Returns once the Txn was applied or ``compare`` failed (a
        Txn that failed only on a stale marker is sent again); raises
        ``EtcdTimeoutError`` past ``deadline``. If etcd lost the lease, the lease is
        renewed and the Txn sent again. Chunks of a Txn that certainly failed are
        deleted; after an error (outcome unknown) they are kept (the lease removes them).
        """
        marker = self._marker()
        op_id = marker.next_id()

        def attempt(lease: int) -> Fenced:
            stored = b"" if value is None else self._encode(value, lease, deadline)
            ops = success(stored, lease)
            while True:
                seen = marker.mod
                txn = self._client.txn(
                    [*compare, compare_mod(marker.key, "==", seen)],
                    [*ops, op_put(marker.key, op_id, lease=lease)],
                    [*failure, op_get(marker.key)],
                    timeout=self._budget(deadline), idempotent=True,
                )
                if txn.succeeded:
                    marker.mod = txn.revision
                    return Fenced(stored, TxnResult(True, txn.revision, txn.responses[:-1]), False, txn.revision)
                mark = txn.responses[-1]
                assert isinstance(mark, RangeResult)
                marker.mod = mark.kvs[0].mod_revision if mark.kvs else 0
                result = TxnResult(False, txn.revision, txn.responses[:-1])
                if mark.kvs and mark.kvs[0].value == op_id:
                    log.debug("%s: applied by an earlier send whose reply was lost", what)
                    return Fenced(stored, result, True, marker.mod)
                if marker.mod == seen:  # the marker held: the caller's compare failed
                    self._discard(stored)
                    return Fenced(stored, result, False, txn.revision)
                check_deadline(deadline, what, self._rpc_timeout())

        return self._shared.lease.attached(attempt, self._budget(deadline))

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


def _put_of(txn: TxnResult) -> PutResult:
    put = txn.responses[0]
    assert isinstance(put, PutResult)
    return put
