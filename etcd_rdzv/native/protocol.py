"""The ``etcd-v3`` rendezvous protocol: every etcd call of it, one function per read and per transition.

Each function is one etcd RPC (a Range or a Txn), returns plain data (:mod:`~etcd_rdzv.native.records`)
and never sleeps or loops. Reads write nothing. Every Txn may be replayed when its outcome is
unknown (``idempotent=True``): a replayed join re-puts the same key (its create revision, hence its
place, is kept; the counter counts it twice, which is why the seal names members by create
revision), a replayed seal or close fails its compare, deletes are idempotent. The participant
(:mod:`~etcd_rdzv.native.rounds`) strings them together; docs/etcd-v3-design.md says why each
compare makes its transition safe.

Membership rule (the single source of truth): round ``T`` is sealed by the Txn that writes
``ctl/sealed = T``, and that record names the members
(:class:`~etcd_rdzv.native.records.Membership`): the first ``max_nodes`` join keys of ``T`` in
create order as the sealer read them, a read the seal is fenced on (``seq/<T>`` unchanged). Every
member learns its rank from that one record, which every waiting node gets on its ``ctl/`` watch.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from etcd_store.client import (
    DeleteResult,
    EtcdClient,
    RangeResult,
    TxnResult,
    compare_lease,
    compare_mod,
    compare_version,
    op_delete,
    op_get,
    op_put,
    prefix_range_end,
    renewing_lease,
)

from .records import (
    Joiner,
    Membership,
    Meta,
    RunKeys,
    Sealed,
    count_of,
    decode_members,
    encode_evicted,
    encode_sealed,
    first_kv,
    lease_of,
)

log = logging.getLogger(__name__)

__all__ = ["AbortOutcome", "CatchUp", "JoinOutcome", "Occupancy", "RoundRead", "SealOutcome", "abort",
           "catch_up", "close", "count_waiting", "ensure_run_lease", "evict_joiners", "is_closed", "join",
           "leave_if_unsealed", "read_members", "read_meta", "read_round", "reattach",
           "remove_round_records_if_idle", "round_ops", "seal"]

# --------------------------------------------------------------------------- reads

def read_meta(client: EtcdClient, keys: RunKeys) -> Meta:
    """``closed``, ``run`` and ``sealed`` at one revision. One read-only Txn."""
    res = client.txn([], [op_get(keys.closed), op_get(keys.run), op_get(keys.sealed)], idempotent=True)
    closed_kv, run_kv, sealed_kv = (first_kv(r) for r in res.responses)
    return Meta(closed_kv is not None, Sealed.from_kv(sealed_kv), lease_of(run_kv), res.revision)


def is_closed(client: EtcdClient, keys: RunKeys) -> bool:
    """Whether ``ctl/closed`` exists. One Range."""
    return client.range(keys.closed, count_only=True).count > 0


@dataclass(frozen=True)
class Occupancy:
    """The answer of :func:`count_waiting`."""

    waiting: int  # join keys of round_ + 1
    active: int  # join keys of round_ (its members that are alive and still in it)
    closed: bool
    mine: bool | None = None  # whether the asking node's own join key of round_ exists (if asked)
    aborted: bool = False  # the abort mark exists (the operator stopped the run; see protocol.abort)


def count_waiting(
    client: EtcdClient, keys: RunKeys, round_: int, *, node_key: bytes | None = None
) -> Occupancy:
    """Join keys of ``round_ + 1`` and ``round_``, ``closed``, ``abort`` and, if given, whether
    ``node_key`` exists. One read-only Txn of count-only ranges (O(1) bytes)."""
    ops = [
        op_get(keys.join_prefix(round_ + 1), prefix=True, count_only=True),
        op_get(keys.join_prefix(round_), prefix=True, count_only=True),
        op_get(keys.closed, count_only=True),
        op_get(keys.abort, count_only=True),
    ]
    if node_key is not None:
        ops.append(op_get(node_key, count_only=True))
    res = client.txn([], ops, idempotent=True)
    counts = [count_of(r) for r in res.responses]
    return Occupancy(counts[0], counts[1], counts[2] > 0, None if node_key is None else counts[4] > 0,
                     aborted=counts[3] > 0)


def read_members(client: EtcdClient, keys: RunKeys, round_: int) -> tuple[list[str] | None, int]:
    """The members record of ``round_`` (None if absent) and the read revision. One Range."""
    res = client.range(keys.members(round_))
    return (decode_members(res.kvs[0].value, res.kvs[0].key) if res.kvs else None), res.revision


@dataclass(frozen=True)
class RoundRead:
    """One look at round ``T`` by a seal candidate, at one revision.

    ``joiners``: join keys of ``T`` in create order; ``joins``/``seq_mod``: version and mod revision
    of ``seq/<T>`` (0 if absent); ``prev_count``: join keys left in ``T - 1``.
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
    """The :class:`RoundRead` of a Txn whose responses after the first ``skip`` are :func:`round_ops`'."""
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


