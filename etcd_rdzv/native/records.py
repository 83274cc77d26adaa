"""The records of one ``etcd-v3`` run: its key layout, what each key holds, and the node's errors (no I/O).

Every key lives under ``<key_prefix>/<run_id>/v3/`` (:class:`RunKeys`; the table of keys, values
and leases is in docs/etcd-v3-design.md, "Key layout"). ``ctl/`` (``sealed``, ``closed``,
``abort``, on the run lease) is exactly what a waiting node watches; the mod revision of
``ctl/sealed`` is the fencing token. ``join/<T>/<node_id>`` (node lease) says node_id waits for or
belongs to round ``T``, its create revision orders joins; ``seq/<T>`` (no lease) counts the joins
and withdrawals of ``T`` by its version; ``rounds/<T>/`` (run lease) holds the members record, the
start acks and fate, and the round's store. ``<round>`` is zero-padded to 10 digits, so byte order
is round order; as ``ctl/`` sorts just before ``join/``, one watch on ``[ctl/, join/<T>/)``
(:meth:`RunKeys.watch_range`) also covers the join keys of ``T - 1``.

**Membership** (every waiting node receives it, so it is compact): ``{"joins": V, "world": W,
"first": C0, "last": C1}`` when the seal's read found exactly ``V`` joiners and ``V`` joins counted
(nobody left: a member's rank is its sequence number - 1, and ``C0``/``C1`` are the create revisions
of ranks 0 and ``W - 1``); else ``{"world": W, "created": [r0, d1, ...]}``, the members' create
revisions in rank order, delta-encoded (each member knows its own from its join).

**Identity by etcd.** A node takes a rank only for its own join key as etcd created it: its create
revision must be named (``created``) or lie in ``[first, last]`` with its sequence number. A sequence
number alone can restart (the last node out deletes ``seq/``; an evicted joiner keeps the number of its
gone key), a create revision never repeats. The ``ctl/evicted`` record names the create revisions a
sealer evicted from a round (:func:`~etcd_rdzv.native.protocol.evict_joiners`), so a live joiner
evicted before a seal hears it on its ``ctl/`` watch and joins again at once.

Every JSON value goes through :func:`load_json` (size and nesting bounded); a value this protocol
never writes raises :class:`ProtocolStateError` naming the key. The node raises its own
:class:`NodeError` subclasses, ``ProtocolStateError`` and ``EtcdError``; only the handler
(:func:`~etcd_rdzv.native.handler.torch_error`) turns them into torch's. No torch import: the CLI
reads runs through this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import Any, TypeGuard

from etcd_store.client import KeyValue, RangeResult, prefix_range_end

from .settings import run_root

__all__ = ["ClosedWhileKeptOut", "Joiner", "Membership", "Meta", "NodeError", "NodeShutDown",
           "ProtocolStateError", "RoundTimeout", "RunClosed", "RunKeys", "Sealed", "address_in", "count_of",
           "decode_evicted", "decode_members", "decode_membership", "decode_sealed", "encode_evicted", "encode_sealed", "first_kv", "join_doc",
           "lease_of", "load_json"]

# --------------------------------------------------------------------------- keys

_ROUND_DIGITS = 10


def _round(number: int) -> bytes:
    if not 0 <= number < 10**_ROUND_DIGITS:
        raise ValueError(f"round number out of range: {number}")
    return b"%0*d" % (_ROUND_DIGITS, number)


@dataclass(frozen=True)
class RunKeys:
    """Key names (bytes) of one run; ``root`` is ``<key_prefix>/<run_id>/v3``. The fixed names are
    built once per instance (first use); a round's names cost one format of the round number."""

    root: str

    @classmethod
    def for_run(cls, key_prefix: str, run_id: str) -> RunKeys:
        if "/" in run_id:
            raise ValueError(f"The rendezvous run id must not contain '/', got {run_id!r}.")
        return cls(run_root(key_prefix, run_id))

    # ------------------------------------------------------------------ ctl/

    @cached_property
    def ctl(self) -> bytes:
        """Prefix of everything a waiting node watches."""
        return f"{self.root}/ctl/".encode()

    @cached_property
    def ctl_end(self) -> bytes:
        return prefix_range_end(self.ctl)

    @cached_property
    def closed(self) -> bytes:
        return f"{self.root}/ctl/closed".encode()

    @cached_property
    def abort(self) -> bytes:
        """Written with (or after) ``closed`` by ``etcd-rdzv close``: running members stop too."""
        return f"{self.root}/ctl/abort".encode()

    @cached_property
    def run(self) -> bytes:
        """The run lease's id (outside ``ctl/``: waiting nodes need not hear it created)."""
        return f"{self.root}/run".encode()

    @cached_property
    def sealed(self) -> bytes:
        return f"{self.root}/ctl/sealed".encode()

    @cached_property
    def evicted(self) -> bytes:
        """The last eviction of joiners before a seal: ``{"round": T, "created": [create revisions]}``."""
        return f"{self.root}/ctl/evicted".encode()

    @cached_property
    def fate(self) -> bytes:
        """The fate of the last round whose start was decided, ``b"<T> go"`` or ``b"<T> void"``: the copy
        in ``ctl/`` that the start barrier's watch hears (``rounds/<T>/start`` is the record)."""
        return f"{self.root}/ctl/fate".encode()

    @cached_property
    def join_root(self) -> bytes:
        return f"{self.root}/join/".encode()

    def join_prefix(self, round_: int) -> bytes:
        return self.join_root + _round(round_) + b"/"

    def join_key(self, round_: int, node_id: str) -> bytes:
        return self.join_prefix(round_) + node_id.encode()

    def parse_join_key(self, key: bytes) -> tuple[int, str] | None:
        """``(round, node_id)`` of a join key, None for any other key."""
        root = self.join_root
        if not key.startswith(root):
            return None
        rest = key[len(root) :].decode(errors="replace")
        number, sep, node_id = rest.partition("/")
        if not sep or not number.isdigit() or not node_id:
            return None
        return int(number), node_id

    def start_watch_range(self, round_: int) -> tuple[bytes, bytes]:
        """``[start, end)`` a member in the start barrier of ``round_`` watches: ``ctl/`` (fate, abort,
        close) and the join keys of rounds up to ``round_`` (after the seal only ``round_``'s exist), not
        the newcomers of ``round_ + 1``."""
        return self.ctl, self.join_prefix(round_ + 1)

    def watch_range(self, round_: int, previous: bool) -> tuple[bytes, bytes]:
        """``[start, end)`` a node waiting in ``round_`` watches: ``ctl/``, plus with ``previous`` the join
        keys of earlier rounds."""
        return self.ctl, (self.join_prefix(round_) if previous else self.ctl_end)

    # ------------------------------------------------------------------ seq/

    @cached_property
    def seq_root(self) -> bytes:
        return f"{self.root}/seq/".encode()

    def seq(self, round_: int) -> bytes:
        """The join counter of ``round_``: every join and every withdrawal bumps its version."""
        return self.seq_root + _round(round_)

    def seqs_through(self, round_: int) -> tuple[bytes, bytes]:
        """``[start, end)`` of the join counters of rounds up to ``round_`` included."""
        return self.seq_root, self.seq(round_ + 1)

    # ------------------------------------------------------------------ rounds/

    @cached_property
    def rounds(self) -> bytes:
        return f"{self.root}/rounds/".encode()

    def round_prefix(self, round_: int) -> bytes:
        return self.rounds + _round(round_) + b"/"

    def members(self, round_: int) -> bytes:
        return self.round_prefix(round_) + b"members"

    def acks_prefix(self, round_: int) -> bytes:
        """Where the members of a sealed round confirm it (:mod:`~etcd_rdzv.native.start`)."""
        return self.round_prefix(round_) + b"start-acks/"

    def ack(self, round_: int, node_id: str) -> bytes:
        return self.acks_prefix(round_) + node_id.encode()

    def start(self, round_: int) -> bytes:
        """The fate of a sealed round, put once: ``go`` (every member confirmed) or ``void``."""
        return self.round_prefix(round_) + b"start"

    def store_prefix(self, round_: int) -> str:
        """The ``EtcdStore`` prefix of a round (a str, as the store takes it)."""
        return (self.round_prefix(round_) + b"store").decode()

    def rounds_before(self, round_: int) -> tuple[bytes, bytes]:
        """``[start, end)`` of every ``rounds/`` key of rounds older than ``round_``."""
        return self.rounds, self.round_prefix(max(round_, 0))


