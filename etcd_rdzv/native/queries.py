"""The read-only queries of the ``etcd-v3`` protocol: one RPC each, nothing written.

Each function is one Range or one read-only Txn (safe to resend) and returns
plain data decoded by :mod:`etcd_rdzv.native.records`; none sleeps or loops.
The transitions are in :mod:`etcd_rdzv.native.protocol`.
"""

from __future__ import annotations

from dataclasses import dataclass

from etcd_store.client import EtcdClient, op_get

from .keys import RunKeys
from .records import Meta, Sealed, count_of, decode_members, first_kv, lease_of

__all__ = ["Occupancy", "count_waiting", "is_closed", "read_members", "read_meta", "snapshot_members"]


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


def count_waiting(
    client: EtcdClient, keys: RunKeys, round_: int, *, timeout: float | None = None
) -> Occupancy:
    """Join keys of ``round_ + 1`` and of ``round_``, and ``closed``. One read-only Txn
    of three count-only ranges (no revision, O(1) bytes)."""
    res = client.txn(
        [],
        [
            op_get(keys.join_prefix(round_ + 1), prefix=True, count_only=True),
            op_get(keys.join_prefix(round_), prefix=True, count_only=True),
            op_get(keys.closed, count_only=True),
        ],
        timeout=timeout,
        idempotent=True,
    )
    return Occupancy(count_of(res.responses[0]), count_of(res.responses[1]), count_of(res.responses[2]) > 0)


def read_members(
    client: EtcdClient, keys: RunKeys, round_: int, *, timeout: float | None = None
) -> tuple[list[str] | None, int]:
    """The members record of ``round_`` (None if absent) and the read revision. One Range."""
    res = client.range(keys.members(round_), timeout=timeout)
    return (decode_members(res.kvs[0].value, res.kvs[0].key) if res.kvs else None), res.revision


def snapshot_members(
    client: EtcdClient,
    keys: RunKeys,
    round_: int,
    seal_revision: int,
    max_nodes: int,
    *,
    timeout: float | None = None,
) -> list[str]:
    """The members of ``round_`` from the join keys at ``seal_revision``. One historical Range.

    Raises :class:`~etcd_store.errors.EtcdCompactedError` if that revision was compacted.
    """
    res = client.range(
        keys.join_prefix(round_), prefix=True, keys_only=True, revision=seal_revision, timeout=timeout
    )
    joins = sorted(res.kvs, key=lambda kv: kv.create_revision)[:max_nodes]
    names = [keys.parse_join_key(kv.key) for kv in joins]
    return [parsed[1] for parsed in names if parsed is not None]
