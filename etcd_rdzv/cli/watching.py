"""``watch``: a live view of a run's joins, seals, departures and closes, from now on.

Pure parts: :func:`describe_v3` turns a batch of watch events on an etcd-v3 run into change
records, :func:`diff_v2` compares two decoded etcd-v2 states. A change record is a dict
``{"event": "join"|"leave"|"rejoin"|"seal"|"close"|"abort"|"run-lease-gone"|"reopen"|
"state-gone", "revision": N, ...}`` plus ``round``, ``node``, ``from_round``, ``host``,
``world_size``, ``members``, ``master`` where they apply. :func:`watch_run` reads the run
once (within the command's deadline), then watches from right after that read's revision,
so no change is missed; it returns after ``count`` records or ``duration`` seconds, or when
the caller interrupts it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from etcd_store.client import EtcdClient, Event

from ..native.records import ProtocolStateError, RunKeys, decode_sealed, join_doc
from ..v2state import StateDecodeError, V2State, decode_state
from .connect import CliError, Deadline
from .render import esc
from .runs import V2, state_key

log = logging.getLogger(__name__)

__all__ = ["describe_v3", "diff_v2", "format_change", "watch_run"]

Change = dict[str, Any]


def _join_host(value: bytes) -> str | None:
    addr = join_doc(value).get("addr")
    return addr if isinstance(addr, str) else None


def describe_v3(keys: RunKeys, events: list[Event]) -> list[Change]:
    """Change records of one batch of events on ``ctl/`` and ``join/`` (a join that also left its previous
    round in the same transaction is one ``rejoin``)."""
    out: list[Change] = []
    left: dict[tuple[int, str], Change] = {}  # (revision, node) -> the "leave" record, to pair
    for ev in events:
        rev = ev.kv.mod_revision
        parsed = keys.parse_join_key(ev.key)
        if parsed is not None:
            round_, node = parsed
            if ev.type == "DELETE":
                record: Change = {"event": "leave", "revision": rev, "round": round_, "node": node}
                left[(rev, node)] = record
                out.append(record)
            elif ev.kv.version == 1:
                earlier = left.pop((rev, node), None)
                record = {"event": "join", "revision": rev, "round": round_, "node": node,
                          "host": _join_host(ev.value)}
                if earlier is not None:
                    out.remove(earlier)
                    record.update(event="rejoin", from_round=earlier["round"])
                out.append(record)
        elif ev.key == keys.sealed and ev.type == "DELETE":  # with the run lease
            out.append({"event": "run-lease-gone", "revision": rev})
        elif ev.key == keys.sealed:
            try:
                round_, _, master = decode_sealed(ev.value, ev.key)
            except ProtocolStateError as e:
                out.append({"event": "seal", "revision": rev, "error": str(e)})
                continue
            record = {"event": "seal", "revision": rev, "round": round_}
            if master is not None:
                record["master"] = f"{master[0]}:{master[1]}"
            out.append(record)
        elif ev.key == keys.closed:
            out.append({"event": "close" if ev.type == "PUT" else "reopen", "revision": rev})
        elif ev.key == keys.abort and ev.type == "PUT":
            out.append({"event": "abort", "revision": rev})
    return out


def diff_v2(old: V2State | None, new: V2State | None, revision: int) -> list[Change]:
    """Change records between two etcd-v2 states (``None``: no state key)."""
    if new is None:
        return [] if old is None else [{"event": "state-gone", "revision": revision}]
    out: list[Change] = []

    def nodes(s: V2State | None) -> dict[str, Any]:
        if s is None:
            return {}
        return {n.node_id: n for n in (*s.participants, *s.wait_list)}

    before, after = nodes(old), nodes(new)
    for node_id in sorted(after.keys() - before.keys()):
        n = after[node_id]
        round_ = new.round + 1 if n in new.wait_list and new.complete else new.round
        out.append({"event": "join", "revision": revision, "round": round_, "node": node_id, "host": n.addr})
    for node_id in sorted(before.keys() - after.keys()):
        out.append({"event": "leave", "revision": revision, "node": node_id})
    sealed_now = new.complete and (old is None or not old.complete or old.round != new.round)
    if sealed_now:
        members = [n.node_id for n, _ in new.members()]
        out.append({"event": "seal", "revision": revision, "round": new.round,
                    "world_size": len(members), "members": members})
    if new.closed and (old is None or not old.closed):
        out.append({"event": "close", "revision": revision})
    return out


def format_change(change: Change, when: float) -> str:
    """One line of ``watch``'s text output."""
    stamp = time.strftime("%H:%M:%S", time.localtime(when)) + f".{int(when * 1000) % 1000:03d}"
    kind = change["event"]
    parts = [stamp, f"rev {change['revision']}", kind]
    if "round" in change:
        parts.append(f"round {change['round']}")
    if "from_round" in change:
        parts.append(f"(from round {change['from_round']})")
    if "node" in change:
        parts.append(change["node"])
    if change.get("host"):
        parts.append(f"host {change['host']}")
    if "world_size" in change:
        parts.append(f"world_size {change['world_size']}")
    if "master" in change:
        parts.append(f"master {change['master']}")
    if "error" in change:
        parts.append(change["error"])
    return " ".join(esc(p) for p in parts)  # values from etcd: escaped for the terminal


def watch_run(
    client: EtcdClient, prefix: str, run_id: str, backend: str, deadline: Deadline,
    emit: Callable[[Change], None], *, count: int | None = None, duration: float | None = None,
    started: Callable[[int], None] | None = None,
) -> int:
    """Follow the run, calling ``emit`` per change record; returns the number emitted.

    ``started(revision)`` is called once the run was read: every later change is reported.
    """
    end = None if duration is None else time.monotonic() + duration
    emitted = 0
    if backend == V2:
        key = state_key(prefix, run_id)
        raw = key.encode()
        res = client.range(raw, timeout=deadline.left())
        if not res.kvs:
            raise CliError(f"no etcd-v2 run {run_id!r} (no state key {key})")
        state: V2State | None = _decode(res.kvs[0].value, key)
        watch = client.watch(raw, start_revision=res.revision + 1)
    else:
        keys = RunKeys.for_run(prefix, run_id)
        res = client.range(f"{keys.root}/".encode(), prefix=True, count_only=True, timeout=deadline.left())
        if res.count == 0:
            raise CliError(f"no etcd-v3 run {run_id!r} under {prefix or '/'}")
        # ctl/ and join/ (they sort next to each other), not the rounds' stores.
        watch = client.watch(keys.ctl, keys.rounds, start_revision=res.revision + 1)
    if started is not None:
        started(res.revision)
    with watch:
        while count is None or emitted < count:
            wait = 0.5 if end is None else min(0.5, end - time.monotonic())
            if wait <= 0:
                break
            batch = watch.get(timeout=wait)
            if not batch:
                continue
            if backend == V2:
                changes = []
                for ev in batch:
                    new = None if ev.type == "DELETE" else _decode(ev.value, key)
                    changes += diff_v2(state, new, ev.kv.mod_revision)
                    state = new
            else:
                changes = describe_v3(keys, batch)
            for change in changes:
                if count is not None and emitted >= count:
                    break
                emit(change)
                emitted += 1
    return emitted


def _decode(value: bytes, key: str) -> V2State:
    try:
        return decode_state(value, key)
    except StateDecodeError as e:
        raise CliError(str(e)) from None