# --------------------------------------------------------------------------- values

MAX_RECORD_BYTES = 16 * 1024 * 1024
"""The largest JSON value decoded (the members record of 100,000 nodes is ~4 MB)."""


def load_json(value: bytes) -> Any:
    """``json.loads(value)``, but a value over :data:`MAX_RECORD_BYTES` or nested too deeply raises
    ``ValueError`` instead of exhausting memory or the stack."""
    if len(value) > MAX_RECORD_BYTES:
        raise ValueError(f"a {len(value)}-byte value, more than the {MAX_RECORD_BYTES} bytes of a record")
    try:
        return json.loads(value)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


class ProtocolStateError(Exception):
    """A record of the run holds something this protocol never writes."""


@dataclass(frozen=True)
class Sealed:
    """The ``ctl/sealed`` record: the last sealed round (0 if none), its fencing revision, the run lease
    (so every node that sees a seal learns which lease to help keep alive, at no extra cost)."""

    round: int = 0
    revision: int = 0
    run_lease: int | None = None
    master: tuple[str, int] | None = None  # rank 0's (addr, port), when the sealer knew it
    membership: Membership | None = None  # None: a record without one (not written by this version)

    @classmethod
    def from_kv(cls, kv: KeyValue | None) -> Sealed:
        if kv is None:
            return cls()
        round_, run_lease, master, record = _parse_sealed(kv.value, kv.key)
        return cls(round_, kv.mod_revision, run_lease, master, _membership_in(record, kv.value, kv.key))


