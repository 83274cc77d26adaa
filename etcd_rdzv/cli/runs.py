"""Finding and reading the rendezvous runs under a key prefix (what ``list`` and ``show`` print); no writes.

* ``etcd-v2``/``etcd``: the state key ``<prefix>/<run_id>`` (base64 of torch's pickled state,
  decoded by :mod:`etcd_rdzv.v2state` without unpickling arbitrary objects) and the run's
  ``EtcdStore`` under ``<prefix>/<run_id>/store``;
* ``etcd-v3``: everything under ``<prefix>/<run_id>/v3/`` (:class:`~etcd_rdzv.native.records.RunKeys`).

Reading one run costs one Range (v2: the state key; v3: ``ctl/``, join values included),
one Txn of the round's records, and with ``detail`` one LeaseTimeToLive per lease shown,
each bounded by the command's :class:`~.connect.Deadline`. A run that is not there reads as
None; a record this tool cannot decode raises :class:`RunReadError`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from etcd_store.client import EtcdClient, KeyValue, RangeResult, op_get, prefix_range_end

from ..native.records import ProtocolStateError, RunKeys, Sealed, decode_members, join_doc
from ..v2state import StateDecodeError, V2State, decode_state
from .connect import Deadline

log = logging.getLogger(__name__)

__all__ = [
    "V2",
    "V3",
    "NodeInfo",
    "RunInfo",
    "RunReadError",
    "backends_of",
    "classify_keys",
    "find_runs",
    "read_run",
    "read_v2",
    "read_v3",
    "scan_keys",
    "state_key",
]

V2 = "etcd-v2"
V3 = "etcd-v3"


class RunReadError(Exception):
    """A record of the run holds something this tool cannot decode."""


@dataclass
class NodeInfo:
    """One node as ``show`` prints it; fields a backend does not record are None."""

    node_id: str
    host: str | None = None
    pid: int | None = None
    rank: int | None = None
    port: int | None = None
    lease_ttl_s: int | None = None  # etcd-v3: seconds left on the node's lease (-1: gone)
    heartbeat_age_s: float | None = None  # etcd-v2: seconds since its last heartbeat
    present: bool = True  # etcd-v3: the member still holds its join key of the round


@dataclass
class RunInfo:
    run_id: str
    backend: str
    round: int
    world_size: int
    closed: bool
    members: list[NodeInfo] = field(default_factory=list)
    waiting: list[NodeInfo] = field(default_factory=list)
    age_s: float | None = None  # etcd-v2: seconds since the newest heartbeat in the state
    expiry_s: int | None = None  # seconds left on the lease the run's records are bound to
    complete: bool | None = None  # etcd-v2: whether the round is complete
    store_keys: int | None = None  # keys of the round's (v3) or the run's (v2) store
    revision: int = 0

    def summary(self) -> dict[str, Any]:
        """The ``list`` row: node ids instead of node details."""
        return {
            "run_id": self.run_id, "backend": self.backend, "round": self.round,
            "world_size": self.world_size, "members": [n.node_id for n in self.members],
            "waiting": [n.node_id for n in self.waiting], "closed": self.closed,
            "age_s": self.age_s, "expiry_s": self.expiry_s,
        }

    def detail(self) -> dict[str, Any]:
        """The ``show`` document."""
        doc = asdict(self)
        return doc


# --------------------------------------------------------------------------- discovery


def state_key(prefix: str, run_id: str) -> str:
    """The etcd-v2 state key of a run (``run_id`` alone under an empty prefix)."""
    return f"{prefix}/{run_id}" if prefix else run_id


def scan_keys(client: EtcdClient, prefix: str, deadline: Deadline, *, page: int = 1000) -> Iterator[bytes]:
    """Every key name under ``<prefix>/`` (all keys for an empty prefix), pages of ``page``
    keys-only Ranges, all at the revision of the first page."""
    start = f"{prefix}/".encode() if prefix else b"\0"
    end = prefix_range_end(start) if prefix else b"\0"
    revision = 0
    while True:
        res = client.range(start, end, keys_only=True, limit=page, revision=revision,
                           timeout=deadline.left())
        revision = revision or res.revision
        yield from (kv.key for kv in res.kvs)
        if not res.more or not res.kvs:
            return
        start = res.kvs[-1].key + b"\0"


def classify_keys(prefix: str, keys: Iterable[bytes]) -> dict[str, set[str]]:
    """``{run_id: {backend, ...}}`` from key names under ``prefix`` (pure).

    ``<prefix>/<run>`` is an etcd-v2 state key; ``<prefix>/<run>/v3/...`` an etcd-v3 run; a
    run's other keys (its v2 store) name no backend and are skipped.
    """
    base = f"{prefix}/".encode() if prefix else b""
    runs: dict[str, set[str]] = {}
    for key in keys:
        if not key.startswith(base):
            continue
        rest = key[len(base):]
        run, sep, tail = rest.partition(b"/")
        if not run or b"\0" in run:
            continue
        try:
            run_id = run.decode()
        except UnicodeDecodeError:
            continue
        if not sep:
            runs.setdefault(run_id, set()).add(V2)
        elif tail.startswith(b"v3/"):
            runs.setdefault(run_id, set()).add(V3)
    return runs


def backends_of(client: EtcdClient, prefix: str, run_id: str, deadline: Deadline) -> set[str]:
    """The backends that have keys of ``run_id``: one Txn counting its state key and ``<run>/v3/``
    (reads only the run's own keys, so a role limited to the run suffices)."""
    root = f"{RunKeys.for_run(prefix, run_id).root}/".encode()
    res = client.txn([], [op_get(state_key(prefix, run_id).encode(), count_only=True),
                          op_get(root, prefix=True, count_only=True)],
                     timeout=deadline.left(), idempotent=True)
    return {b for b, r in zip((V2, V3), res.responses, strict=True) if getattr(r, "count", 0) > 0}


def find_runs(client: EtcdClient, prefix: str, deadline: Deadline,
              run_ids: Iterable[str] | None = None) -> dict[str, set[str]]:
    """``{run_id: {backend, ...}}``: every run under ``prefix`` (a scan of the whole prefix), or
    only those of ``run_ids`` that exist (:func:`backends_of` each)."""
    if run_ids is None:
        return classify_keys(prefix, scan_keys(client, prefix, deadline))
    found = {run_id: backends_of(client, prefix, run_id, deadline) for run_id in dict.fromkeys(run_ids)}
    return {run_id: backends for run_id, backends in found.items() if backends}


# --------------------------------------------------------------------------- reading


def _lease_left(client: EtcdClient, lease: int, deadline: Deadline) -> int | None:
    if not lease:
        return None
    return client.lease_time_to_live(lease, timeout=deadline.left())


def _utc(when: datetime) -> datetime:
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)


