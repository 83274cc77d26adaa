"""The compare-and-swap engine of :class:`~etcd_store.EtcdStore`: ``add``, ``append``,
``compare_set`` and the fenced, leased Txn that every write of the store uses.

Each operation is one Txn when the store's cached view of the key is right;
a failed compare returns the current value, and the next Txn starts from it
(no sleeps), until the store timeout. Replays by the client after a lost reply
are detected with the thread's :class:`_Marker`, so each write applies exactly
once (:meth:`ReadModifyWrite.fenced_txn`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ._layout import Layout
from ._limits import StoreTimeout, budget, check_deadline
from ._namespace_lease import StoreLease
from ._values import ChunkedValues, gen_of
from .client import (
    EtcdClient,
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
    """The outcome of :meth:`ReadModifyWrite.fenced_txn`.

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


class ReadModifyWrite:
    """The writes of one store: its fenced, leased Txn, ``add``, ``append``, ``compare_set``.

    Holds this store's exactly-once markers (one per thread) and its cache of values it
    last read or wrote (so that the next ``add``/``append`` is one Txn). ``values``: the
    encoding of values; ``lease``: what every write is attached to; ``timeout``: the store
    timeout (the deadline of a write).
    """

    def __init__(
        self, client: EtcdClient, layout: Layout, values: ChunkedValues, lease: StoreLease,
        timeout: StoreTimeout,
    ) -> None:
        self._client = client
        self._layout = layout
        self._values = values
        self._lease = lease
        self._timeout = timeout
        self._id = uuid.uuid4().hex[:16]
        self._lock = threading.Lock()
        self._known: dict[bytes, tuple[int, bytes]] = {}
        self._tls = threading.local()
        self._thread_numbers = itertools.count()

    def add(self, k: bytes, delta: int, key: str | bytes) -> tuple[int, int]:
        """Add ``delta`` to the integer at ``k`` (created at ``delta``); (the sum, its revision).

        One Txn when the key is new or unchanged since this store last saw it;
        otherwise the failed Txn returns the current value and the next one
        retries from it (no sleep), until the store timeout (``EtcdTimeoutError``).
        Raises ``DistStoreError`` naming ``key`` if the value is not an integer.
        """

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

        new, revision = self.update(k, plus)
        return int(new), revision

    def append(self, k: bytes, v: bytes) -> None:
        """Append ``v`` to ``k`` (created if missing). Same cost as :meth:`add`."""
        self.update(k, lambda old: (old or b"") + v)

    def compare_set(self, k: bytes, expected: bytes, desired: bytes) -> bytes:
        """Set ``k`` to ``desired`` if it holds ``expected``; return the value now.

        As TCPStore: a missing key is created when ``expected`` is empty and
        left missing otherwise (``expected`` is returned); a mismatch returns
        the current value. One Txn; applied at most once even when resent.
        """
        t = self._timeout.rpc()
        deadline = time.monotonic() + t
        what = f"compare_set of {k!r}"
        guard: list[Any] | None
        if expected == b"":
            guard = [compare_create(k, "==", 0)]
        elif self._values.inline(expected):
            guard = [compare_value(k, "==", expected)]
        else:
            guard = None  # a chunked expected value: compare after reading
        while True:
            check_deadline(deadline, what, t)
            if guard is None:
                res = self._client.range(k, timeout=budget(deadline))
                if not res.kvs:
                    if expected == b"":  # missing now: created, as by TCPStore
                        guard = [compare_create(k, "==", 0)]
                        continue
                    return expected
                current = self._values.decode(res.kvs[0], deadline)
                if current is None:
                    continue
                if current != expected:
                    return current
                guard = [compare_mod(k, "==", res.kvs[0].mod_revision)]
            out = self.fenced_txn(
                desired, guard, lambda stored, lease: [op_put(k, stored, lease=lease, prev_kv=True)],
                [op_get(k)], deadline, what,
            )
            if out.applied:
                self.remember(k, out.revision, desired)
                if out.txn.succeeded:
                    self._values.drop_replaced(put_of(out.txn).prev_kv, gen_of(out.stored))
                return desired
            rng = out.txn.responses[0]
            assert isinstance(rng, RangeResult)
            if not rng.kvs:
                if expected == b"":  # deleted since it was read: created, as by TCPStore
                    guard = [compare_create(k, "==", 0)]
                    continue
                return expected
            kv = rng.kvs[0]
            current = self._values.decode(kv, deadline)
            if current is None:
                guard = None
                continue
            if current == expected:  # b"" present, or a chunked value equal to expected
                guard = [compare_mod(k, "==", kv.mod_revision)]
                continue
            self.remember(k, kv.mod_revision, current)
            return current

    def update(self, k: bytes, compute: Callable[[bytes | None], bytes]) -> tuple[bytes, int]:
        """Read-modify-write ``k`` with a compare-and-swap Txn; returns (new value, revision).

        Retries from the value each failed Txn returns until the store timeout
        (then ``EtcdTimeoutError``).
        """
        t = self._timeout.rpc()
        deadline = time.monotonic() + t
        what = f"read-modify-write of {k!r}"
        with self._lock:
            known: tuple[int, bytes | None] = self._known.get(k, (0, None))
        while True:
            base_mod, base = known
            new = compute(base)
            out = self.fenced_txn(
                new, [compare_mod(k, "==", base_mod)],
                lambda stored, lease: [op_put(k, stored, lease=lease, prev_kv=True)],
                [op_get(k)], deadline, what,
            )
            if out.applied:
                self.remember(k, out.revision, new)
                if out.txn.succeeded:
                    self._values.drop_replaced(put_of(out.txn).prev_kv, gen_of(out.stored))
                return new, out.revision
            check_deadline(deadline, what, t)
            current = out.txn.responses[0]
            assert isinstance(current, RangeResult)
            known = (0, None)
            if current.kvs:
                value = self._values.decode(current.kvs[0], deadline)
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

    def fenced_txn(
        self, value: bytes | None, compare: Sequence[Any],
        success: Callable[[bytes, int], list[Any]], failure: Sequence[Any],
        deadline: float, what: str,
    ) -> Fenced:
        """One Txn, applied exactly once, whose writes ride on the namespace lease.

        ``value`` is stored first (its chunks, when it is large: see :meth:`ChunkedValues.encode`);
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
            stored = b"" if value is None else self._values.encode(value, lease, deadline)
            ops = success(stored, lease)
            while True:
                seen = marker.mod
                txn = self._client.txn(
                    [*compare, compare_mod(marker.key, "==", seen)],
                    [*ops, op_put(marker.key, op_id, lease=lease)],
                    [*failure, op_get(marker.key)],
                    timeout=budget(deadline), idempotent=True,
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
                    self._values.discard(stored)
                    return Fenced(stored, result, False, txn.revision)
                check_deadline(deadline, what, self._timeout.rpc())

        return self._lease.attached(attempt, budget(deadline))

    def remember(self, k: bytes, revision: int, value: bytes) -> None:
        with self._lock:
            if len(value) > _REMEMBER_BYTES:
                self._known.pop(k, None)
                return
            if len(self._known) >= _REMEMBER_KEYS and k not in self._known:
                self._known.clear()
            self._known[k] = (revision, value)

    def forget(self, *ks: bytes) -> None:
        """Forget what this store knew of ``ks`` (the next write of one reads it first)."""
        with self._lock:
            for k in ks:
                self._known.pop(k, None)


def put_of(txn: TxnResult) -> PutResult:
    put = txn.responses[0]
    assert isinstance(put, PutResult)
    return put
