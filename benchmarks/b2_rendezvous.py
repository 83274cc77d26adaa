"""B2: time until all N simulated nodes hold their RendezvousInfo, per backend.

For each N and each run, the contenders are measured one after the other in an
order that rotates between runs, each against its own etcd (the same
binary and flags, v2 API enabled so torch's built-in can use it; see
:class:`benchmarks.common.EtcdFarm`) and, for c10d, a TCPStore hosted by the
benchmark process. Each measurement uses a fresh ``run_id``. Nodes are handlers created as
torchrun creates them (``min_nodes = max_nodes = N``), spread round-robin over
the worker processes, one thread each. The figure is the time from the shared
go signal to the return of the last node's ``next_rendezvous()``; the etcd
counters around the timed phase give the writes (raft entries) and revisions
it consumed.
"""

from __future__ import annotations

import uuid
from typing import Any

from .common import (
    C10D,
    FLOOR,
    TORCH_ETCD_V2,
    EtcdFarm,
    Series,
    etcd_snapshot,
    ratio_summary,
    rotated,
    say,
    snapshot_delta,
)
from .workers import NodeGroup, Pool, WorkerError, assign


def handler_spec(contender: str, endpoint: str, tcp_endpoint: str, run_id: str, min_nodes: int,
                 max_nodes: int, conf: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(node kind, spec) for one node group of ``contender``."""
    if contender == FLOOR:
        return FLOOR, {"endpoint": endpoint, "prefix": f"/bench/floor/{run_id}/", "n": max_nodes,
                       "timeout": float(conf.get("join_timeout", 60))}
    spec_conf = dict(conf)
    if contender == C10D:
        spec_conf.setdefault("is_host", False)
        endpoint = tcp_endpoint
    return "handler", {"contender": contender, "endpoint": endpoint, "run_id": run_id,
                       "min_nodes": min_nodes, "max_nodes": max_nodes, "conf": spec_conf}


def validate(run: Any, n: int) -> str | None:
    """None when every node got a distinct rank in a world of size ``n``."""
    if not run.ok:
        return run.first_error()
    ranks = sorted(r["value"][0] for r in run.results.values())
    worlds = {r["value"][1] for r in run.results.values()}
    if ranks != list(range(n)) or worlds != {n}:
        return f"bad ranks/world sizes: ranks {ranks[:8]}..., worlds {sorted(worlds)}"
    return None


def measure_round(pool: Pool, contender: str, n: int, server: Any, tcp_endpoint: str,
                  conf: dict[str, Any], timeout: float, max_workers: int) -> dict[str, Any]:
    """One timed rendezvous of ``n`` fresh nodes of ``contender`` (``server``: None for c10d)."""
    endpoint = server.get_endpoint() if server is not None else ""
    run_id = f"b2-{contender.replace(' ', '_')}-{n}-{uuid.uuid4().hex[:8]}"
    workers = pool.workers[: max(1, min(max_workers, n))]
    group = NodeGroup(run_id, assign(list(range(n)), workers))
    kind, spec = handler_spec(contender, endpoint, tcp_endpoint, run_id, n, n, conf)
    out: dict[str, Any] = {"elapsed": None, "error": None, "delta": None}
    try:
        errors = group.create(kind, spec, timeout)
        if errors:
            out["error"] = f"creating {len(errors)} node(s) failed: {next(iter(errors.values()))}"
            return out
        before = etcd_snapshot(server) if server is not None else None
        run = group.run("rendezvous", timeout)
        after = etcd_snapshot(server) if server is not None else None
        out["error"] = validate(run, n)
        out["elapsed"] = run.elapsed if out["error"] is None else None
        out["delta"] = snapshot_delta(before, after) if before and after else {}
    except WorkerError as e:
        out["error"] = str(e)
    finally:
        group.close()
    return out


def run_b2(pool: Pool, farm: EtcdFarm, tcp_endpoint: str, contenders: list[str], ns: list[int], reps: int,
           timeout: float, max_workers: int, conf: dict[str, Any] | None = None,
           warmup: bool = True) -> dict[str, Any]:
    """Measure every contender at every N, ``reps`` runs each; returns the B2 section."""
    conf = dict(conf or {})
    conf.setdefault("join_timeout", str(int(timeout)))
    series: dict[str, dict[int, Series]] = {c: {n: Series() for n in ns} for c in contenders}
    deltas: dict[str, dict[int, list[dict[str, Any]]]] = {c: {n: [] for n in ns} for c in contenders}
    failures: dict[str, dict[int, list[str]]] = {c: {n: [] for n in ns} for c in contenders}
    # One untimed round per contender first, with a node in every worker: code paths warm.
    warm_n = max(2, min(max_workers, max(ns)))
    for c in contenders if warmup else []:
        server = None if c == C10D else farm.get(c)
        res = measure_round(pool, c, warm_n, server, tcp_endpoint, conf, timeout, max_workers)
        if res["error"]:
            say(f"B2 warm-up {c}: FAILED {res['error'][:300]}")
    gave_up: dict[str, int] = {}
    for n in ns:
        for rep in range(reps):
            for c in rotated(contenders, rep):
                if c in gave_up:
                    if not failures[c][n]:
                        failures[c][n].append(f"not run: failed twice at N={gave_up[c]}")
                    continue
                if len(failures[c][n]) >= 2:
                    gave_up[c] = n  # failed twice at this N: larger N would only burn the budget
                    continue
                server = None if c == C10D else farm.get(c)
                res = measure_round(pool, c, n, server, tcp_endpoint, conf, timeout, max_workers)
                if res["error"]:
                    say(f"B2 N={n} {c}: FAILED {res['error'][:300]}")
                    failures[c][n].append(res["error"])
                    series[c][n].add_run([])
                    continue
                series[c][n].add_run([res["elapsed"]])
                deltas[c][n].append(res["delta"])
                say(f"B2 N={n} rep {rep} {c}: {res['elapsed'] * 1000:.0f} ms, "
                    f"etcd deltas {res['delta']}")
    return summarize_b2(series, deltas, failures, contenders, ns, conf, max_workers)


def _median_int(values: list[int | None]) -> float | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    mid = len(vals) // 2
    return float(vals[mid]) if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def summarize_b2(series: dict[str, dict[int, Series]], deltas: dict[str, dict[int, list[dict[str, Any]]]],
                 failures: dict[str, dict[int, list[str]]], contenders: list[str], ns: list[int],
                 conf: dict[str, Any], max_workers: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for n in ns:
        for c in contenders:
            s = series[c][n].summary(scale=1000.0)
            d = deltas[c][n]
            if c == C10D:
                writes = revisions = None
            elif c == TORCH_ETCD_V2:
                writes = _median_int([x.get("raft_index") for x in d])
                revisions = _median_int([x.get("v2_index") for x in d])  # the v2 store's index
            else:
                writes = _median_int([x.get("raft_index") for x in d])
                revisions = _median_int([x.get("revision") for x in d])
            row: dict[str, Any] = {"n": n, "contender": c, "ms": s, "etcd_writes": writes,
                                   "revisions": revisions, "failures": failures[c][n][:3],
                                   "failed_runs": len(failures[c][n])}
            for base in (C10D, TORCH_ETCD_V2, FLOOR):
                if base != c and base in series:
                    row[f"ratio_vs_{base}"] = ratio_summary(series[c][n], series[base][n])
            rows.append(row)
    return {"ns": ns, "contenders": contenders, "conf": conf, "workers": max_workers, "rows": rows,
            "note": "revisions: v3 header revision delta; for torch etcd-v2 the v2 store index delta. "
                    "etcd writes: raft index delta (every v2/v3 write, lease grant and revoke)."}