def read_v2(
    client: EtcdClient, prefix: str, run_id: str, deadline: Deadline, *, detail: bool = False,
    now: datetime | None = None,
) -> RunInfo | None:
    key = state_key(prefix, run_id)
    kv = client.get(key.encode(), timeout=deadline.left())
    if kv is None:
        return None
    try:
        # A hostile state costs at most the decode's budget and the deadline, and is that run's error.
        state = decode_state(kv.value, key, time_left=deadline.left())
    except StateDecodeError as e:
        raise RunReadError(str(e)) from None
    info = v2_info(run_id, state, now or datetime.now(timezone.utc))
    info.revision = kv.mod_revision
    info.expiry_s = _lease_left(client, kv.lease, deadline)
    if detail:
        store = f"{key}/store/".encode()
        info.store_keys = client.range(store, prefix=True, count_only=True, timeout=deadline.left()).count
    return info


def v2_info(run_id: str, state: V2State, now: datetime) -> RunInfo:
    """The :class:`RunInfo` of a decoded etcd-v2 state (pure)."""

    def age(node: Any) -> float | None:
        when = state.last_heartbeats.get(node)
        return None if when is None else round((now - _utc(when)).total_seconds(), 1)

    members = [
        NodeInfo(n.node_id, n.addr, n.pid, rank=rank, heartbeat_age_s=age(n)) for n, rank in state.members()
    ]
    waiting = [NodeInfo(n.node_id, n.addr, n.pid, heartbeat_age_s=age(n)) for n in state.waiting()]
    newest = state.newest_heartbeat()
    return RunInfo(
        run_id, V2, state.round, len(members), state.closed, members, waiting,
        age_s=None if newest is None else round((now - _utc(newest)).total_seconds(), 1),
        complete=state.complete,
    )