@dataclass(frozen=True)
class Joiner:
    """One join key of a round as read (``key``, ``mod_revision``, ``lease``: what a fenced eviction
    compares; empty/0 where not kept)."""

    node_id: str
    create_revision: int
    value: bytes
    key: bytes = b""
    mod_revision: int = 0
    lease: int = 0


@dataclass(frozen=True)
class Membership:
    """Who the members of a sealed round are (see the module docstring): ``joins`` (with ``first`` and
    ``last``, the create revisions of the first and last member; 0 in a record of an older version), or
    ``created``."""

    world: int
    joins: int | None = None
    created: tuple[int, ...] = ()
    first: int = 0
    last: int = 0

    @classmethod
    def of(cls, joiners: list[Joiner], joins: int, max_nodes: int) -> Membership:
        """The membership a seal records, from the present joiners (create order) and ``joins`` (the version
        of ``seq/<T>``), read together."""
        world = min(len(joiners), max_nodes)
        if len(joiners) == joins:
            edges = (joiners[0].create_revision, joiners[world - 1].create_revision) if world else (0, 0)
            return cls(world, joins=joins, first=edges[0], last=edges[1])
        return cls(world, created=tuple(j.create_revision for j in joiners[:world]))

    def rank_of(self, seq: int, create_revision: int) -> int | None:
        """The rank of the joiner ``(seq, create_revision)``; None when not a member (after ``max_nodes``
        others, gone at the sealer's read, or a key of an earlier ``seq/`` count: identity by etcd, see
        the module docstring)."""
        if self.joins is not None:
            if not 1 <= seq <= self.world:
                return None
            if self.first and not self.first <= create_revision <= self.last:
                return None
            return seq - 1
        try:
            return self.created.index(create_revision)
        except ValueError:
            return None

    def encode(self) -> dict[str, object]:
        if self.joins is not None:
            return {"world": self.world, "joins": self.joins, "first": self.first, "last": self.last}
        deltas = [b - a for a, b in zip((0, *self.created), self.created, strict=False)]
        return {"world": self.world, "created": deltas}


def decode_membership(value: bytes, key: bytes = b"ctl/sealed") -> Membership | None:
    """The :class:`Membership` of a ``ctl/sealed`` value; None if it names none."""
    try:
        record = load_json(value)
    except ValueError:
        return None
    return _membership_in(record, value, key)


def _membership_in(record: object, value: bytes, key: bytes) -> Membership | None:
    """The membership of ``record``, the parsed ``value`` (see :func:`decode_membership`)."""
    if not isinstance(record, dict) or "world" not in record:
        return None
    world, joins, deltas = record.get("world"), record.get("joins"), record.get("created")
    first, last = record.get("first", 0), record.get("last", 0)
    if _count(world) and joins is not None and _count(joins) and _count(first) and _count(last):
        return Membership(world, joins=joins, first=first, last=last)
    if (_count(world) and joins is None and isinstance(deltas, list) and len(deltas) == world
            and all(_count(d) for d in deltas)):
        return Membership(world, created=tuple(accumulate(deltas)))
    raise ProtocolStateError(f"{key.decode('utf-8', 'replace')} holds a malformed membership: {value[:80]!r}")


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def decode_sealed(value: bytes, key: bytes = b"ctl/sealed") -> tuple[int, int | None, tuple[str, int] | None]:
    """``(round, run lease, rank 0's (addr, port) or None)`` of a ``ctl/sealed`` value; errors name
    ``key``. A malformed ``master`` is ignored (members then read rank 0's join key)."""
    return _parse_sealed(value, key)[:3]


