"""The start of a sealed ``etcd-v3`` round: every member confirms it before any member returns it,
and the members learn ``MASTER_ADDR``/``MASTER_PORT``.

A seal may name a joiner that is dead already (killed less than its eviction bound before the seal)
or dies right after. Once ``next_rendezvous`` returns, torch's agent waits in a store barrier over
every rank and polls nothing, so a dead member named makes it wait the store's timeout and fail.
Hence no member returns ``T`` until every member confirmed it (docs/etcd-v3-design.md, Transitions, "Start"):
each member **acks** (``if create(join/T/<me>) == mine and version(rounds/T/start) == 0 and
version(ctl/abort) == 0 then put rounds/T/start-acks/<me>``, reading acks, join keys, fate, its own
key and ack); the fate ``rounds/T/start`` is put once, with its copy ``ctl/fate``: ``go`` by a member
that counted every ack, ``void`` by one that saw a join key of ``T`` (or its own) gone first; otherwise
a member watches ``[ctl/, join/T+1/)`` (the fate's copy, an abort, the join keys of ``T``; not the
newcomers of ``T + 1``) and looks again on a departure or the fate. ``void`` makes every member re-join
``T + 1`` as a member of ``T``.

Why it is safe: an ack is fenced on the member's own key (by create revision: the key the seal named,
not one put again since) and on no fate decided, and a gone key never comes back, so once a key is
gone the acks cannot reach the world size: ``go`` and ``void`` are exclusive, decided once by etcd,
seen alike by all. A member returns ``T`` only with its own ack counted (identity by etcd: a node whose
key etcd no longer backs never takes a rank). An abort (``etcd-rdzv close``) ends every wait at its
event. Cost per member and round: one watch, one ack Txn, at most one more Txn, one event (the fate)
unless a member departs; a dead member is found within its lease TTL.

**MASTER_ADDR/MASTER_PORT.** Every join value holds the node's address and a free port with its
probe time (:func:`join_value`). While rank 0's probe is recent (:data:`MASTER_PORT_MAX_AGE`) the
sealer names them in the ``sealed`` record (:func:`master_of`): no RPC for them; else rank 0 probes
once it knows its rank, as torch does, and publishes in the round's store (:func:`bootstrap_info`,
:func:`round_store`). Every call is bounded by the client's timeout.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.utils.distributed import get_free_port

from etcd_store.client import EtcdClient, Event, TxnResult, compare_create, compare_version, op_get, op_put

from .leases import confirm
from .records import RunClosed, RunKeys, address_in, count_of, first_kv, join_doc

if TYPE_CHECKING:
    from etcd_store import EtcdStore

log = logging.getLogger(__name__)

__all__ = ["GO", "MASTER_PORT_MAX_AGE", "VOID", "Fate", "StartRead", "address_of", "bootstrap_info", "decide",
           "join_value", "master_of", "round_store", "start_round"]

GO = b"go"
VOID = b"void"


class Fate(enum.Enum):
    """What a member does next with what it read (:func:`decide`)."""

    STARTED = "started"  # rounds/T/start is go and counted our ack: return the round
    VOIDED = "voided"  # rounds/T/start is void: re-join the next round
    OUT = "out"  # go without our ack (our key was not the one named): we are no member, re-join
    ABORTED = "aborted"  # the operator aborted the run
    PUT_GO = "put go"  # every member acked: decide go
    PUT_VOID = "put void"  # a member's key is gone before every ack: decide void
    WAIT = "wait"


@dataclass(frozen=True)
class StartRead:
    """One look at the start of round ``T`` at ``revision``: acks, join keys present, the start value
    (None: undecided), whether this member's own join key is there (with its create revision, when
    known), whether its ack is, and whether the run was aborted."""

    revision: int
    acks: int
    present: int
    start: bytes | None
    mine: bool
    acked: bool = False
    aborted: bool = False


def decide(read: StartRead, world: int) -> Fate:
    """The member's next step (pure): an abort ends it; a decided fate wins (go only with our own ack
    counted); every ack counted means go; a gone key (ours, or fewer join keys than members) means void;
    else wait."""
    if read.aborted:
        return Fate.ABORTED
    if read.start == GO:
        return Fate.STARTED if read.acked else Fate.OUT
    if read.start is not None:
        return Fate.VOIDED
    if read.acks >= world:  # acks come from keys the seal named: without ours, we are none of them
        return Fate.PUT_GO if read.acked else Fate.OUT
    if not read.mine or read.present < world:
        return Fate.PUT_VOID
    return Fate.WAIT


def _reads(keys: RunKeys, round_: int, node_id: str) -> list[object]:
    """The ranges of a :class:`StartRead`: acks, join keys, start value, our own join key and ack, abort."""
    return [op_get(keys.acks_prefix(round_), prefix=True, count_only=True),
            op_get(keys.join_prefix(round_), prefix=True, count_only=True),
            op_get(keys.start(round_)), op_get(keys.join_key(round_, node_id), keys_only=True),
            op_get(keys.ack(round_, node_id), count_only=True), op_get(keys.abort, count_only=True)]


def _read(res: TxnResult, created: int, skip: int = 0) -> StartRead:
    acks, present, start, mine, acked, aborted = res.responses[skip:skip + 6]
    kv, own = first_kv(start), first_kv(mine)
    value = kv.value if kv else None
    ours = own is not None and (not created or own.create_revision == created)
    return StartRead(res.revision, count_of(acks), count_of(present), value, ours, count_of(acked) > 0,
                     count_of(aborted) > 0)


def acknowledge(client: EtcdClient, keys: RunKeys, round_: int, node_id: str, run_lease: int,
                created: int = 0) -> StartRead:
    """The ack Txn (module docstring); its read. ``created``: our join key's create revision (0: not
    known, then any key of ours). One Txn."""
    mine = keys.join_key(round_, node_id)
    reads = _reads(keys, round_, node_id)
    own = compare_create(mine, "==", created) if created else compare_version(mine, ">", 0)
    res = client.txn(
        [own, compare_version(keys.start(round_), "==", 0), compare_version(keys.abort, "==", 0)],
        [op_put(keys.ack(round_, node_id), b"", lease=run_lease), *reads],
        reads,
        idempotent=True,
    )
    return _read(res, created, 1 if res.succeeded else 0)


def look(client: EtcdClient, keys: RunKeys, round_: int, node_id: str, created: int = 0) -> StartRead:
    """The start of ``round_`` as it is now. One read-only Txn."""
    return _read(client.txn([], _reads(keys, round_, node_id), idempotent=True), created)


def settle(client: EtcdClient, keys: RunKeys, round_: int, fate: bytes, run_lease: int) -> bytes:
    """Put ``fate`` as the start of ``round_`` unless one is there, with its copy ``ctl/fate``; the
    stored fate. One Txn."""
    key = keys.start(round_)
    res = client.txn([compare_version(key, "==", 0)],
                     [op_put(key, fate, lease=run_lease), op_put(keys.fate, b"%d %s" % (round_, fate), lease=run_lease)],
                     [op_get(key)], idempotent=True)
    kv = None if res.succeeded else first_kv(res.responses[0])
    return kv.value if kv else fate  # (none: a replayed put that had applied: ours)


def start_round(client: EtcdClient, keys: RunKeys, round_: int, world: int, node_id: str, run_lease: int,
                deadline: float, *, created: int = 0) -> bool | None:
    """Ack round ``round_`` of ``world`` members and wait for its fate: True (go), False (void, or go
    without us: re-join), None (``deadline``, monotonic, passed undecided). ``created``: our join key's
    create revision (0: not known). Raises ``RunClosed`` when the run was aborted, ``EtcdError`` from a
    failed call."""
    lo, hi = keys.start_watch_range(round_)
    with client.watch(lo, hi) as watch:
        confirm(client, watch, node_id)
        read = acknowledge(client, keys, round_, node_id, run_lease, created)
        while True:
            fate = decide(read, world)
            if fate is Fate.STARTED:
                return True
            if fate is Fate.VOIDED:
                return False
            if fate is Fate.OUT:
                log.warning("node %s: round %d started without it (its join key is not the one the seal "
                            "named): re-joining", node_id, round_)
                return False
            if fate is Fate.ABORTED:
                raise RunClosed(f"the rendezvous {keys.root!r} was aborted while round {round_} started")
            if fate is not Fate.WAIT:
                chosen = GO if fate is Fate.PUT_GO else VOID
                stored = settle(client, keys, round_, chosen, run_lease)
                if stored != GO:
                    log.warning("node %s: round %d of %d members is void (a member's join key went before "
                                "every member confirmed the round): re-joining", node_id, round_, world)
                return stored == GO
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if _departure_or_fate(watch.get(timeout=left), keys, round_, read.revision):
                read = look(client, keys, round_, node_id, created)


def _departure_or_fate(events: list[Event], keys: RunKeys, round_: int, since: int) -> bool:
    """Whether ``events`` (newer than the read at ``since``) hold a departure from the round, its fate or
    an abort (other ``ctl/`` events, such as a close, change nothing here)."""
    join_prefix = keys.join_prefix(round_)
    for ev in events:
        if ev.kv.mod_revision <= since:
            continue
        if ev.type == "DELETE":
            if ev.key.startswith(join_prefix):
                return True
        elif ev.key == keys.abort or (ev.key == keys.fate and ev.kv.value.startswith(b"%d " % round_)):
            return True
    return False


# --------------------------------------------------------------------------- MASTER_ADDR/MASTER_PORT

MASTER_PORT_MAX_AGE = 60.0
"""Seconds a port probed at join time may be old at the seal and still be named ``MASTER_PORT``
(else rank 0 probes a new one once it knows its rank). The age is the sealer's wall clock minus
the joiner's (a job's hosts agree far better than that; a probe this far in the future is not
trusted either). Rank 0 usually joined well within a minute of the seal, but may have waited for
hours, kept out by a full group."""


def join_value(node_addr: str, pace: Mapping[str, float] | None = None) -> bytes:
    """This node's join value: address, pid, a free port of its host probed now and when (``probed``,
    wall clock), and ``pace``'s fields (read by eviction, :meth:`~etcd_rdzv.native.leases.Pace.fields`)."""
    return json.dumps(
        {"addr": node_addr, "pid": os.getpid(), "port": get_free_port(), "probed": round(time.time(), 3),
         **(pace or {})}
    ).encode()


