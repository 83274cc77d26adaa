"""The ``etcd-v3`` rendezvous protocol: one function per transition.

Each function below is one etcd RPC (a transaction unless said otherwise) and
returns plain data; none of them sleeps or loops. The records they write are
defined in :mod:`etcd_rdzv.native.records`, the read-only queries are in
:mod:`etcd_rdzv.native.queries`. Every transaction here may be
replayed when its outcome is unknown (``idempotent=True``): a replayed join
re-puts the same key (its create revision, hence its place, is kept), a replayed
seal or close fails its compare, deletes are idempotent. The handler
(:mod:`etcd_rdzv.native.handler`) strings them together and waits on watches.
Key names come from :class:`~etcd_rdzv.native.keys.RunKeys`; see the design note
in the README for why each compare makes its transition safe.

Membership rule (the single source of truth): round ``T`` is sealed at the
revision ``S`` of the transaction that wrote ``ctl/sealed = T``. Its members are
the keys under ``ctl/join/T/`` that exist at ``S``, ordered by create revision,
first ``max_nodes`` of them; rank = position. If fewer than ``min_nodes`` keys
exist at ``S`` (a joiner died in the instant before sealing) the round is
*void*: it forms no group and its joiners move on to ``T + 1``. Every waiting
node rebuilds the join set at ``S`` from its own gap-free watch
(:class:`~etcd_rdzv.native.view.RoundView`), so no node needs to read the member list.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from etcd_store.client import (
    DeleteResult,
    EtcdClient,
    compare_mod,
    compare_version,
    op_delete,
    op_get,
    op_put,
    prefix_range_end,
)

from .keys import RunKeys
from .records import Master, Sealed, count_of, encode_sealed, first_kv, lease_of

log = logging.getLogger(__name__)

__all__ = [
    "JoinOutcome",
    "SealOutcome",
    "close",
    "ensure_run_lease",
    "join",
    "leave_if_unsealed",
    "remove_round_records_if_idle",
    "seal",
    "write_members",
]


# --------------------------------------------------------------------------- run lease


def ensure_run_lease(
    client: EtcdClient, keys: RunKeys, state_ttl: int, *, timeout: float | None = None
) -> int:
    """The run lease named by ``ctl/run``, created (with ``ctl/run``) if absent.

    One Range when it exists; else LeaseGrant + one Txn ``[version(run) == 0] ->
    put run (bound to the lease)``, and a node that loses that race revokes its
    own lease and returns the winner's. Only sealers and closers call this.
    """
    existing = lease_of(client.get(keys.run, timeout=timeout))
    if existing is not None:
        return existing
    lease = client.lease_grant(state_ttl, timeout=timeout)
    res = client.txn(
        [compare_version(keys.run, "==", 0)],
        [op_put(keys.run, f"{lease:x}".encode(), lease=lease)],
        [op_get(keys.run)],
        timeout=timeout,
        idempotent=True,
    )
    winner = lease if res.succeeded else lease_of(first_kv(res.responses[0]))
    if winner == lease:  # created (possibly by an earlier attempt of this very Txn)
        log.debug("created run lease %x for %s", lease, keys.root)
        return lease
    client.lease_revoke(lease, timeout=timeout)
    if winner is None:  # the winner's lease expired in between: try again from scratch
        return ensure_run_lease(client, keys, state_ttl, timeout=timeout)
    return winner


# --------------------------------------------------------------------------- transitions


@dataclass(frozen=True)
class JoinOutcome:
    """The answer of :func:`join`.

    On success: ``revision`` is the join's revision (= this node's create
    revision unless the key already existed), ``before`` the number of other join
    keys of the round created earlier, ``prev_count`` the number of join keys of
    the previous round. On failure: the current ``sealed`` and ``closed``, and
    ``joined_anyway``: our key exists in the round (an earlier attempt of this Txn,
    whose answer was lost, did apply, and the round was sealed since).
    """

    ok: bool
    revision: int
    create_revision: int = 0
    before: int = 0
    prev_count: int = 0
    sealed: Sealed = field(default_factory=Sealed)
    closed: bool = False
    after: dict[str, int] = field(default_factory=dict)
    joined_anyway: bool = False


def join(
    client: EtcdClient,
    keys: RunKeys,
    node_id: str,
    value: bytes,
    lease: int,
    sealed: Sealed,
    *,
    previous_key: bytes | None = None,
    timeout: float | None = None,
) -> JoinOutcome:
    """Join round ``sealed.round + 1`` if it is still open. One Txn::

        if   mod(sealed) == sealed.revision and version(closed) == 0
        then put join/T/<node> (node lease); delete previous_key;
             count join/T/ created before me; count join/(T-1)/
        else get sealed; get closed; count join/T/<node>
    """
    target = sealed.round + 1
    key = keys.join_key(target, node_id)
    success = [op_put(key, value, lease=lease, prev_kv=True)]
    if previous_key is not None and previous_key != key:
        success.append(op_delete(previous_key))
    success += [
        op_get(keys.join_prefix(target), prefix=True, count_only=True),
        op_get(keys.join_prefix(target - 1), prefix=True, count_only=True),
    ]
    res = client.txn(
        [compare_mod(keys.sealed, "==", sealed.revision), compare_version(keys.closed, "==", 0)],
        success,
        [op_get(keys.sealed), op_get(keys.closed, count_only=True), op_get(key, count_only=True)],
        timeout=timeout,
        idempotent=True,
    )
    if not res.succeeded:
        return JoinOutcome(
            False,
            res.revision,
            sealed=Sealed.from_kv(first_kv(res.responses[0])),
            closed=count_of(res.responses[1]) > 0,
            joined_anyway=count_of(res.responses[2]) > 0,
        )
    put = res.responses[0]
    prev_kv = getattr(put, "prev_kv", None)
    total = count_of(res.responses[-2])
    after: dict[str, int] = {}
    if prev_kv is None:
        create_revision, before = res.revision, total - 1
    else:
        # A re-put of our own key (resync) keeps its create revision, hence its place;
        # keys created after it are in ``total`` too, so split the set (rare path).
        create_revision = prev_kv.create_revision
        before, after = _split_around(client, keys, target, create_revision, res.revision, timeout)
    return JoinOutcome(
        True,
        res.revision,
        create_revision=create_revision,
        before=before,
        prev_count=count_of(res.responses[-1]),
        after=after,
    )


def _split_around(
    client: EtcdClient,
    keys: RunKeys,
    round_: int,
    create_revision: int,
    revision: int,
    timeout: float | None,
) -> tuple[int, dict[str, int]]:
    """(join keys created before ``create_revision``, {node: create revision} of later ones)."""
    res = client.range(
        keys.join_prefix(round_), prefix=True, keys_only=True, revision=revision, timeout=timeout
    )
    before, after = 0, {}
    for kv in res.kvs:
        parsed = keys.parse_join_key(kv.key)
        if kv.create_revision < create_revision:
            before += 1
        elif kv.create_revision > create_revision and parsed is not None:
            after[parsed[1]] = kv.create_revision
    return before, after


@dataclass(frozen=True)
class SealOutcome:
    """The answer of :func:`seal`: on failure the current ``sealed``/``closed``/previous count."""

    ok: bool
    revision: int
    sealed: Sealed = field(default_factory=Sealed)
    closed: bool = False
    prev_count: int = 0


def seal(
    client: EtcdClient,
    keys: RunKeys,
    round_: int,
    previous: Sealed,
    run_lease: int,
    *,
    master: Master | None = None,
    timeout: float | None = None,
) -> SealOutcome:
    """Seal ``round_`` (= ``previous.round + 1``). One Txn::

        if   mod(sealed) == previous.revision           (nobody sealed since)
             and version(closed) == 0
             and version(join/(T-1)/ ...) == 0           (previous round vacated)
             [and mod(master.key) == master.mod_revision]
        then put sealed = T (run lease, master's addr and port); delete rounds/ older than T-1
        else get sealed; get closed; count join/(T-1)/

    The members are the join keys that exist at the returned revision. A failure
    whose answer shows ``sealed`` unchanged, the run open and the previous round
    vacated failed on ``master`` alone: seal again without it.
    """
    if round_ != previous.round + 1:
        raise ValueError(f"cannot seal round {round_} after round {previous.round}")
    prev_prefix = keys.join_prefix(round_ - 1)
    start, end = keys.rounds_before(round_ - 1)
    compare = [
        compare_mod(keys.sealed, "==", previous.revision),
        compare_version(keys.closed, "==", 0),
        compare_version(prev_prefix, "==", 0, range_end=prefix_range_end(prev_prefix)),
    ]
    if master is not None:
        compare.append(compare_mod(master.key, "==", master.mod_revision))
    res = client.txn(
        compare,
        [
            op_put(keys.sealed, encode_sealed(round_, run_lease, master), lease=run_lease),
            op_delete(start, end),
        ],
        [
            op_get(keys.sealed),
            op_get(keys.closed, count_only=True),
            op_get(prev_prefix, prefix=True, count_only=True),
        ],
        timeout=timeout,
        idempotent=True,
    )
    if res.succeeded:
        return SealOutcome(True, res.revision)
    return SealOutcome(
        False,
        res.revision,
        sealed=Sealed.from_kv(first_kv(res.responses[0])),
        closed=count_of(res.responses[1]) > 0,
        prev_count=count_of(res.responses[2]),
    )


def write_members(
    client: EtcdClient,
    keys: RunKeys,
    round_: int,
    members: list[str],
    run_lease: int,
    *,
    timeout: float | None = None,
) -> bool:
    """Record the members of a sealed round once: ``[version(members) == 0] -> put``. One Txn."""
    key = keys.members(round_)
    res = client.txn(
        [compare_version(key, "==", 0)],
        [op_put(key, json.dumps(members).encode(), lease=run_lease)],
        timeout=timeout,
        idempotent=True,
    )
    return res.succeeded


def leave_if_unsealed(
    client: EtcdClient, keys: RunKeys, join_key: bytes, sealed: Sealed, *, timeout: float | None = None
) -> bool:
    """Withdraw a join unless its round got sealed meanwhile. One Txn::

        if mod(sealed) == sealed.revision then delete join_key
    """
    res = client.txn(
        [compare_mod(keys.sealed, "==", sealed.revision)], [op_delete(join_key)], timeout=timeout,
        idempotent=True,
    )
    return res.succeeded


def close(client: EtcdClient, keys: RunKeys, run_lease: int, *, timeout: float | None = None) -> bool:
    """Mark the run closed once: ``[version(closed) == 0] -> put closed``. One Txn.

    Returns whether this call closed it (False: it was closed already).
    """
    res = client.txn(
        [compare_version(keys.closed, "==", 0)],
        [op_put(keys.closed, b"1", lease=run_lease)],
        timeout=timeout,
        idempotent=True,
    )
    return res.succeeded


def remove_round_records_if_idle(
    client: EtcdClient, keys: RunKeys, *, timeout: float | None = None
) -> bool:
    """Delete every ``rounds/`` key (members, stores) if no node holds a join key. One Txn.

    Called by a node that leaves for good: the last one to go removes what the
    run-lease TTL does not cover (the stores of the last rounds).
    """
    root = keys.join_root
    start, end = keys.rounds, prefix_range_end(keys.rounds)
    res = client.txn(
        [compare_version(root, "==", 0, range_end=prefix_range_end(root))],
        [op_delete(start, end)],
        timeout=timeout,
        idempotent=True,
    )
    if res.succeeded:
        deleted = res.responses[0]
        assert isinstance(deleted, DeleteResult)
        log.debug("removed %d round records of %s", deleted.deleted, keys.root)
    return res.succeeded
