"""``etcd-v3``, the etcd-native rendezvous: a handler on etcd v3 leases, transactions and watches.

``torchrun --rdzv-backend=etcd-v3`` reaches it through the ``torchrun.handlers`` entry point
:func:`etcd_rdzv.plugin.create_etcd_v3_handler`.

Modules, lower floors first: :mod:`.settings`, :mod:`.records` (key layout, values, the node's
errors), :mod:`.protocol` (every etcd read and transition, one RPC each), :mod:`.telemetry`,
:mod:`.barrier` (the pure decisions of a wait), :mod:`.leases` (leases and eviction),
:mod:`.start` (a sealed round's start), :mod:`.wait` (one wait), :mod:`.rounds` (one node's joins
and waits), :mod:`.handler` (torch's interface). Importing it is light; names load on first access.
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
