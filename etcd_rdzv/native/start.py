"""The start of a sealed ``etcd-v3`` round: every member confirms it before any member returns it,
and the members learn ``MASTER_ADDR``/``MASTER_PORT``.

A seal may name a joiner that is dead already (killed less than its eviction bound before the seal)
or dies right after. Once ``next_rendezvous`` returns, torch's agent waits in a store barrier over
every rank and polls nothing, so a dead member named makes it wait the store's timeout and fail.
Hence no member returns ``T`` until every member confirmed it (docs/etcd-v3-design.md, Transitions, "Start"):
each member **acks** (``if version(join/T/<me>) > 0 and version(rounds/T/start) == 0 then put
rounds/T/start-acks/<me>``, reading acks, join keys and fate); the fate ``rounds/T/start`` is put
once: ``go`` by a member that counted every ack, ``void`` by one that saw a join key of ``T`` (or
its own) gone first; otherwise a member watches the join keys of ``T`` and the start key and looks
again on a departure. ``void`` makes every member re-join ``T + 1`` as a member of ``T``.

Why it is safe: an ack is fenced on the member's own key and on no fate decided, and a gone key
never comes back, so once a key is gone the acks cannot reach the world size: ``go`` and ``void``
are exclusive, decided once by etcd, seen alike by all. Cost per member and round: one watch, one
ack Txn, at most one more Txn; a dead member is found within its lease TTL.

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

from etcd_store.client import EtcdClient, Event, TxnResult, compare_version, op_get, op_put

from .leases import confirm
from .records import RunKeys, address_in, count_of, first_kv, join_doc

if TYPE_CHECKING:
    from etcd_store import EtcdStore

log = logging.getLogger(__name__)

__all__ = ["GO", "MASTER_PORT_MAX_AGE", "VOID", "Fate", "StartRead", "address_of", "bootstrap_info", "decide",
           "join_value", "master_of", "round_store", "start_round"]

GO = b"go"
VOID = b"void"


class Fate(enum.Enum):
    """What a member does next with what it read (:func:`decide`)."""

    STARTED = "started"  # rounds/T/start is go: return the round
    VOIDED = "voided"  # rounds/T/start is void: re-join the next round
    PUT_GO = "put go"  # every member acked: decide go
    PUT_VOID = "put void"  # a member's key is gone before every ack: decide void
    WAIT = "wait"


@dataclass(frozen=True)
class StartRead:
    """One look at the start of round ``T`` at ``revision``: acks, join keys present, the start
    value (None: undecided) and whether this member's own join key is there."""

    revision: int
    acks: int
    present: int
    start: bytes | None
    mine: bool


def decide(read: StartRead, world: int) -> Fate:
    """The member's next step (pure): a decided fate wins; every ack counted means go; a gone key (ours,
    or fewer join keys than members) means void; else wait."""
    if read.start == GO:
        return Fate.STARTED
    if read.start is not None:
        return Fate.VOIDED
    if read.acks >= world:
        return Fate.PUT_GO
    if not read.mine or read.present < world:
        return Fate.PUT_VOID
    return Fate.WAIT


def _reads(keys: RunKeys, round_: int, mine: bytes) -> list[object]:
    """The ranges of a :class:`StartRead`: acks, join keys, start value, our own join key."""
    return [op_get(keys.acks_prefix(round_), prefix=True, count_only=True),
            op_get(keys.join_prefix(round_), prefix=True, count_only=True),
            op_get(keys.start(round_)), op_get(mine, count_only=True)]


def _read(res: TxnResult, skip: int = 0) -> StartRead:
    acks, present, start, mine = res.responses[skip:skip + 4]
    kv = first_kv(start)
    value = kv.value if kv else None
    return StartRead(res.revision, count_of(acks), count_of(present), value, count_of(mine) > 0)


def acknowledge(client: EtcdClient, keys: RunKeys, round_: int, node_id: str, run_lease: int) -> StartRead:
    """The ack Txn (module docstring); its read. One Txn."""
    mine = keys.join_key(round_, node_id)
    reads = _reads(keys, round_, mine)
    res = client.txn(
        [compare_version(mine, ">", 0), compare_version(keys.start(round_), "==", 0)],
        [op_put(keys.ack(round_, node_id), b"", lease=run_lease), *reads],
        reads,
        idempotent=True,
    )
    return _read(res, 1 if res.succeeded else 0)


def look(client: EtcdClient, keys: RunKeys, round_: int, node_id: str) -> StartRead:
    """The start of ``round_`` as it is now. One read-only Txn."""
    return _read(client.txn([], _reads(keys, round_, keys.join_key(round_, node_id)), idempotent=True))


def settle(client: EtcdClient, keys: RunKeys, round_: int, fate: bytes, run_lease: int) -> bytes:
    """Put ``fate`` as the start of ``round_`` unless one is there; the stored fate. One Txn."""
    key = keys.start(round_)
    res = client.txn([compare_version(key, "==", 0)], [op_put(key, fate, lease=run_lease)], [op_get(key)],
                     idempotent=True)
    kv = None if res.succeeded else first_kv(res.responses[0])
    return kv.value if kv else fate  # (none: a replayed put that had applied: ours)


def start_round(client: EtcdClient, keys: RunKeys, round_: int, world: int, node_id: str, run_lease: int,
                deadline: float) -> bool | None:
    """Ack round ``round_`` of ``world`` members and wait for its fate: True (go), False (void: re-join),
    None (``deadline``, monotonic, passed undecided). Raises ``EtcdError`` from a failed call."""
    lo = keys.join_prefix(round_)
    hi = keys.start(round_) + b"\0"
    with client.watch(lo, hi) as watch:
        confirm(client, watch, node_id)
        read = acknowledge(client, keys, round_, node_id, run_lease)
        while True:
            fate = decide(read, world)
            if fate is Fate.STARTED:
                return True
            if fate is Fate.VOIDED:
                return False
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
            if _departure_or_fate(watch.get(timeout=left), lo, keys.start(round_), read.revision):
                read = look(client, keys, round_, node_id)


def _departure_or_fate(events: list[Event], join_prefix: bytes, start_key: bytes, since: int) -> bool:
    """Whether ``events`` (newer than the read at ``since``) hold a departure from the round or its fate."""
    for ev in events:
        if ev.kv.mod_revision <= since:
            continue
        if ev.key == start_key or (ev.type == "DELETE" and ev.key.startswith(join_prefix)):
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
