"""The etcd v3 client layer: the only part of the project that touches gRPC.

Modules: :mod:`.calls` (:class:`EtcdClient`, over :mod:`.transport` and :mod:`.retry`),
:mod:`.kv` (results, compare and op builders), :mod:`.watch`, :mod:`.session`, :mod:`.stats`.
Every public name is re-exported here (``from etcd_store.client import EtcdClient, Watch,
op_put, ...``); test instruments live in :mod:`.testing`, outside this API.
"""

from __future__ import annotations

# grpc first: a missing or broken grpc fails ``import etcd_store.client`` itself,
# also when its submodules are already imported.
import grpc  # noqa: F401

from ..options import DEFAULT_CONNECT_TIMEOUT, DEFAULT_TIMEOUT, EtcdClientOptions
from .calls import EtcdClient
from .endpoints import DEFAULT_PORT, Endpoint, client_endpoints, parse_endpoints
from .kv import (
    DeleteResult,
    Event,
    KeyValue,
    MemberStatus,
    PutResult,
    RangeResult,
    TxnResult,
    compare_create,
    compare_lease,
    compare_mod,
    compare_value,
    compare_version,
    op_delete,
    op_get,
    op_put,
    prefix_range_end,
)
from .session import Session, renewing_lease
from .stats import CallStats
from .watch import Watch

__all__ = [
    "CallStats",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_PORT",
    "DEFAULT_TIMEOUT",
    "DeleteResult",
    "Endpoint",
    "EtcdClient",
    "EtcdClientOptions",
    "Event",
    "KeyValue",
    "MemberStatus",
    "PutResult",
    "RangeResult",
    "Session",
    "TxnResult",
    "Watch",
    "compare_create",
    "compare_lease",
    "compare_mod",
    "compare_value",
    "compare_version",
    "op_delete",
    "op_get",
    "op_put",
    "client_endpoints",
    "parse_endpoints",
    "prefix_range_end",
    "renewing_lease",
]
