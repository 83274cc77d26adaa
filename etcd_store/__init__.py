"""etcd v3 client layer and the c10d-compatible :class:`EtcdStore`.

``import etcd_store`` stays light: torch is imported only when ``EtcdStore`` is
first used, so :mod:`etcd_server` can use the client without pulling in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    EtcdAuthError,
    EtcdCompactedError,
    EtcdConnectionError,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdPermissionDenied,
    EtcdRequestError,
    EtcdTimeoutError,
    EtcdTLSError,
)

if TYPE_CHECKING:
    from .store import EtcdStore

__all__ = [
    "EtcdAuthError",
    "EtcdCompactedError",
    "EtcdConnectionError",
    "EtcdError",
    "EtcdLeaseNotFound",
    "EtcdPermissionDenied",
    "EtcdRequestError",
    "EtcdStore",
    "EtcdTLSError",
    "EtcdTimeoutError",
]


def __getattr__(name: str) -> Any:
    if name == "EtcdStore":
        from .store import EtcdStore

        return EtcdStore
    raise AttributeError(f"module 'etcd_store' has no attribute {name!r}")
