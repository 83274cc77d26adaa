"""The records of an ``etcd-v3`` run and their encoding: what each key holds (no I/O).

``ctl/sealed`` (:class:`Sealed`: the last sealed round, its fencing revision, the
run lease, rank 0's address), ``ctl/run`` (the run lease id, :func:`lease_of`),
``rounds/<T>/members`` (:func:`decode_members`), and the answers of the reads
(:class:`Meta`). Decoding a value this protocol never writes raises
:class:`ProtocolStateError` naming the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from etcd_store.client import KeyValue, RangeResult

__all__ = [
    "Master",
    "Meta",
    "ProtocolStateError",
    "Sealed",
    "count_of",
    "decode_members",
    "decode_sealed",
    "encode_sealed",
    "first_kv",
    "lease_of",
]


class ProtocolStateError(Exception):
    """A record of the run holds something this protocol never writes."""


@dataclass(frozen=True)
class Sealed:
    """The ``ctl/sealed`` record: the last sealed round, its fencing revision, the run lease.

    ``round == 0`` and ``revision == 0`` when no round was sealed yet. The record
    names the run lease it is bound to, so every node that sees a round sealed
    learns which lease to help keep alive, at no extra cost.
    """

    round: int = 0
    revision: int = 0
    run_lease: int | None = None
    master: tuple[str, int] | None = None  # rank 0's (addr, port), when the sealer knew it

    @classmethod
    def from_kv(cls, kv: KeyValue | None) -> Sealed:
        if kv is None:
            return cls()
        round_, run_lease, master = decode_sealed(kv.value, kv.key)
        return cls(round_, kv.mod_revision, run_lease, master)


@dataclass(frozen=True)
class Master:
    """Rank 0's address and port for the ``sealed`` record, read from its join key.

    ``key`` and ``mod_revision`` identify that key as read: the seal compares its
    mod revision, so the record names rank 0 only if that key is still the one
    read (an earlier join key cannot appear later, so it is still the earliest).
    """

    key: bytes
    mod_revision: int
    addr: str
    port: int


def decode_sealed(value: bytes, key: bytes = b"ctl/sealed") -> tuple[int, int | None, tuple[str, int] | None]:
    """``(round, run lease, rank 0's (addr, port) or None)`` of a ``ctl/sealed`` value;
    errors name ``key`` (the full etcd key). A malformed ``master`` is ignored (the
    members then read rank 0's join key instead)."""
    where = key.decode("utf-8", "replace")
    try:
        record = json.loads(value)
        number, lease = record["round"], record.get("run_lease")
        run_lease = int(lease, 16) if lease is not None else None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ProtocolStateError(
            f"{where} holds {value[:80]!r}, not {{'round': N, 'run_lease': HEX}}"
        ) from None
    if not isinstance(number, int) or number < 1:
        raise ProtocolStateError(f"{where} holds round {number!r}, not a positive integer")
    return number, run_lease, _master_in(record.get("master"))


def _master_in(value: object) -> tuple[str, int] | None:
    """``(addr, port)`` of a sealed record's ``master`` field; None if absent or malformed."""
    if not isinstance(value, list) or len(value) != 2:
        return None
    addr, port = value
    if not isinstance(addr, str) or not addr or isinstance(port, bool) or not isinstance(port, int):
        return None
    return (addr, port) if 0 < port < 65536 else None


def encode_sealed(number: int, run_lease: int, master: Master | None) -> bytes:
    record: dict[str, object] = {"round": number, "run_lease": f"{run_lease:x}"}
    if master is not None:
        record["master"] = [master.addr, master.port]
    return json.dumps(record).encode()


def decode_members(value: bytes, key: bytes = b"a members record") -> list[str]:
    """The node ids of a ``rounds/<T>/members`` record, in rank order; errors name ``key``."""
    try:
        members = json.loads(value)
    except ValueError:
        members = None
    if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
        raise ProtocolStateError(
            f"{key.decode('utf-8', 'replace')} holds {value[:80]!r}, not a list of node ids"
        )
    return members


@dataclass(frozen=True)
class Meta:
    """The run's control records, read at one revision."""

    closed: bool
    sealed: Sealed
    run_lease: int | None
    revision: int


def first_kv(result: object) -> KeyValue | None:
    assert isinstance(result, RangeResult)
    return result.kvs[0] if result.kvs else None


def count_of(result: object) -> int:
    assert isinstance(result, RangeResult)
    return result.count


def lease_of(kv: KeyValue | None) -> int | None:
    if kv is None:
        return None
    try:
        return int(kv.value, 16)
    except ValueError:
        raise ProtocolStateError(
            f"{kv.key.decode('utf-8', 'replace')} holds {kv.value[:40]!r}, not a lease id"
        ) from None