def _parse_sealed(value: bytes, key: bytes) -> tuple[int, int | None, tuple[str, int] | None, dict[str, Any]]:
    """:func:`decode_sealed`'s answer and the parsed record (one JSON parse for the whole :class:`Sealed`)."""
    where = key.decode("utf-8", "replace")
    try:
        record = load_json(value)
        number, lease = record["round"], record.get("run_lease")
        run_lease = _lease_id(lease) if lease is not None else None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ProtocolStateError(f"{where} holds {value[:80]!r}, not {{'round': N, 'run_lease': HEX}}") from None
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise ProtocolStateError(f"{where} holds round {number!r}, not a positive integer")
    master = record.get("master")
    addr, port = address_in(*master) if isinstance(master, list) and len(master) == 2 else (None, None)
    return number, run_lease, (None if addr is None or port is None else (addr, port)), record


_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def _lease_id(text: object) -> int:
    """The lease id in hex, as written (``f"{lease:x}"``): no sign, prefix, space or underscore (which
    ``int(text, 16)`` would take), below 2**63 (etcd's int64); else ``ValueError``."""
    if isinstance(text, bytes):
        text = text.decode("ascii")  # UnicodeDecodeError is a ValueError
    if not isinstance(text, str) or not 0 < len(text) <= 16 or not set(text) <= _HEX_DIGITS:
        raise ValueError(f"not a lease id: {text!r:.40}")
    lease = int(text, 16)
    if lease >= 1 << 63:
        raise ValueError(f"not a lease id: {text!r:.40}")
    return lease


def address_in(addr: object, port: object) -> tuple[str | None, int | None]:
    """A recorded address and port (a join value's, the sealed record's ``master``), each None unless
    well formed: a non-empty str; an int (not a bool) in 1..65535."""
    return (addr if isinstance(addr, str) and addr else None,
            port if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 else None)


def join_doc(value: bytes) -> dict[str, Any]:
    """A join value's JSON object, bounded in size and depth (:func:`load_json`); {} when malformed.
    Written by :func:`~etcd_rdzv.native.start.join_value`; every field is optional to its readers."""
    try:
        doc = load_json(value)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def encode_sealed(
    number: int, run_lease: int, master: tuple[str, int] | None, membership: Membership
) -> bytes:
    record: dict[str, object] = {"round": number, "run_lease": f"{run_lease:x}"}
    if master is not None:
        record["master"] = list(master)
    record.update(membership.encode())
    return json.dumps(record, separators=(",", ":")).encode()


def decode_evicted(value: bytes) -> tuple[int, frozenset[int]]:
    """``(round, create revisions)`` of a ``ctl/evicted`` value; ``(0, {})`` when malformed (it only
    ever hastens a re-join, so a bad one is ignored)."""
    try:
        record = load_json(value)
    except ValueError:
        return 0, frozenset()
    if not isinstance(record, dict):
        return 0, frozenset()
    number, created = record.get("round"), record.get("created")
    if not _count(number) or not isinstance(created, list) or not all(_count(c) for c in created):
        return 0, frozenset()
    return number, frozenset(created)


def encode_evicted(round_: int, created: list[int]) -> bytes:
    return json.dumps({"round": round_, "created": created}, separators=(",", ":")).encode()


def decode_members(value: bytes, key: bytes = b"a members record") -> list[str]:
    """The node ids of a ``rounds/<T>/members`` record, in rank order; errors name ``key``."""
    try:
        members = load_json(value)
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
        return _lease_id(kv.value)
    except ValueError:
        raise ProtocolStateError(
            f"{kv.key.decode('utf-8', 'replace')} holds {kv.value[:40]!r}, not a lease id"
        ) from None


# --------------------------------------------------------------------------- the node's errors

class NodeError(Exception):
    """The base of the node's own errors (not raised itself)."""


class RunClosed(NodeError):
    """The run is closed: no round will form any more."""


class ClosedWhileKeptOut(RunClosed):
    """The run was closed while this node waited for room in a full, running group."""


class NodeShutDown(NodeError):
    """The node was stopped for good (its handler shut down or left)."""


class RoundTimeout(NodeError):
    """No round that includes this node was sealed within ``join_timeout``."""
