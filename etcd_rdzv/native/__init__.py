"""``etcd-v3``, the etcd-native rendezvous: a handler built on etcd v3 leases, transactions and watches.

``torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=HOST:2379 ...`` reaches it through
the ``torchrun.handlers`` entry point :func:`etcd_rdzv.plugin.create_etcd_v3_handler`.

Modules: :mod:`.settings` (the frozen settings, parsed by :mod:`etcd_rdzv.conf`),
:mod:`.keys` (key layout), :mod:`.records` (what each key holds),
:mod:`.queries` (the read-only RPCs), :mod:`.protocol` (one function per
transition), :mod:`.view` (the round as a node's watch shows it), :mod:`.barrier`
(the pure decision of the wait loop), :mod:`.bootstrap` (``MASTER_ADDR``/
``MASTER_PORT`` of a round), :mod:`.rounds` (one node's join and the outcome of each wait),
:mod:`.wait` (one wait, which acts on the decision), :mod:`.node_leases` (the
node's leases, held by the participant), :mod:`.errors` (the node's own errors), :mod:`.handler`
(torch's handler interface, the one place that translates them to torch's errors). Importing
this package is light; names load on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .handler import EtcdV3RendezvousHandler
    from .settings import V3Settings
    from .standing import RoundResult

__all__ = [
    "EtcdV3RendezvousHandler",
    "RoundResult",
    "V3Settings",
]

_HOMES = {
    "EtcdV3RendezvousHandler": "handler",
    "RoundResult": "standing",
    "V3Settings": "settings",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'etcd_rdzv.native' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{home}", __name__), name)
