"""B4: what an idle job costs the etcd cluster.

Per N and backend: N nodes complete a rendezvous, then stay idle (only their
heartbeats run) for ``window`` seconds. Around the window we read the backend's
own etcd: v3 revisions (for torch's built-in: the v2 store index), raft entries
(every write of either API, lease grants/revokes and the leader's v2 TTL SYNC
proposals), the bbolt database size, and the CPU time of the etcd process.
Figures are per minute. Each backend has a fresh etcd of its own and all run
concurrently (an idle job's traffic is set by timers, not by CPU).

c10d keeps its state in a TCPStore: no etcd load, reported as n/a.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

from .b2_rendezvous import handler_spec, validate
from .common import C10D, FLOOR, TORCH_ETCD_V2, EtcdFarm, etcd_snapshot, say, snapshot_delta
from .workers import NodeGroup, Pool, WorkerError, assign


def etcd_cpu_seconds(pid: int | None) -> float | None:
    """utime + stime of a process, in seconds (None when unreadable)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def run_b4(pool: Pool, binary: str | None, contenders: list[str], ns: list[int], window: float,
           conf: dict[str, Any], timeout: float, max_workers: int, settle: float = 2.0) -> dict[str, Any]:
    """Measure the idle load of every etcd contender at every N; returns the B4 section."""
    etcd_contenders = [c for c in contenders if c not in (C10D, FLOOR)]
    conf = dict(conf)
    conf.setdefault("join_timeout", str(int(timeout)))
    rows: list[dict[str, Any]] = []
    for n in ns:
        with EtcdFarm(binary) as farm:
            groups: dict[str, NodeGroup] = {}
            errors: dict[str, str] = {}
            try:
                workers = pool.workers[: max(1, min(max_workers, n))]
                for c in etcd_contenders:
                    run_id = f"b4-{c.replace(' ', '_')}-{n}-{uuid.uuid4().hex[:8]}"
                    group = NodeGroup(run_id, assign(list(range(n)), workers))
                    groups[c] = group
                    kind, spec = handler_spec(c, farm.get(c).get_endpoint(), "", run_id, n, n, conf)
                    try:
                        errs = group.create(kind, spec, timeout)
                        if errs:
                            errors[c] = f"create: {next(iter(errs.values()))}"
                    except WorkerError as e:
                        errors[c] = str(e)
                # Rendezvous all backends at once, then let trailing writes settle.
                armed = [c for c in etcd_contenders if c not in errors]
                t0s = {}
                for c in armed:
                    groups[c].arm("rendezvous")
                for c in armed:
                    t0s[c] = groups[c].go()
                for c in armed:
                    try:
                        err = validate(groups[c].collect(t0s[c], timeout), n)
                        if err:
                            errors[c] = f"rendezvous: {err}"
                    except WorkerError as e:
                        errors[c] = str(e)
                threading.Event().wait(settle)
                idle = [c for c in etcd_contenders if c not in errors]
                before = {c: (time.monotonic(), etcd_snapshot(farm.get(c)), etcd_cpu_seconds(farm.get(c).pid))
                          for c in idle}
                say(f"B4 N={n}: {len(idle)} backend(s) idle for {window:g} s")
                threading.Event().wait(window)
                for c in idle:
                    t1, snap1, cpu1 = time.monotonic(), etcd_snapshot(farm.get(c)), etcd_cpu_seconds(farm.get(c).pid)
                    t0, snap0, cpu0 = before[c]
                    minutes = (t1 - t0) / 60.0
                    d = snapshot_delta(snap0, snap1)
                    rev = d["v2_index"] if c == TORCH_ETCD_V2 else d["revision"]
                    row = {
                        "n": n, "contender": c, "window_s": round(t1 - t0, 2),
                        "revisions_per_min": None if rev is None else rev / minutes,
                        "raft_entries_per_min": None if d["raft_index"] is None else d["raft_index"] / minutes,
                        "db_growth_bytes_per_min": None if c == TORCH_ETCD_V2 else (d["db_size"] or 0) / minutes,
                        "etcd_cpu_pct": None if cpu0 is None or cpu1 is None else 100.0 * (cpu1 - cpu0) / (t1 - t0),
                        "deltas": d,
                    }
                    if c == TORCH_ETCD_V2:
                        row["db_note"] = "n/a: the v2 store lives in memory (and the WAL), not in the v3 bbolt db"
                        row["revisions_note"] = "v2 store index"
                    rows.append(row)
                    say(f"B4 N={n} {c}: {row['revisions_per_min']:.1f} revisions/min, "
                        f"{row['raft_entries_per_min']:.1f} raft entries/min, etcd CPU {row['etcd_cpu_pct']}")
            finally:
                for group in groups.values():
                    group.close()
            for c, err in errors.items():
                say(f"B4 N={n} {c}: FAILED {err[:300]}")
                rows.append({"n": n, "contender": c, "error": err})
        for c in contenders:
            if c == C10D:
                rows.append({"n": n, "contender": c, "na": "n/a: c10d keeps its state in a TCPStore, no etcd load"})
    return {"ns": ns, "window_s": window, "settle_s": settle, "conf": conf, "rows": rows,
            "note": "Backends concurrently, each on a fresh etcd of its own. revisions: v3 header revision "
                    "(torch etcd-v2: v2 store index); raft entries include v2 TTL SYNC proposals."}
