"""What ``close`` and ``gc`` write, one fenced transaction per run.

* :func:`close_v3`: the operator's stop (:func:`etcd_rdzv.native.protocol.abort`:
  ``ctl/closed`` and the abort mark ``ctl/abort`` in one transaction, or the mark alone
  when the run is closed already, bound to the run lease, created as a closing node
  creates it when no round was sealed yet). Waiting nodes raise ``RendezvousClosedError``;
  agents of a running round learn it from ``num_nodes_waiting()``, which the mark makes
  positive (a close by an agent's ``shutdown()`` alone leaves running members alone).
* :func:`close_v2`: torch's state with ``closed = True``, written with a compare-and-set
  on the state key's mod revision (keeping the key's lease), re-read and retried at once
  when a heartbeat won the race. torch's agents raise ``RendezvousClosedError`` at their
  next sync. :func:`encode_closed` builds the new pickle from torch's real classes.
* :func:`gc`: removes what a run left behind only when no node can still use it: an
  etcd-v3 run with no join key left that is closed or whose run lease is gone, in one
  Txn that re-checks both; a closed etcd-v2 run whose newest heartbeat is older than
  ``grace`` seconds (state key and store), fenced by the state's mod revision. Open,
  live runs are never touched: etcd expires their keys by lease.

Every call is bounded by the command's :class:`~.connect.Deadline`.
"""

from __future__ import annotations

import logging
import pickle
from base64 import b64encode
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from etcd_store.client import (
    DeleteResult,
    EtcdClient,
    RangeResult,
    compare_mod,
    compare_version,
    op_delete,
    op_get,
    op_put,
    prefix_range_end,
)
from etcd_store.errors import EtcdLeaseNotFound

from ..conf import V2_ANCHOR_DIR, V2_PRESENCE_DIR
from ..conf_keys import DEFAULT_STATE_TTL
from ..native import protocol
from ..native.records import RunKeys
from ..v2state import NodeDesc, StateDecodeError, V2State, decode_state
from .connect import CliError, Deadline
from .runs import V2, V3, find_runs, state_key

log = logging.getLogger(__name__)

__all__ = ["Removal", "close_v2", "close_v3", "encode_closed", "gc"]

_CAS_ATTEMPTS = 20  # heartbeats rewrite a v2 state about once per keep_alive_interval per node


def close_v3(client: EtcdClient, prefix: str, run_id: str, deadline: Deadline,
             *, state_ttl: int = DEFAULT_STATE_TTL) -> protocol.AbortOutcome:
    """Close an etcd-v3 run and stop every agent of it; returns whether this call closed it and
    whether it wrote the abort mark (both False: it was stopped already).
    """
    keys = RunKeys.for_run(prefix, run_id)
    if client.range(f"{keys.root}/".encode(), prefix=True, count_only=True, timeout=deadline.left()).count == 0:
        raise CliError(f"no etcd-v3 run {run_id!r} under {prefix or '/'}")
    for attempt in (1, 2):
        lease = protocol.ensure_run_lease(client, keys, state_ttl, timeout=deadline.left())
        try:
            return protocol.abort(client, keys, lease, timeout=deadline.left())
        except EtcdLeaseNotFound:
            if attempt == 2:
                raise
            log.info("run lease %x of %s expired meanwhile; taking a new one", lease, run_id)
    raise AssertionError("unreachable")


def close_v2(client: EtcdClient, prefix: str, run_id: str, deadline: Deadline) -> bool:
    """Close an etcd-v2 run; True if this call closed it, False if it was closed already."""
    key = state_key(prefix, run_id)
    raw = key.encode()
    kv = client.get(raw, timeout=deadline.left())
    for _ in range(_CAS_ATTEMPTS):
        if kv is None:
            raise CliError(f"no etcd-v2 run {run_id!r} (no state key {key})")
        state = decode_state(kv.value, key, time_left=deadline.left())
        if state.closed:
            return False
        try:
            res = client.txn(
                [compare_mod(raw, "==", kv.mod_revision)],
                [op_put(raw, encode_closed(state), lease=kv.lease)],
                [op_get(raw)],
                timeout=deadline.left(),
                idempotent=True,
            )
        except EtcdLeaseNotFound:
            raise CliError(f"the state of {run_id!r} expired while closing it") from None
        if res.succeeded:
            return True
        found = res.responses[0]
        assert isinstance(found, RangeResult)
        kv = found.kvs[0] if found.kvs else None
    raise CliError(f"the state of {run_id!r} changed {_CAS_ATTEMPTS} times while closing it; try again")


@dataclass(frozen=True)
class Removal:
    """One run ``gc`` removed (or, with ``dry_run``, would remove)."""

    run_id: str
    backend: str
    reason: str
    keys: int  # keys deleted (dry run: keys that would be)


def gc(client: EtcdClient, prefix: str, deadline: Deadline, *, grace: float = 60.0,
       dry_run: bool = False, now: datetime | None = None,
       run_ids: Sequence[str] | None = None) -> list[Removal]:
    """Remove what closed or dead runs left under ``prefix``, or of ``run_ids`` only (then only
    their keys are read: a role limited to those runs suffices); see the module doc."""
    removed: list[Removal] = []
    for run_id, backends in sorted(find_runs(client, prefix, deadline, run_ids).items()):
        if V3 in backends:
            r = _gc_v3(client, prefix, run_id, deadline, dry_run)
            if r is not None:
                removed.append(r)
        if V2 in backends:
            r = _gc_v2(client, prefix, run_id, deadline, grace, dry_run, now or datetime.now(timezone.utc))
            if r is not None:
                removed.append(r)
    return removed


