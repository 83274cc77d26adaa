"""B4: what an idle job costs the etcd cluster.

Per N and backend: N nodes complete a rendezvous, then stay idle (only their
heartbeats run) for ``window`` seconds. Around the window we read the backend's
own etcd: v3 revisions (for torch's built-in: the v2 store index), raft entries
(every write of either API, lease grants/revokes and the leader's v2 TTL SYNC
proposals), the bbolt database size, and the CPU time of the etcd process.
Figures are per minute. Each (N, backend) has a fresh etcd of its own and all
are idle in the same window (an idle job's traffic is set by timers, not by
CPU); ``together=False`` gives every N its own window (scale mode).

c10d keeps its state in a TCPStore: no etcd load, reported as n/a.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

from .b2_rendezvous import handler_spec, validate
from .common import C10D, FLOORS, TORCH_ETCD_V2, EtcdFarm, etcd_snapshot, say, snapshot_delta
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
           conf: dict[str, Any], timeout: float, max_workers: int, settle: float = 2.0,
           together: bool = True) -> dict[str, Any]:
    """Measure the idle load of every etcd contender at every N; returns the B4 section.

    ``together``: all N share one idle window (each (N, backend) still has its own
    etcd); otherwise one window per N (for N in the thousands).
    """
    etcd_contenders = [c for c in contenders if c != C10D and c not in FLOORS]
    conf = dict(conf)
    conf.setdefault("join_timeout", str(int(timeout)))
    rows: list[dict[str, Any]] = []
    for batch in ([ns] if together else [[n] for n in ns]):
        rows += _idle_window(pool, binary, etcd_contenders, batch, window, conf, timeout, max_workers, settle)
    for n in ns:
        if C10D in contenders:
            rows.append({"n": n, "contender": C10D, "na": "n/a: c10d keeps its state in a TCPStore, no etcd load"})
    rows.sort(key=lambda r: (r["n"], contenders.index(r["contender"])))
    return {"ns": ns, "window_s": window, "settle_s": settle, "conf": conf, "together": together, "rows": rows,
            "note": "Each (N, backend) on a fresh etcd of its own, all idle in the same window. revisions: "
                    "v3 header revision (torch etcd-v2: v2 store index); raft entries include failed "
                    "compare-and-swap attempts and the v2 TTL SYNC proposals."}


def _idle_window(pool: Pool, binary: str | None, contenders: list[str], ns: list[int], window: float,
                 conf: dict[str, Any], timeout: float, max_workers: int, settle: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    cases = [(n, c) for n in ns for c in contenders]
    with EtcdFarm(binary) as farm:
        groups: dict[tuple[int, str], NodeGroup] = {}
        errors: dict[tuple[int, str], str] = {}

        def server(case: tuple[int, str]) -> Any:
            return farm.get(f"{case[1]}@{case[0]}")

        try:
            for case in cases:  # one rendezvous after the other: none is timed here
                n, c = case
                run_id = f"b4-{c.replace(' ', '_')}-{n}-{uuid.uuid4().hex[:8]}"
                group = NodeGroup(run_id, assign(list(range(n)), pool.workers[: max(1, min(max_workers, n))]))
                groups[case] = group
                kind, spec = handler_spec(c, server(case).get_endpoint(), "", run_id, n, n, conf)
                try:
                    errs = group.create(kind, spec, timeout)
                    if errs:
                        errors[case] = f"create: {next(iter(errs.values()))}"
                        continue
                    err = validate(group.run("rendezvous", timeout), n)
                    if err:
                        errors[case] = f"rendezvous: {err}"
                except WorkerError as e:
                    errors[case] = str(e)
            threading.Event().wait(settle)  # trailing writes of the last round
            idle = [case for case in cases if case not in errors]
            before = {case: (time.monotonic(), etcd_snapshot(server(case)), etcd_cpu_seconds(server(case).pid))
                      for case in idle}
            say(f"B4 N={ns}: {len(idle)} (N, backend) pairs idle for {window:g} s")
            threading.Event().wait(window)
            for case in idle:
                n, c = case
                t1, snap1, cpu1 = time.monotonic(), etcd_snapshot(server(case)), etcd_cpu_seconds(server(case).pid)
                t0, snap0, cpu0 = before[case]
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
                    f"{row['raft_entries_per_min']:.1f} raft entries/min, etcd CPU {row['etcd_cpu_pct']:.2f} %")
        finally:
            for group in groups.values():
                group.close()
    for (n, c), err in errors.items():
        say(f"B4 N={n} {c}: FAILED {err[:300]}")
        rows.append({"n": n, "contender": c, "error": err})
    return rows
