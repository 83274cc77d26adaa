"""How the members of an ``etcd-v3`` round learn ``MASTER_ADDR``/``MASTER_PORT``.

Every join key holds its node's address, a free port of its host and when that port
was probed (:func:`join_value`). The sealer reads every join key of the round before
it seals; while rank 0's probe is recent (:data:`MASTER_PORT_MAX_AGE`) it names rank
0's address and port in the ``sealed`` record (:func:`master_of`), and no member makes
an RPC to learn them. Otherwise (rank 0 waited long: a port probed then may be taken
now) the record names none; rank 0 then probes a port when it learns its rank, as
torch does once the round is known, and publishes it in the round's store, where the
other members read it (torch's ``RendezvousStoreInfo.build``) (:func:`bootstrap_info`).

Round trips are stated per function; every call is bounded by the client's timeout.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.utils.distributed import get_free_port

from .records import load_json

if TYPE_CHECKING:
    from etcd_store import EtcdStore

log = logging.getLogger(__name__)

__all__ = ["MASTER_PORT_MAX_AGE", "address_of", "bootstrap_info", "join_value", "master_of"]

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
    lease, which eviction reads: :meth:`~etcd_rdzv.native.eviction.Pace.fields`). If it becomes
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
