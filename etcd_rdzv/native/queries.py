"""The read-only queries of the ``etcd-v3`` protocol: one RPC each, nothing written.

Each function is one Range or one read-only Txn (safe to resend) and returns
plain data decoded by :mod:`etcd_rdzv.native.records`; none sleeps or loops.
The transitions are in :mod:`etcd_rdzv.native.protocol`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from etcd_store.client import EtcdClient, RangeResult, TxnResult, op_get

from .keys import RunKeys
from .records import Joiner, Meta, Sealed, count_of, decode_members, first_kv, lease_of

__all__ = [
    "Occupancy",
    "RoundRead",
    "count_waiting",
    "is_closed",
    "read_members",
    "read_meta",
    "read_round",
    "round_ops",
]


def read_meta(client: EtcdClient, keys: RunKeys, *, timeout: float | None = None) -> Meta:
    """``closed``, ``run`` and ``sealed`` at one revision. One read-only Txn."""
    res = client.txn([], [op_get(keys.closed), op_get(keys.run), op_get(keys.sealed)], timeout=timeout,
                     idempotent=True)
    closed_kv, run_kv, sealed_kv = (first_kv(r) for r in res.responses)
    return Meta(closed_kv is not None, Sealed.from_kv(sealed_kv), lease_of(run_kv), res.revision)


def is_closed(client: EtcdClient, keys: RunKeys, *, timeout: float | None = None) -> bool:
    """Whether ``ctl/closed`` exists. One Range."""
    return client.range(keys.closed, count_only=True, timeout=timeout).count > 0


@dataclass(frozen=True)
class Occupancy:
    """The answer of :func:`count_waiting`."""

    waiting: int  # join keys of round_ + 1
    active: int  # join keys of round_ (its members that are alive and still in it)
    closed: bool
    mine: bool | None = None  # whether the asking node's own join key of round_ exists (if asked)
    aborted: bool = False  # the abort mark exists (the operator stopped the run; see protocol.abort)


def count_waiting(
    client: EtcdClient,
    keys: RunKeys,
    round_: int,
    *,
    node_key: bytes | None = None,
    timeout: float | None = None,
) -> Occupancy:
    """Join keys of ``round_ + 1`` and of ``round_``, ``closed``, ``abort`` and, if given,
    whether ``node_key`` exists. One read-only Txn of four or five count-only ranges (no
    revision, O(1) bytes)."""
    ops = [
        op_get(keys.join_prefix(round_ + 1), prefix=True, count_only=True),
        op_get(keys.join_prefix(round_), prefix=True, count_only=True),
        op_get(keys.closed, count_only=True),
        op_get(keys.abort, count_only=True),
    ]
    if node_key is not None:
        ops.append(op_get(node_key, count_only=True))
    res = client.txn([], ops, timeout=timeout, idempotent=True)
    counts = [count_of(r) for r in res.responses]
    return Occupancy(counts[0], counts[1], counts[2] > 0, None if node_key is None else counts[4] > 0,
                     aborted=counts[3] > 0)


def read_members(
    client: EtcdClient, keys: RunKeys, round_: int, *, timeout: float | None = None
) -> tuple[list[str] | None, int]:
    """The members record of ``round_`` (None if absent) and the read revision. One Range."""
    res = client.range(keys.members(round_), timeout=timeout)
    return (decode_members(res.kvs[0].value, res.kvs[0].key) if res.kvs else None), res.revision


@dataclass(frozen=True)
class RoundRead:
    """One look at round ``T`` as a seal candidate takes it, at one revision.

    ``joiners``: the join keys of ``T`` in create order; ``joins`` and ``seq_mod``: the
    version and mod revision of ``seq/<T>`` (0 and 0 if absent); ``prev_count``: join
    keys left in ``T - 1``; ``sealed``, ``closed``: the control records.
    """

    revision: int
    joiners: list[Joiner]
    joins: int
    seq_mod: int
    prev_count: int
    sealed: Sealed
    closed: bool

    @property
    def count(self) -> int:
        return len(self.joiners)


def round_ops(keys: RunKeys, round_: int) -> list[Any]:
    """The ranges of a :class:`RoundRead` (also the failure branch of a seal)."""
    return [
        op_get(keys.sealed),
        op_get(keys.closed, count_only=True),
        op_get(keys.seq(round_), keys_only=True),
        op_get(keys.join_prefix(round_), prefix=True),
        op_get(keys.join_prefix(round_ - 1), prefix=True, count_only=True),
    ]


def parse_round(keys: RunKeys, res: TxnResult, *, skip: int = 0) -> RoundRead:
    """The :class:`RoundRead` of a transaction whose responses after the first ``skip`` are
    :func:`round_ops`'."""
    sealed_r, closed_r, seq_r, joins_r, prev_r = res.responses[skip:]
    seq = first_kv(seq_r)
    assert isinstance(joins_r, RangeResult)
    joiners = []
    for kv in sorted(joins_r.kvs, key=lambda kv: kv.create_revision):
        parsed = keys.parse_join_key(kv.key)
        if parsed is not None:
            joiners.append(Joiner(parsed[1], kv.create_revision, kv.value, kv.key, kv.mod_revision, kv.lease))
    return RoundRead(
        res.revision, joiners, seq.version if seq else 0, seq.mod_revision if seq else 0,
        count_of(prev_r), Sealed.from_kv(first_kv(sealed_r)), count_of(closed_r) > 0,
    )


def read_round(client: EtcdClient, keys: RunKeys, round_: int, *, timeout: float | None = None) -> RoundRead:
    """Everything a seal of ``round_`` depends on, at one revision. One read-only Txn
    (O(joiners) bytes: only seal candidates call it)."""
    res = client.txn([], round_ops(keys, round_), timeout=timeout, idempotent=True)
    return parse_round(keys, res)


@dataclass(frozen=True)
class CatchUp:
    """What a waiting node missed between its join and its watch's start, read at ``revision``.

    ``control``: the key-values under ``ctl/`` (``sealed``, ``closed``); ``prev_count``: join keys
    left in round ``T - 1``.
    """

    revision: int
    control: list[Any]
    prev_count: int


def catch_up(client: EtcdClient, keys: RunKeys, round_: int, *, timeout: float | None = None) -> CatchUp:
    """One read-only Txn: ``ctl/`` (two small keys) and the count of round ``T - 1``'s join keys.

    O(1) bytes whatever the number of nodes (no join key is listed).
    """
    res = client.txn(
        [],
        [op_get(keys.ctl, keys.ctl_end), op_get(keys.join_prefix(round_ - 1), prefix=True, count_only=True)],
        timeout=timeout,
        idempotent=True,
    )
    control = res.responses[0]
    assert isinstance(control, RangeResult)
    return CatchUp(res.revision, list(control.kvs), count_of(res.responses[1]))
