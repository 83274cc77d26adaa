"""The etcd v3 client layer: the only part of the project that touches gRPC.

Re-exports the public API, so ``from etcd_store.client import EtcdClient, Watch,
op_put, ...`` works whatever module of this package defines the name.
"""

from __future__ import annotations

from .transport import (
    DEFAULT_PORT,
    DEFAULT_TIMEOUT,
    DeleteResult,
    Endpoint,
    EtcdClient,
    Event,
    KeyValue,
    LeaseKeeper,
    MemberStatus,
    PutResult,
    RangeResult,
    RpcCounter,
    TxnResult,
    Watch,
    compare_create,
    compare_lease,
    compare_mod,
    compare_value,
    compare_version,
    op_delete,
    op_get,
    op_put,
    parse_endpoints,
    prefix_range_end,
)

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_TIMEOUT",
    "DeleteResult",
    "Endpoint",
    "EtcdClient",
    "Event",
    "KeyValue",
    "LeaseKeeper",
    "MemberStatus",
    "PutResult",
    "RangeResult",
    "RpcCounter",
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
    "parse_endpoints",
    "prefix_range_end",
]
