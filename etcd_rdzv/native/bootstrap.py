"""How the members of an ``etcd-v3`` round learn ``MASTER_ADDR``/``MASTER_PORT``.

Every join key holds its node's address and a free port of its host, picked at
join time (:func:`join_value`). Rank 0 is the earliest join key at the seal
revision, so its address and port are known once the round is sealed. The
sealer names them in the ``sealed`` record (:func:`master_of`, fenced by that
key's mod revision), so usually no member makes an RPC to learn them
(:func:`bootstrap_info`); the fallbacks read rank 0's join key at the seal
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

from .records import Master

if TYPE_CHECKING:
    from etcd_store import EtcdStore
    from etcd_store.client import EtcdClient

    from .keys import RunKeys
    from .view import RoundView

log = logging.getLogger(__name__)

__all__ = ["address_of", "bootstrap_info", "join_value", "master_of"]


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
        doc = json.loads(value)
    except ValueError:
        return None, None
    if not isinstance(doc, dict):
        return None, None
    addr, port = doc.get("addr"), doc.get("port")
    return (addr if isinstance(addr, str) and addr else None,
            port if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 else None)


def master_of(client: EtcdClient, keys: RunKeys, view: RoundView, node_id: str, value: bytes) -> Master | None:
    """Rank 0's join key as the sealed record should name it: our own (no RPC) when
    no earlier joiner is left, else the earliest join key (one Range)."""
    if view.before == 0:
        key, mod_revision = keys.join_key(view.round, node_id), view.join_revision
    else:
        res = client.range(keys.join_prefix(view.round), prefix=True, sort_by="create", limit=1)
        if not res.kvs:
            return None
        key, mod_revision, value = res.kvs[0].key, res.kvs[0].mod_revision, res.kvs[0].value
    addr, port = address_of(value)
    if addr is None or port is None:
        return None
    return Master(key, mod_revision, addr, port)


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
    sealed record names them (see :func:`master_of`).

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
