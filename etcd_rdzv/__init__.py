"""PyTorch elastic rendezvous (torchrun) over the etcd v3 API.

``torchrun --rdzv-backend=etcd-v2 --rdzv-endpoint=HOST:2379 ...`` uses this
package through its ``torchrun.handlers`` entry points (:mod:`etcd_rdzv.plugin`).

``import etcd_rdzv`` is light (no torch, no gRPC): torch loads the entry points
while it is itself being imported, so the public names below are imported on
first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .conf import EtcdClientOptions, RdzvConfig, parse_client_options, parse_rdzv_config
    from .dynamic.backend import EtcdRendezvousBackend, create_backend
    from .dynamic.handler import EtcdRendezvousHandler
    from .plugin import (
        create_etcd_legacy_handler,
        create_etcd_legacy_rdzv_handler,
        create_etcd_v2_handler,
        create_etcd_v2_rdzv_handler,
        create_etcd_v3_handler,
        create_etcd_v3_rdzv_handler,
    )

__all__ = [
    "EtcdClientOptions",
    "EtcdRendezvousBackend",
    "EtcdRendezvousHandler",
    "RdzvConfig",
    "create_backend",
    "create_etcd_legacy_handler",
    "create_etcd_legacy_rdzv_handler",
    "create_etcd_v2_handler",
    "create_etcd_v2_rdzv_handler",
    "create_etcd_v3_handler",
    "create_etcd_v3_rdzv_handler",
    "parse_client_options",
    "parse_rdzv_config",
]

_HOMES = {
    "EtcdRendezvousBackend": "dynamic.backend",
    "create_backend": "dynamic.backend",
    "EtcdRendezvousHandler": "dynamic.handler",
    "EtcdClientOptions": "conf",
    "RdzvConfig": "conf",
    "parse_client_options": "conf",
    "parse_rdzv_config": "conf",
    "create_etcd_legacy_handler": "plugin",
    "create_etcd_legacy_rdzv_handler": "plugin",
    "create_etcd_v2_handler": "plugin",
    "create_etcd_v2_rdzv_handler": "plugin",
    "create_etcd_v3_handler": "plugin",
    "create_etcd_v3_rdzv_handler": "plugin",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'etcd_rdzv' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{home}", __name__), name)