def _gc_v3(client: EtcdClient, prefix: str, run_id: str, deadline: Deadline, dry_run: bool) -> Removal | None:
    keys = RunKeys.for_run(prefix, run_id)
    root = f"{keys.root}/".encode()
    join_end = prefix_range_end(keys.join_root)
    res = client.txn(
        [],
        [op_get(keys.join_root, prefix=True, count_only=True), op_get(keys.closed, count_only=True),
         op_get(keys.run, count_only=True), op_get(root, prefix=True, count_only=True)],
        timeout=deadline.left(), idempotent=True,
    )
    joins, closed, run, total = (r.count for r in res.responses if isinstance(r, RangeResult))
    if total == 0:
        return None
    if joins or not (closed or not run):
        log.info("gc keeps etcd-v3 run %s: %s", run_id, f"{joins} join key(s) of live nodes" if joins
                 else "open, its run lease is alive")
        return None
    reason = "closed, no live node" if closed else "run lease gone, no live node"
    if dry_run:
        return Removal(run_id, V3, reason, total)
    guard = compare_version(keys.closed, ">", 0) if closed else compare_version(keys.run, "==", 0)
    done = client.txn(
        [compare_version(keys.join_root, "==", 0, range_end=join_end), guard],
        [op_delete(root, prefix=True)],
        timeout=deadline.left(), idempotent=True,
    )
    if not done.succeeded:
        log.info("etcd-v3 run %s changed before gc could remove it; kept", run_id)
        return None
    deleted = done.responses[0]
    assert isinstance(deleted, DeleteResult)
    return Removal(run_id, V3, reason, deleted.deleted)


def _gc_v2(client: EtcdClient, prefix: str, run_id: str, deadline: Deadline, grace: float,
           dry_run: bool, now: datetime) -> Removal | None:
    key = state_key(prefix, run_id)
    raw = key.encode()
    kv = client.get(raw, timeout=deadline.left())
    if kv is None:
        return None
    try:
        state = decode_state(kv.value, key, time_left=deadline.left())
    except StateDecodeError as e:  # one run's state: the others are still collected
        log.warning("gc skips %s: %s", key, e)
        return None
    newest = state.newest_heartbeat()
    if newest is not None and newest.tzinfo is None:
        newest = newest.replace(tzinfo=timezone.utc)
    if not state.closed or (newest is not None and (now - newest).total_seconds() < grace):
        log.info("gc keeps etcd-v2 run %s: %s", run_id, "open" if not state.closed else
                 f"closed, a heartbeat {(now - newest).total_seconds():.0f} s ago (--grace {grace:g})"
                 if newest is not None else "closed")
        return None
    reason = f"closed, no heartbeat for {(now - newest).total_seconds():.0f} s" if newest else "closed"
    store = f"{key}/store".encode()
    anchors = f"{key}/{V2_ANCHOR_DIR}/".encode()
    present = f"{key}/{V2_PRESENCE_DIR}/".encode()
    if dry_run:
        counted = client.txn([], [op_get(store, prefix=True, count_only=True),
                                  op_get(anchors, prefix=True, count_only=True),
                                  op_get(present, prefix=True, count_only=True)], timeout=deadline.left())
        return Removal(run_id, V2, reason, 1 + sum(r.count for r in counted.responses if isinstance(r, RangeResult)))
    done = client.txn(
        [compare_mod(raw, "==", kv.mod_revision)],
        # Everything a run writes lies in its two ranges (the key, ``<key>/``: cli/grants.py), so
        # gc deletes no more than ``etcd-rdzv grant`` allows.
        [op_delete(raw), op_delete(store, prefix=True), op_delete(anchors, prefix=True),
         op_delete(present, prefix=True)],
        timeout=deadline.left(), idempotent=True,
    )
    if not done.succeeded:
        log.info("etcd-v2 run %s changed before gc could remove it; kept", run_id)
        return None
    return Removal(run_id, V2, reason, sum(r.deleted for r in done.responses if isinstance(r, DeleteResult)))


def encode_closed(state: V2State) -> bytes:
    """The base64 of torch's pickled state equal to ``state`` but with ``closed = True``.

    Builds torch's own ``_RendezvousState``/``_NodeDesc`` from the checked plain data (imports
    torch), as torch's handler writes it. Raises :class:`StateDecodeError` if the stored state
    had attributes :class:`V2State` does not carry (a newer torch): rewriting would drop them.
    """
    if state.unknown:
        raise StateDecodeError(
            f"the state has attributes this tool does not know ({', '.join(state.unknown)}); "
            "close the run from an agent (set_closed) instead"
        )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    def real(n: NodeDesc) -> Any:
        return _NodeDesc(n.addr, n.pid, n.local_id)

    out = _RendezvousState()
    out.round = state.round
    out.complete = state.complete
    out.deadline = state.deadline
    out.closed = True
    out.participants = {real(n): r for n, r in state.participants.items()}
    out.wait_list = {real(n) for n in state.wait_list}
    out.redundancy_list = {real(n) for n in state.redundancy_list}
    out.last_heartbeats = {real(n): t for n, t in state.last_heartbeats.items()}
    return b64encode(pickle.dumps(out))
