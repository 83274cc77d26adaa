"""B5: ``init_process_group("gloo")`` over our EtcdStore versus TCPStore.

World sizes 2..16, one rank per worker process (a process group is process
global). Each rank builds its store before the go signal (connection set-up is
not timed); the figure is the time from the go signal until the last rank's
``init_process_group`` returned (gloo connects its full mesh through the
store, so the last return is when the group is usable). An all-reduce checks
every group afterwards (untimed). Contenders alternate between runs; each run
uses a fresh key prefix. The TCPStore server lives in the benchmark process.
"""

from __future__ import annotations

import uuid
from typing import Any

from .common import OURS_STORE, TCP_STORE, EtcdFarm, Series, ratio_summary, rotated, say
from .workers import NodeGroup, Pool, WorkerError


def measure(pool: Pool, store: str, world: int, endpoint: str, timeout: float) -> dict[str, Any]:
    run = uuid.uuid4().hex[:8]
    group = NodeGroup(f"b5-{store.replace(' ', '_')}-{world}-{run}",
                      {w: [i] for i, w in enumerate(pool.workers[:world])})
    spec = {"store": store, "endpoint": endpoint, "prefix": f"/bench/b5/{run}", "world_size": world,
            "timeout": timeout}
    out: dict[str, Any] = {"elapsed": None, "error": None}
    try:
        errors = group.create("pg", spec, timeout)
        if errors:
            out["error"] = f"store creation: {next(iter(errors.values()))}"
            return out
        res = group.run("rendezvous", timeout)
        if not res.ok:
            out["error"] = res.first_error()
            return out
        check = group.run("check", timeout)
        sums = {r["value"] for r in check.results.values()} if check.ok else set()
        if sums != {float(world)}:
            out["error"] = f"all-reduce check failed: {check.first_error() or sums}"
            return out
        out["elapsed"] = res.elapsed
    except WorkerError as e:
        out["error"] = str(e)
    finally:
        group.close()
    return out


def run_b5(pool: Pool, farm: EtcdFarm, tcp_endpoint: str, contenders: list[str], worlds: list[int], reps: int,
           timeout: float) -> dict[str, Any]:
    """Time process-group start-up for each store and world size; returns the B5 section."""
    worlds = [w for w in worlds if w <= len(pool.workers)]
    series = {c: {w: Series() for w in worlds} for c in contenders}
    failures: dict[str, dict[int, list[str]]] = {c: {w: [] for w in worlds} for c in contenders}
    endpoints = {c: tcp_endpoint if c == TCP_STORE else farm.get(c).get_endpoint() for c in contenders}
    for c in contenders:  # warm-up: gloo's first use in every worker
        measure(pool, c, max(worlds), endpoints[c], timeout)
    for w in worlds:
        for rep in range(reps):
            for c in rotated(contenders, rep):
                res = measure(pool, c, w, endpoints[c], timeout)
                if res["error"]:
                    failures[c][w].append(res["error"])
                    series[c][w].add_run([])
                    say(f"B5 world={w} {c}: FAILED {res['error'][:300]}")
                    continue
                series[c][w].add_run([res["elapsed"]])
                say(f"B5 world={w} rep {rep} {c}: {res['elapsed'] * 1000:.0f} ms")
    rows = []
    for w in worlds:
        for c in contenders:
            row: dict[str, Any] = {"world": w, "contender": c, "ms": series[c][w].summary(scale=1000.0),
                                   "failures": failures[c][w][:3], "failed_runs": len(failures[c][w])}
            if c == OURS_STORE and TCP_STORE in series:
                row["ratio_vs_TCPStore"] = ratio_summary(series[c][w], series[TCP_STORE][w])
            rows.append(row)
    return {"worlds": worlds, "reps": reps, "contenders": contenders, "rows": rows}