def read_round(client: EtcdClient, keys: RunKeys, round_: int) -> RoundRead:
    """Everything a seal of ``round_`` depends on, at one revision. One read-only Txn (O(joiners)
    bytes: only seal candidates call it)."""
    return parse_round(keys, client.txn([], round_ops(keys, round_), idempotent=True))


@dataclass(frozen=True)
class CatchUp:
    """What a waiting node missed before its watch's start, read at ``revision``: ``control`` (the
    ``ctl/`` key-values), ``prev_count`` (join keys left in ``T - 1``)."""

    revision: int
    control: list[Any]
    prev_count: int


def catch_up(client: EtcdClient, keys: RunKeys, round_: int) -> CatchUp:
    """``ctl/`` and the count of round ``T - 1``'s join keys. One read-only Txn, O(1) bytes."""
    previous = op_get(keys.join_prefix(round_ - 1), prefix=True, count_only=True)
    res = client.txn([], [op_get(keys.ctl, keys.ctl_end), previous], idempotent=True)
    control = res.responses[0]
    assert isinstance(control, RangeResult)
    return CatchUp(res.revision, list(control.kvs), count_of(res.responses[1]))


# --------------------------------------------------------------------------- run lease


def ensure_run_lease(
    client: EtcdClient, keys: RunKeys, state_ttl: int, *, timeout: float | None = None
) -> int:
    """The run lease named by ``run``, created (with ``run``) if absent.

    One Range when it exists; else LeaseGrant + one Txn ``[version(run) == 0] -> put run``, and a
    loser revokes its lease and returns the winner's. Only sealers and closers call this. A lease
    etcd refuses (:func:`~etcd_store.client.renewing_lease`) is replaced once.
    """
    existing = lease_of(client.get(keys.run, timeout=timeout))
    if existing is not None:
        return existing

    def create(granted: int) -> tuple[TxnResult, int]:
        return client.txn(
            [compare_version(keys.run, "==", 0)],
            [op_put(keys.run, f"{granted:x}".encode(), lease=granted)],
            [op_get(keys.run)],
            timeout=timeout,
            idempotent=True,
        ), granted

    res, lease = renewing_lease(create, lambda: client.lease_grant(state_ttl, timeout=timeout),
                                lambda _: None, renewals=1)
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

    On success: the join's ``revision``; ``create_revision`` of our key (older if it existed); ``seq``,
    our sequence number (version of ``seq/<T>``); ``count`` and ``prev_count``, the join keys of ``T``
    and ``T - 1``. On failure: the current ``sealed`` and ``closed``, and ``joined_anyway``: our key
    is in the round (a lost answer of an earlier attempt that applied, and the round sealed since).
    """

    ok: bool
    revision: int
    create_revision: int = 0
    seq: int = 0
    count: int = 0
    prev_count: int = 0
    sealed: Sealed = field(default_factory=Sealed)
    closed: bool = False
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
) -> JoinOutcome:
    """Join round ``T = sealed.round + 1`` if it is still open. One Txn::

        if   mod(sealed) == sealed.revision and version(closed) == 0
        then put join/T/<node> (node lease); delete previous_key;
             put seq/T; get seq/T (-> its version: our sequence number);
             count join/T/; count join/(T-1)/
        else get sealed; get closed; count join/T/<node>

    Later operations of a Txn see the earlier ones, so the version read is this
    join's own bump of ``seq/T``: numbers are unique, 1-based, in create order.
    """
    target = sealed.round + 1
    key = keys.join_key(target, node_id)
    success = [op_put(key, value, lease=lease, prev_kv=True)]
    if previous_key is not None and previous_key != key:
        success.append(op_delete(previous_key))
    success += [
        op_put(keys.seq(target), b""),
        op_get(keys.seq(target), keys_only=True),
        op_get(keys.join_prefix(target), prefix=True, count_only=True),
        op_get(keys.join_prefix(target - 1), prefix=True, count_only=True),
    ]
    res = client.txn(
        [compare_mod(keys.sealed, "==", sealed.revision), compare_version(keys.closed, "==", 0)],
        success,
        [op_get(keys.sealed), op_get(keys.closed, count_only=True), op_get(key, count_only=True)],
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
    prev_kv = getattr(res.responses[0], "prev_kv", None)
    seq = first_kv(res.responses[-3])
    assert seq is not None
    return JoinOutcome(
        True,
        res.revision,
        # A re-put of our own key (a replay, a resync) keeps its create revision.
        create_revision=res.revision if prev_kv is None else prev_kv.create_revision,
        seq=seq.version,
        count=count_of(res.responses[-2]),
        prev_count=count_of(res.responses[-1]),
    )


@dataclass(frozen=True)
class SealOutcome:
    """The answer of :func:`seal`; on failure ``read`` is a fresh look at the round, so the caller may
    retry without a read."""

    ok: bool
    revision: int
    read: RoundRead | None = None


def seal(
    client: EtcdClient,
    keys: RunKeys,
    round_: int,
    previous: Sealed,
    read: RoundRead,
    run_lease: int,
    max_nodes: int,
    *,
    master: tuple[str, int] | None = None,
) -> SealOutcome:
    """Seal ``round_`` (= ``previous.round + 1``) with the members ``read`` found. One Txn::

        if   mod(sealed) == previous.revision           (nobody sealed since)
             and version(closed) == 0
             and version(join/(T-1)/ ...) == 0           (previous round vacated)
             and mod(seq/T) == read.seq_mod              (nobody joined or withdrew since the read)
        then put sealed = {T, run lease, master, membership} (run lease)
             put rounds/T/members = node ids in rank order (run lease)
             delete rounds/ older than T-1; delete seq/ up to T
        else the ranges of a RoundRead

    Members: the first ``max_nodes`` joiners of ``read``; ``master``: rank 0's address and port.
    """
    if round_ != previous.round + 1:
        raise ValueError(f"cannot seal round {round_} after round {previous.round}")
    membership = Membership.of(read.joiners, read.joins, max_nodes)
    members = [j.node_id for j in read.joiners[: membership.world]]
    prev_prefix = keys.join_prefix(round_ - 1)
    start, end = keys.rounds_before(round_ - 1)
    seq_start, seq_end = keys.seqs_through(round_)
    res = client.txn(
        [
            compare_mod(keys.sealed, "==", previous.revision),
            compare_version(keys.closed, "==", 0),
            compare_version(prev_prefix, "==", 0, range_end=prefix_range_end(prev_prefix)),
            compare_mod(keys.seq(round_), "==", read.seq_mod),
        ],
        [
            op_put(keys.sealed, encode_sealed(round_, run_lease, master, membership), lease=run_lease),
            op_put(keys.members(round_), json.dumps(members).encode(), lease=run_lease),
            op_delete(start, end),
            op_delete(seq_start, seq_end),
        ],
        round_ops(keys, round_),
        idempotent=True,
    )
    if res.succeeded:
        return SealOutcome(True, res.revision)
    return SealOutcome(False, res.revision, parse_round(keys, res))


def evict_joiners(
    client: EtcdClient, keys: RunKeys, round_: int, previous: Sealed, victims: list[tuple[bytes, int, int, int]]
) -> SealOutcome:
    """Delete the dead joiners ``victims`` (``(key, mod_revision, lease)`` as read) of the unsealed
    ``round_`` (:mod:`~etcd_rdzv.native.leases`). One Txn::

        if   mod(sealed) == previous.revision          (round_ still unsealed)
             and, for each victim, mod(key) == m and lease(key) == l   (unchanged since the read)
        then delete each key; put seq/T                 (a withdrawal: fences older reads)
             put ctl/evicted = {T, victims' create revisions}   (no lease; tells a live victim)
             + the ranges of a RoundRead                (after the deletes: a fresh read)
        else the ranges of a RoundRead

    The ``seq/T`` bump fails any seal prepared from an older read, so no seal names an evicted
    joiner. ``ctl/evicted`` reaches every node waiting in ``T`` on its ``ctl/`` watch (one event per
    eviction): a victim that was alive after all (stalled on its path to etcd, its lease fine) learns
    it lost its place and joins again at once, instead of waiting without a key. ``victims`` are
    ``(key, mod_revision, lease, create_revision)``. ``ok``: the keys were deleted; ``read``: the round
    after the Txn either way. A replay fails its compares and returns a read.
    """
    if round_ != previous.round + 1:
        raise ValueError(f"cannot evict from round {round_} after round {previous.round}")
    compares = [compare_mod(keys.sealed, "==", previous.revision)]
    deletes = []
    for key, mod_revision, lease, _ in victims:
        compares += [compare_mod(key, "==", mod_revision), compare_lease(key, "==", lease)]
        deletes.append(op_delete(key))
    told = op_put(keys.evicted, encode_evicted(round_, [created for *_, created in victims]))
    reads = round_ops(keys, round_)
    res = client.txn(compares, [*deletes, op_put(keys.seq(round_), b""), told, *reads], reads, idempotent=True)
    if not res.succeeded:
        return SealOutcome(False, res.revision, parse_round(keys, res))
    return SealOutcome(True, res.revision, parse_round(keys, res, skip=len(deletes) + 2))


def reattach(
    client: EtcdClient,
    keys: RunKeys,
    round_: int,
    join_key: bytes,
    value: bytes,
    lease: int,
    seal_revision: int,
) -> Occupancy | None:
    """Put a member's join key of ``round_`` back on a new ``lease`` if ``round_`` is still the last
    sealed round and the run is open. One Txn::

        if   mod(sealed) == seal_revision and version(closed) == 0
        then put join/R/<node> (new lease); count join/(R+1)/; count join/R/
        else (nothing)

    For a member whose lease expired in an etcd outage while its group runs: no later seal happened,
    so no group formed without it, and the put keeps the next round from being sealed. Returns the
    counts after the put (``mine`` True), or None. A replay re-puts the same key and lease.
    """
    prefix = keys.join_prefix(round_)
    res = client.txn(
        [compare_mod(keys.sealed, "==", seal_revision), compare_version(keys.closed, "==", 0)],
        [
            op_put(join_key, value, lease=lease),
            op_get(keys.join_prefix(round_ + 1), prefix=True, count_only=True),
            op_get(prefix, prefix=True, count_only=True),
        ],
        idempotent=True,
    )
    if not res.succeeded:
        return None
    return Occupancy(count_of(res.responses[1]), count_of(res.responses[2]), False, True)


def leave_if_unsealed(
    client: EtcdClient,
    keys: RunKeys,
    round_: int,
    join_key: bytes,
    sealed: Sealed,
    *,
    timeout: float | None = None,
) -> bool:
    """Withdraw a join of ``round_`` unless the round got sealed meanwhile. One Txn::

        if mod(sealed) == sealed.revision then delete join_key; put seq/T

    The ``seq/T`` bump fails any seal prepared before it: no seal names a node that left.
    """
    res = client.txn(
        [compare_mod(keys.sealed, "==", sealed.revision)],
        [op_delete(join_key), op_put(keys.seq(round_), b"")],
        timeout=timeout,
        idempotent=True,
    )
    return res.succeeded


def close(client: EtcdClient, keys: RunKeys, run_lease: int, *, timeout: float | None = None) -> bool:
    """Mark the run closed once: ``[version(closed) == 0] -> put closed``. One Txn.

    No round forms after it (every join compares ``closed``); running members keep running
    (:func:`abort` stops them too). Whether this call closed it.
    """
    return _put_once(client, keys.closed, run_lease, timeout)


def _put_once(client: EtcdClient, key: bytes, lease: int, timeout: float | None) -> bool:
    """``[version(key) == 0] -> put key = 1`` on ``lease``; whether this call put it (a replay fails its
    compare). One Txn."""
    res = client.txn([compare_version(key, "==", 0)], [op_put(key, b"1", lease=lease)], timeout=timeout,
                     idempotent=True)
    return res.succeeded


@dataclass(frozen=True)
class AbortOutcome:
    """The answer of :func:`abort`: whether this call closed the run, and whether it wrote the mark."""

    closed: bool
    aborted: bool


def abort(client: EtcdClient, keys: RunKeys, run_lease: int, *, timeout: float | None = None) -> AbortOutcome:
    """Close the run and stop every agent now (``etcd-rdzv close``): unlike :func:`close` (each agent's
    normal end, which must not stop a slower node's workers), ``ctl/abort`` makes every member's
    ``num_nodes_waiting()`` positive. One Txn, two when the run was closed but not aborted::

        if   version(closed) == 0 and version(abort) == 0
        then put closed; put abort                  (run lease; one revision)
        else count abort
        [closed, not aborted:] if version(abort) == 0 then put abort

    The mark is never written without ``closed`` (no node sees an aborted run open), ``closed`` never
    twice; replays fail their compare.
    """
    res = client.txn(
        [compare_version(keys.closed, "==", 0), compare_version(keys.abort, "==", 0)],
        [op_put(keys.closed, b"1", lease=run_lease), op_put(keys.abort, b"1", lease=run_lease)],
        [op_get(keys.abort, count_only=True)],
        timeout=timeout,
        idempotent=True,
    )
    if res.succeeded:
        return AbortOutcome(True, True)
    if count_of(res.responses[0]) > 0:
        return AbortOutcome(False, False)
    return AbortOutcome(False, _put_once(client, keys.abort, run_lease, timeout))


def remove_round_records_if_idle(
    client: EtcdClient, keys: RunKeys, *, timeout: float | None = None
) -> bool:
    """Delete the ``rounds/`` keys of rounds before the last sealed one, every ``seq/`` key and
    ``ctl/evicted`` if no node holds a join key. One Range and one Txn, fenced on the sealed record.

    The last node out removes what the run-lease TTL does not cover (the open round's counter, older
    rounds' stores kept on a lease of their own). The last sealed round's records stay: its members may
    still run after an outage expired their join keys (they re-attach), and its records ride on the
    run lease, which ends a TTL after the last node stops renewing it. A ``seq/`` counter deleted here
    restarts at 1 for the next joiner; no node confuses an old number with a new one, as a rank is
    handed only for a create revision the seal names (:class:`~etcd_rdzv.native.records.Membership`).
    """
    sealed = read_meta(client, keys).sealed
    root = keys.join_root
    start, end = keys.rounds_before(sealed.round)
    res = client.txn(
        [compare_version(root, "==", 0, range_end=prefix_range_end(root)),
         compare_mod(keys.sealed, "==", sealed.revision)],
        [op_delete(start, end), op_delete(keys.seq_root, prefix=True), op_delete(keys.evicted)],
        timeout=timeout,
        idempotent=True,
    )
    if res.succeeded:
        deleted = res.responses[0]
        assert isinstance(deleted, DeleteResult)
        log.debug("removed %d round records of %s", deleted.deleted, keys.root)
    return res.succeeded
