"""How the members of an ``etcd-v3`` round learn ``MASTER_ADDR``/``MASTER_PORT``.

Every join key holds its node's address and a free port of its host, picked at
join time (:func:`join_value`). The sealer reads every join key of the round
before it seals, so it names rank 0's address and port in the ``sealed`` record
and no member makes an RPC to learn them (:func:`bootstrap_info`); the
fallbacks (a join value without them) read the earliest join key at the seal
revision, or torch's keys in the round's store, which rank 0 always writes.

Round trips are stated per function; every call is bounded by the client's timeout.
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING

from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.utils.distributed import get_free_port

from etcd_store.errors import EtcdCompactedError

from .records import load_json

if TYPE_CHECKING:
    from etcd_store import EtcdStore
    from etcd_store.client import EtcdClient

    from .keys import RunKeys

log = logging.getLogger(__name__)

__all__ = ["address_of", "bootstrap_info", "join_value"]


def join_value(node_addr: str) -> bytes:
    """What this node's join key holds: its address, pid, and a free port of its
    host picked now. If it becomes rank 0, that port is the round's
    ``MASTER_PORT`` (torch picks it the same way, once the round is known)."""
    return json.dumps(
        {"addr": node_addr, "pid": os.getpid(), "port": get_free_port()}
    ).encode()


def address_of(value: bytes) -> tuple[str | None, int | None]:
    """``(addr, port)`` of a join value; None for what it lacks or what is malformed."""
    try:
        doc = load_json(value)
    except ValueError:
        return None, None
    if not isinstance(doc, dict):
        return None, None
    addr, port = doc.get("addr"), doc.get("port")
    return (addr if isinstance(addr, str) and addr else None,
            port if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 else None)


def bootstrap_info(
    client: EtcdClient,
    keys: RunKeys,
    round_: int,
    rank: int,
    seal_revision: int,
    store: EtcdStore,
    master: tuple[str, int] | None,
    node_id: str,
    node_addr: str,
) -> RendezvousStoreInfo:
    """``MASTER_ADDR``/``MASTER_PORT`` of the round: rank 0's address and the free
    port it put in its join key. No waiting on rank 0, and usually no RPC: the
    sealed record names them.

    When it does not, the others read the earliest join key at the seal
    revision (rank 0 by the membership rule) and rank 0 reads its own key.
    Rank 0 also publishes both values in the round's store (one Txn), where
    torch's ``RendezvousStoreInfo.build`` looks for them: the fallback when the
    seal revision is unknown or compacted, or an old join value carries no port.
    """
    if master is not None and rank != 0:
        return RendezvousStoreInfo(*master)
    if rank == 0:
        addr: str | None
        port: int | None
        if master is not None:
            addr, port = master
        else:
            kv = client.get(keys.join_key(round_, node_id))
            addr, port = address_of(kv.value if kv is not None else b"")
        if addr is None or port is None:
            addr, port = node_addr, get_free_port()
        store.multi_set(
            [RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY],
            [addr.encode(), str(port).encode()],
        )
        return RendezvousStoreInfo(addr, port)
    if seal_revision:
        try:
            res = client.range(
                keys.join_prefix(round_), prefix=True, sort_by="create", limit=1,
                revision=seal_revision,
            )
        except EtcdCompactedError:
            res = None
        if res is not None and res.kvs:
            addr, port = address_of(res.kvs[0].value)
            if addr is not None and port is not None:
                return RendezvousStoreInfo(addr, port)
    return RendezvousStoreInfo.build(rank, store, local_addr=node_addr)