def _join_value(kv: KeyValue | None) -> tuple[str | None, int | None, int | None]:
    """``(addr, pid, port)`` of a join key's JSON value; Nones where absent or malformed."""
    doc = {} if kv is None else join_doc(kv.value)

    def num(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    addr = doc.get("addr")
    return (addr if isinstance(addr, str) else None), num(doc.get("pid")), num(doc.get("port"))


def read_v3(
    client: EtcdClient, prefix: str, run_id: str, deadline: Deadline, *, detail: bool = False
) -> RunInfo | None:
    try:
        keys = RunKeys.for_run(prefix, run_id)
    except ValueError as e:
        raise RunReadError(str(e)) from None
    # ctl/ (sealed, closed), join/ and run, at one revision.
    first = client.txn(
        [], [op_get(keys.ctl, prefix=True), op_get(keys.join_root, prefix=True), op_get(keys.run)],
        timeout=deadline.left(), idempotent=True,
    )
    kvs = [kv for r in first.responses if isinstance(r, RangeResult) for kv in r.kvs]
    by_key = {kv.key: kv for kv in kvs}
    try:
        sealed = Sealed.from_kv(by_key.get(keys.sealed))
    except ProtocolStateError as e:
        raise RunReadError(str(e)) from None
    round_ = sealed.round
    ops = [op_get(keys.rounds, prefix=True, count_only=True)]
    if round_ > 0:
        ops += [op_get(keys.members(round_)),
                op_get(keys.store_prefix(round_).encode() + b"/", prefix=True, count_only=True)]
    res = client.txn([], ops, timeout=deadline.left(), idempotent=True)
    counts = [r for r in res.responses if isinstance(r, RangeResult)]
    if not kvs and counts[0].count == 0:
        return None
    joins: dict[int, list[tuple[str, KeyValue]]] = {}
    for kv in kvs:
        parsed = keys.parse_join_key(kv.key)
        if parsed is not None:
            joins.setdefault(parsed[0], []).append((parsed[1], kv))
    for entries in joins.values():
        entries.sort(key=lambda e: e[1].create_revision)
    current = dict(joins.get(round_, []))
    record: list[str] | None = None
    if round_ > 0 and counts[1].kvs:
        try:
            record = decode_members(counts[1].kvs[0].value, counts[1].kvs[0].key)
        except ProtocolStateError as e:
            raise RunReadError(str(e)) from None
    ids = record if record is not None else [n for n, _ in joins.get(round_, [])]

    def node(node_id: str, kv: KeyValue | None, rank: int | None) -> NodeInfo:
        addr, pid, port = _join_value(kv)
        ttl = _lease_left(client, kv.lease, deadline) if detail and kv is not None else None
        return NodeInfo(node_id, addr, pid, rank=rank, port=port, lease_ttl_s=ttl, present=kv is not None)

    members = [node(n, current.get(n), rank) for rank, n in enumerate(ids)]
    waiting = [node(n, kv, None) for n, kv in joins.get(round_ + 1, [])]
    run_kv = by_key.get(keys.run)
    run_lease = run_kv.lease if run_kv is not None else 0
    return RunInfo(
        run_id, V3, round_, len(ids), keys.closed in by_key, members, waiting,
        expiry_s=_lease_left(client, run_lease, deadline),
        store_keys=(counts[2].count if round_ > 0 else 0) if detail else None,
        revision=first.revision,
    )


def read_run(
    client: EtcdClient, prefix: str, run_id: str, backend: str, deadline: Deadline, *, detail: bool = False
) -> RunInfo | None:
    reader = read_v2 if backend == V2 else read_v3
    return reader(client, prefix, run_id, deadline, detail=detail)
