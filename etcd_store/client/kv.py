"""Plain results of etcd calls and the builders of transaction compares and ops.

Nothing here does I/O: :class:`KeyValue` and the ``*Result`` classes are what
:class:`~etcd_store.client.EtcdClient` returns instead of protobuf messages;
``compare_*`` and ``op_*`` build the protobuf parts of a Txn (see
:meth:`EtcdClient.txn`). Bad arguments raise ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from etcd3.etcdrpc import rpc_pb2

__all__ = [
    "DeleteResult",
    "Event",
    "KeyValue",
    "MemberStatus",
    "PutResult",
    "RangeResult",
    "TxnResult",
    "compare_create",
    "compare_lease",
    "compare_mod",
    "compare_value",
    "compare_version",
    "op_delete",
    "op_get",
    "op_put",
    "prefix_range_end",
]

# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def _from_pb(cls, kv: Any) -> KeyValue:
        return cls(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease)


@dataclass(frozen=True)
class RangeResult:
    kvs: list[KeyValue]
    count: int
    more: bool
    revision: int


@dataclass(frozen=True)
class PutResult:
    revision: int
    prev_kv: KeyValue | None = None


@dataclass(frozen=True)
class DeleteResult:
    deleted: int
    revision: int
    prev_kvs: list[KeyValue] = field(default_factory=list)


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    responses: list[RangeResult | PutResult | DeleteResult]


@dataclass(frozen=True)
class Event:
    """A watch event: ``type`` is ``"PUT"`` or ``"DELETE"``."""

    type: str
    kv: KeyValue
    prev_kv: KeyValue | None = None

    @property
    def key(self) -> bytes:
        return self.kv.key

    @property
    def value(self) -> bytes:
        return self.kv.value


@dataclass(frozen=True)
class MemberStatus:
    member_id: int
    leader: int
    revision: int
    db_size: int
    version: str
    raft_term: int


def _range_result(resp: Any) -> RangeResult:
    return RangeResult(
        [KeyValue._from_pb(kv) for kv in resp.kvs], resp.count, resp.more, resp.header.revision
    )


def _put_result(resp: Any) -> PutResult:
    prev = KeyValue._from_pb(resp.prev_kv) if resp.HasField("prev_kv") else None
    return PutResult(resp.header.revision, prev)


def _delete_result(resp: Any) -> DeleteResult:
    return DeleteResult(
        resp.deleted, resp.header.revision, [KeyValue._from_pb(kv) for kv in resp.prev_kvs]
    )


# --------------------------------------------------------------------------- txn building

_CMP_RESULT = {
    "==": rpc_pb2.Compare.EQUAL,
    "!=": rpc_pb2.Compare.NOT_EQUAL,
    "<": rpc_pb2.Compare.LESS,
    ">": rpc_pb2.Compare.GREATER,
}


def prefix_range_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix``."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def _compare(
    key: bytes, op: str, target: int, range_end: bytes | None = None, **value: Any
) -> Any:
    if op not in _CMP_RESULT:
        raise ValueError(f"Unknown compare operator {op!r}; use one of {sorted(_CMP_RESULT)}.")
    return rpc_pb2.Compare(
        key=key, range_end=range_end or b"", result=_CMP_RESULT[op], target=target, **value
    )


def compare_version(key: bytes, op: str, version: int, *, range_end: bytes | None = None) -> Any:
    """Compare the key's version (0 = the key does not exist).

    With ``range_end`` (e.g. :func:`prefix_range_end`) the compare holds only if it
    holds for every key in ``[key, range_end)``; an empty range compares as one
    missing key, so ``version == 0`` over a range means "no key in the range".
    """
    return _compare(key, op, rpc_pb2.Compare.VERSION, range_end, version=version)


def compare_create(key: bytes, op: str, revision: int, *, range_end: bytes | None = None) -> Any:
    """Compare the key's create revision (0 = the key does not exist); ``range_end`` as above."""
    return _compare(key, op, rpc_pb2.Compare.CREATE, range_end, create_revision=revision)


def compare_mod(key: bytes, op: str, revision: int, *, range_end: bytes | None = None) -> Any:
    """Compare the key's mod revision (0 = the key does not exist); ``range_end`` as above."""
    return _compare(key, op, rpc_pb2.Compare.MOD, range_end, mod_revision=revision)


def compare_value(key: bytes, op: str, value: bytes) -> Any:
    """Compare the key's value (a missing key never matches)."""
    return _compare(key, op, rpc_pb2.Compare.VALUE, value=value)


def compare_lease(key: bytes, op: str, lease: int) -> Any:
    """Compare the lease the key is attached to."""
    return _compare(key, op, rpc_pb2.Compare.LEASE, lease=lease)


def op_put(key: bytes, value: bytes, *, lease: int = 0, prev_kv: bool = False) -> Any:
    return rpc_pb2.RequestOp(
        request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease, prev_kv=prev_kv)
    )


def op_get(
    key: bytes,
    range_end: bytes | None = None,
    *,
    prefix: bool = False,
    keys_only: bool = False,
    count_only: bool = False,
    limit: int = 0,
    sort_by: str | None = None,
) -> Any:
    """A Range inside a Txn; ``sort_by`` and ``limit`` as for :meth:`EtcdClient.range` (ascending)."""
    return rpc_pb2.RequestOp(
        request_range=_range_request(key, range_end, prefix, keys_only, count_only, limit, sort_by=sort_by)
    )


def op_delete(
    key: bytes, range_end: bytes | None = None, *, prefix: bool = False, prev_kv: bool = False
) -> Any:
    end = prefix_range_end(key) if prefix else range_end
    return rpc_pb2.RequestOp(
        request_delete_range=rpc_pb2.DeleteRangeRequest(key=key, range_end=end or b"", prev_kv=prev_kv)
    )


def _range_request(
    key: bytes,
    range_end: bytes | None,
    prefix: bool,
    keys_only: bool,
    count_only: bool,
    limit: int,
    revision: int = 0,
    serializable: bool = False,
    sort_by: str | None = None,
    descending: bool = False,
) -> Any:
    end = prefix_range_end(key) if prefix else range_end
    sort: dict[str, int] = {}
    if sort_by is not None:
        if sort_by not in _SORT_TARGETS:
            raise ValueError(f"sort_by must be one of {sorted(_SORT_TARGETS)}, got {sort_by!r}")
        sort = {"sort_target": _SORT_TARGETS[sort_by], "sort_order": 2 if descending else 1}
    return rpc_pb2.RangeRequest(
        key=key,
        range_end=end or b"",
        keys_only=keys_only,
        count_only=count_only,
        limit=limit,
        revision=revision,
        serializable=serializable,
        **sort,
    )


# RangeRequest.SortTarget; sort_order 1 = ASCEND, 2 = DESCEND.
_SORT_TARGETS = {"key": 0, "version": 1, "create": 2, "mod": 3, "value": 4}


# --------------------------------------------------------------------------- keys in messages


def clip(text: str, limit: int = 300) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out (keys in messages)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def show_key(key: bytes, limit: int = 200) -> str:
    """``repr(key)`` for an error message: keys longer than ``limit`` bytes are cut."""
    if len(key) <= limit:
        return repr(key)
    return f"{key[:limit]!r}... ({len(key)} bytes)"