def address_of(value: bytes) -> tuple[str | None, int | None]:
    """``(addr, port)`` of a join value; None for what it lacks or what is malformed."""
    return _fields(value)[:2]


def master_of(value: bytes, now: float, max_age: float | None = None) -> tuple[str, int] | None:
    """Rank 0's ``(addr, port)`` from its join value, when the port was probed at most ``max_age``
    (default :data:`MASTER_PORT_MAX_AGE`) from ``now`` (wall clock); else None (members then read rank
    0's fresh port from the store)."""
    limit = MASTER_PORT_MAX_AGE if max_age is None else max_age
    addr, port, probed = _fields(value)
    if addr is None or port is None or isinstance(probed, bool) or not isinstance(probed, (int, float)):
        return None
    if not math.isfinite(probed) or abs(now - probed) > limit:
        return None
    return addr, port


def _fields(value: bytes) -> tuple[str | None, int | None, object]:
    """``(addr, port, probed)`` of a join value, parsed once
    (:func:`~etcd_rdzv.native.records.join_doc`)."""
    doc = join_doc(value)
    return (*address_in(doc.get("addr"), doc.get("port")), doc.get("probed"))


def bootstrap_info(
    rank: int, store: EtcdStore, master: tuple[str, int] | None, node_addr: str
) -> RendezvousStoreInfo:
    """``MASTER_ADDR``/``MASTER_PORT`` of the round.

    With ``master`` (from the sealed record) every member takes it with no RPC, and rank 0 also
    publishes it in the round's store (one Txn). Without it rank 0 probes a free port now and
    publishes it with its address (one Txn); the others wait for it in the store (torch's
    ``RendezvousStoreInfo.build``, within the store's timeout).
    """
    if master is not None and rank != 0:
        return RendezvousStoreInfo(*master)
    if rank == 0:
        addr, port = master if master is not None else (node_addr, get_free_port())
        store.multi_set(
            [RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY],
            [addr.encode(), str(port).encode()],
        )
        return RendezvousStoreInfo(addr, port)
    return RendezvousStoreInfo.build(rank, store, local_addr=node_addr)


def round_store(client: EtcdClient, keys: RunKeys, round_: int, state_ttl: int, run_lease: int | None) -> EtcdStore:
    """The ``EtcdStore`` of ``round_``. No RPC: its keys ride on the run lease, which every node keeps
    alive (they go with a later seal's cleanup, the last node's leave, or the run lease); without a
    known run lease the store keeps its own lease of TTL ``state_ttl``."""
    from etcd_store import EtcdStore

    return EtcdStore(client, prefix=keys.store_prefix(round_), timeout=timedelta(seconds=client.timeout),
                     lease_ttl=max(state_ttl, 2), lease=run_lease)
