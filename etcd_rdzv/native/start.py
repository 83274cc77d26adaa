"""The start of a sealed ``etcd-v3`` round: every member confirms it before any member returns
it, and the members learn ``MASTER_ADDR``/``MASTER_PORT``.

A seal names the joiners of round ``T`` that the sealer read. One of them may be dead already (killed
less than its eviction bound before the seal, or between the sealer's read and its seal Txn) or die
right after. torch's agent, once ``next_rendezvous`` returns, waits in a store barrier over every
named rank (``_assign_worker_ranks``) and polls nothing meanwhile: with a dead member named it waits
until the store's timeout, then its agent fails. So no member returns ``T`` until every member has
confirmed it:

* each member, once admitted, **acks**: ``if version(join/T/<me>) > 0 and version(rounds/T/start) == 0
  then put rounds/T/start-acks/<me>`` (run lease), reading in the same Txn the number of acks, the number of
  join keys of ``T`` and ``rounds/T/start``;
* the fate of the round is one key, ``rounds/T/start``, put once (``if version == 0``; run lease):
  ``go`` by a member that counted every member's ack, ``void`` by a member that saw a join key of
  ``T`` gone (a member's lease expired, or it withdrew) before every member acked, or whose own key is
  gone (its lease was lost: it cannot take part);
* a member that can decide neither waits on one watch (from the ack's revision on) of the join keys of
  ``T`` and the start key, and looks again on a departure (the acks, under ``start-acks/``, sort after
  the start key, outside the watched range: a member hears the fate, not every other member's ack); ``go`` returns the round, ``void`` makes
  every member re-join ``T + 1`` as a member of ``T`` (the old group re-forms without the gone member,
  skipping the last call with ``fast_recovery``).

Why it is safe: an ack is fenced on the member's own join key and on no fate being decided, and a
gone key never comes back (a member leaves ``T`` only by joining a later round), so once a member's key
is gone the acks cannot reach the world size: ``go`` and ``void`` are exclusive, decided once by etcd,
and every member sees the same fate. A member that dies after ``go`` is torch's ordinary failure (its
peers' collectives fail, ``num_nodes_waiting()`` reports it); the window in which its death strands
the others in torch's rank barrier is from its ack to its role write, milliseconds (without the
acks it would be from the seal to the role write, up to ``last_call_timeout``).

Costs per member and round: one Txn (the ack), one watch opened before it, and at most one more Txn
(``go`` by the last acker, ``void`` by the first to see a departure). A dead member is found when its
key goes: its lease TTL (``heartbeat``) after its death at most.

**MASTER_ADDR/MASTER_PORT.** Every join key holds its node's address, a free port of its host and when that port
was probed (:func:`join_value`). The sealer reads every join key of the round before
it seals; while rank 0's probe is recent (:data:`MASTER_PORT_MAX_AGE`) it names rank
0's address and port in the ``sealed`` record (:func:`master_of`), and no member makes
an RPC to learn them. Otherwise (rank 0 waited long: a port probed then may be taken
now) the record names none; rank 0 then probes a port when it learns its rank, as
torch does once the round is known, and publishes it in the round's store, where the
other members read it (torch's ``RendezvousStoreInfo.build``) (:func:`bootstrap_info`). The
round's store (:func:`round_store`) rides on the run lease.

Round trips are stated per function; every call is bounded by the client's timeout.
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
from .records import RunKeys, count_of, load_json

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
    """The member's next step (pure). A decided fate wins; then every ack counted means go; then
    a gone key (ours, or one of ``T``'s: fewer join keys than members) means void; else wait."""
    if read.start == GO:
        return Fate.STARTED
    if read.start is not None:
        return Fate.VOIDED
    if read.acks >= world:
        return Fate.PUT_GO
    if not read.mine or read.present < world:
        return Fate.PUT_VOID
    return Fate.WAIT


def _ranges(keys: RunKeys, round_: int) -> list[object]:
    return [op_get(keys.acks_prefix(round_), prefix=True, count_only=True),
            op_get(keys.join_prefix(round_), prefix=True, count_only=True),
            op_get(keys.start(round_))]


def _read(res: TxnResult, mine: bool, skip: int = 0) -> StartRead:
    acks, present, start = res.responses[skip:skip + 3]
    kvs = getattr(start, "kvs", [])
    return StartRead(res.revision, count_of(acks), count_of(present), kvs[0].value if kvs else None, mine)


def acknowledge(client: EtcdClient, keys: RunKeys, round_: int, node_id: str, run_lease: int) -> StartRead:
    """The ack Txn (module docstring); its read. One Txn."""
    mine = keys.join_key(round_, node_id)
    res = client.txn(
        [compare_version(mine, ">", 0), compare_version(keys.start(round_), "==", 0)],
        [op_put(keys.ack(round_, node_id), b"", lease=run_lease), *_ranges(keys, round_), op_get(mine, count_only=True)],
        [*_ranges(keys, round_), op_get(mine, count_only=True)],
        idempotent=True,
    )
    skip = 1 if res.succeeded else 0
    return _read(res, count_of(res.responses[skip + 3]) > 0, skip)


def look(client: EtcdClient, keys: RunKeys, round_: int, node_id: str) -> StartRead:
    """The start of ``round_`` as it is now. One read-only Txn."""
    mine = keys.join_key(round_, node_id)
    res = client.txn([], [*_ranges(keys, round_), op_get(mine, count_only=True)], idempotent=True)
    return _read(res, count_of(res.responses[3]) > 0)


def settle(client: EtcdClient, keys: RunKeys, round_: int, fate: bytes, run_lease: int) -> bytes:
    """Put ``fate`` as the start of ``round_`` unless one is there; the stored fate. One Txn."""
    key = keys.start(round_)
    res = client.txn([compare_version(key, "==", 0)], [op_put(key, fate, lease=run_lease)], [op_get(key)],
                     idempotent=True)
    if res.succeeded:
        return fate
    kvs = getattr(res.responses[0], "kvs", [])
    return kvs[0].value if kvs else fate  # (a replayed put that had applied: ours)


def start_round(client: EtcdClient, keys: RunKeys, round_: int, world: int, node_id: str, run_lease: int,
                deadline: float) -> bool | None:
    """Ack round ``round_`` of ``world`` members and wait for its fate: True (go), False (void: re-join
    the next round), None (``deadline``, a monotonic time, passed undecided: the caller gives up as a
    join timeout). Blocks until one of them; raises ``EtcdError`` from a call that failed."""
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
"""Seconds a port probed at join time may be old when the round is sealed and still be
named as ``MASTER_PORT`` (older: rank 0 probes a new one once it learns its rank). The
age is the sealer's wall clock minus the joiner's (hosts of one job keep their clocks
within far less than that; a probe stamped more than this far in the future is not
trusted either). torch's agent probes the port once the round is known and its workers
bind it seconds later; a round's rank 0 is its earliest joiner, which usually joined
well within a minute before the seal (a re-rendezvous), but may have waited for hours
(a full group kept it out)."""


def join_value(node_addr: str, pace: Mapping[str, float] | None = None) -> bytes:
    """What this node's join key holds: its address, pid, a free port of its host probed
    now and when (``probed``, wall-clock seconds), and ``pace``'s fields (how it renews its
    lease, which eviction reads: :meth:`~etcd_rdzv.native.leases.Pace.fields`). If it becomes
    rank 0 of a round sealed soon enough, that port is the round's ``MASTER_PORT`` (:func:`master_of`)."""
    return json.dumps(
        {"addr": node_addr, "pid": os.getpid(), "port": get_free_port(), "probed": round(time.time(), 3),
         **(pace or {})}
    ).encode()


def address_of(value: bytes) -> tuple[str | None, int | None]:
    """``(addr, port)`` of a join value; None for what it lacks or what is malformed."""
    doc = _doc(value)
    addr, port = doc.get("addr"), doc.get("port")
    return (addr if isinstance(addr, str) and addr else None,
            port if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 else None)


def master_of(value: bytes, now: float, max_age: float | None = None) -> tuple[str, int] | None:
    """Rank 0's ``(addr, port)`` for the sealed record, from its join value, when its port
    was probed at most ``max_age`` (default :data:`MASTER_PORT_MAX_AGE`) seconds before
    ``now`` (wall clock); None when it is older, its time is unknown, or the value lacks
    an address or port (the members then learn rank 0's fresh port from the store)."""
    limit = MASTER_PORT_MAX_AGE if max_age is None else max_age
    addr, port = address_of(value)
    probed = _doc(value).get("probed")
    if addr is None or port is None or isinstance(probed, bool) or not isinstance(probed, (int, float)):
        return None
    if not math.isfinite(probed) or abs(now - probed) > limit:
        return None
    return addr, port


def _doc(value: bytes) -> dict[str, object]:
    """A join value's JSON object, bounded in size and depth (``load_json``); {} when malformed."""
    try:
        doc = load_json(value)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def bootstrap_info(
    rank: int, store: EtcdStore, master: tuple[str, int] | None, node_addr: str
) -> RendezvousStoreInfo:
    """``MASTER_ADDR``/``MASTER_PORT`` of the round.

    ``master`` (rank 0's address and recently probed port, from the sealed record): every
    member takes it, no RPC; rank 0 also publishes both in the round's store (one Txn),
    where torch's ``RendezvousStoreInfo.build`` looks. Without it, rank 0 probes a free
    port of its host now (the round is known: as torch does) and publishes it with its
    address (one Txn); the others wait for that in the store (torch's ``build``: a read,
    and a watch until rank 0 wrote it, within the store's timeout).
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
    alive already (they go when a later seal deletes old rounds, when the last node leaves, or with the
    run lease), so it needs no keep-alive of its own; without a known run lease the store keeps a
    namespace lease of TTL ``state_ttl`` instead."""
    from etcd_store import EtcdStore

    return EtcdStore(client, prefix=keys.store_prefix(round_), timeout=timedelta(seconds=client.timeout),
                     lease_ttl=max(state_ttl, 2), lease=run_lease)
