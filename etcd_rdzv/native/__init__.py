"""``etcd-v3``, the etcd-native rendezvous: a handler built on etcd v3 leases, transactions and watches.

``torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=HOST:2379 ...`` reaches it through
the ``torchrun.handlers`` entry point :func:`etcd_rdzv.plugin.create_etcd_v3_handler`.

Modules, one room each, lower floors first: :mod:`.settings` (the frozen settings, parsed by
:mod:`etcd_rdzv.conf`), :mod:`.records` (the key layout, what each key holds, the node's errors),
:mod:`.protocol` (every etcd read and transition, one RPC each), :mod:`.telemetry` (torch events and
metrics), :mod:`.barrier` (the pure decisions of a wait, and where a node stands), :mod:`.leases`
(the node's leases, and the eviction of its old group's dead), :mod:`.start` (a sealed round's
start: the members' acks, ``MASTER_ADDR``/``MASTER_PORT``), :mod:`.wait` (one wait: the round view
folded from the watch, and the loop that acts on the decision), :mod:`.rounds` (one node's joins
and waits), :mod:`.handler` (torch's handler interface and ``num_nodes_waiting()``, the one place
that translates the node's errors to torch's). Importing
this package is light; names load on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .barrier import RoundResult
    from .handler import EtcdV3RendezvousHandler
    from .settings import V3Settings

__all__ = [
    "EtcdV3RendezvousHandler",
    "RoundResult",
    "V3Settings",
]

_HOMES = {
    "EtcdV3RendezvousHandler": "handler",
    "RoundResult": "barrier",
    "V3Settings": "settings",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'etcd_rdzv.native' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{home}", __name__), name)
