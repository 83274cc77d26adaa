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
it consumed, and each node counts the watch events (and bytes) its watches
were delivered in the round.

Two floors: ``floor`` (one Put per node, then a prefix watch until N keys:
O(N²) watch events in all) and ``floor-barrier`` (one watch event per waiting
node: the least a barrier over etcd can do, O(N) in all).

Time box: every round of a contender has ``box`` seconds (its handlers get
``join_timeout = box``, so a round that cannot finish ends by itself). A
contender whose round did not finish in its box is reported as "did not finish
in X s" at that N and not run at any larger N; one that failed twice at an N is
not run at larger N either.
"""

from __future__ import annotations

import math
import statistics
import time
import uuid
from typing import Any

from .common import (
    C10D,
    FLOOR,
    FLOOR_BARRIER,
    FLOORS,
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

# A round that failed after this share of its box is a time-box overrun, not an error.
_BOX_SHARE = 0.95


def handler_spec(contender: str, endpoint: str, tcp_endpoint: str, run_id: str, min_nodes: int,
                 max_nodes: int, conf: dict[str, Any], clients: str = "node",
                 nodes_per_client: int = 0) -> tuple[str, dict[str, Any]]:
    """(node kind, spec) for one node group of ``contender``; ``clients``: ``"node"`` or
    ``"process"`` (the etcd-v3 handlers and floors of a worker share a client; with
    ``nodes_per_client``, every that many nodes of a worker share one)."""
    if contender in FLOORS:
        return contender, {"endpoint": endpoint, "prefix": f"/bench/{contender}/{run_id}/", "n": max_nodes,
                           "timeout": float(conf.get("join_timeout", 60)), "clients": clients,
                           "nodes_per_client": nodes_per_client}
    spec_conf = dict(conf)
    if contender == C10D:
        spec_conf.setdefault("is_host", False)
        endpoint = tcp_endpoint
    return "handler", {"contender": contender, "endpoint": endpoint, "run_id": run_id,
                       "min_nodes": min_nodes, "max_nodes": max_nodes, "conf": spec_conf, "clients": clients,
                       "nodes_per_client": nodes_per_client}


def validate(run: Any, n: int) -> str | None:
    """None when every node got a distinct rank in a world of size ``n``."""
    if not run.ok:
        return run.first_error()
    ranks = sorted(r["value"][0] for r in run.results.values())
    worlds = {r["value"][1] for r in run.results.values()}
    if ranks != list(range(n)) or worlds != {n}:
        return f"bad ranks/world sizes: ranks {ranks[:8]}..., worlds {sorted(worlds)}"
    return None


def watch_delta(before: dict[int, tuple[int, int] | None],
                after: dict[int, tuple[int, int] | None]) -> dict[str, float] | None:
    """Per-node watch events and bytes of one round: mean and max over the nodes that have a
    counter (None when no node has one: c10d, torch's etcd-v2)."""
    per_node = [(a[0] - b[0], a[1] - b[1]) for k, a in after.items()
                if a is not None and (b := before.get(k)) is not None]
    if not per_node:
        return None
    events = [e for e, _ in per_node]
    nbytes = [b for _, b in per_node]
    return {"events_mean": statistics.fmean(events), "events_max": max(events),
            "bytes_mean": statistics.fmean(nbytes), "bytes_max": max(nbytes), "nodes": len(per_node)}


def measure_round(pool: Pool, contender: str, n: int, server: Any, tcp_endpoint: str,
                  conf: dict[str, Any], timeout: float, max_workers: int,
                  box: float | None = None, missing: int = 0, clients: str = "process",
                  nodes_per_client: int = 0) -> dict[str, Any]:
    """One timed rendezvous of ``n`` fresh nodes of ``contender`` (``server``: None for c10d).

    ``timeout`` bounds creating the nodes; ``box`` (default ``timeout``) the timed round:
    the handlers' ``join_timeout`` is set to it. ``out["did_not_finish"]`` is the box when
    the round failed after (nearly) all of it. ``missing``: nodes of the ``n`` that never
    come (a round that cannot finish: the test of the box). ``clients``: see :func:`handler_spec`.
    """
    box = float(box or timeout)
    conf = {**conf, "join_timeout": str(max(1, math.ceil(box)))}
    endpoint = server.get_endpoint() if server is not None else ""
    run_id = f"b2-{contender.replace(' ', '_')}-{n}-{uuid.uuid4().hex[:8]}"
    workers = pool.workers[: max(1, min(max_workers, n))]
    group = NodeGroup(run_id, assign(list(range(n - missing)), workers))
    kind, spec = handler_spec(contender, endpoint, tcp_endpoint, run_id, n, n, conf, clients, nodes_per_client)
    out: dict[str, Any] = {"elapsed": None, "error": None, "delta": None, "watch": None, "did_not_finish": None}
    try:
        errors = group.create(kind, spec, timeout)
        if errors:
            out["error"] = f"creating {len(errors)} node(s) failed: {next(iter(errors.values()))}"
            return out
        counts_before = group.watch_counts()
        before = etcd_snapshot(server) if server is not None else None
        run = group.run("rendezvous", box + 15)
        wall = time.monotonic() - run.t0
        after = etcd_snapshot(server) if server is not None else None
        out["error"] = validate(run, n) if not missing else run.first_error() or "a round with missing nodes finished"
        if out["error"] is not None and wall >= _BOX_SHARE * box:
            out["did_not_finish"] = box
            out["error"] = f"did not finish in {box:g} s ({out['error']})"
        out["elapsed"] = run.elapsed if out["error"] is None else None
        out["delta"] = snapshot_delta(before, after) if before and after else {}
        out["watch"] = watch_delta(counts_before, group.watch_counts())
    except WorkerError as e:
        out["error"] = str(e)
    except OSError as e:  # the counters' read failed: etcd is gone (it may crash under overload)
        out["error"] = f"etcd did not answer its status read after the round ({e}); log: {_log_of(server)}"
    finally:
        group.close()
    return out


def _log_of(server: Any) -> str:
    return str(getattr(server, "log_path", None) or "n/a")


def run_b2(pool: Pool, farm: EtcdFarm, tcp_endpoint: str, contenders: list[str], ns: list[int], reps: int,
           timeout: float, max_workers: int, conf: dict[str, Any] | None = None,
           warmup: bool = True, box: dict[str, float] | None = None,
           clients: str = "process", nodes_per_client: int = 0) -> dict[str, Any]:
    """Measure every contender at every N, ``reps`` runs each; returns the B2 section.

    ``box``: the time box of one round per contender name, ``"*"`` for the others
    (default ``timeout``). ``clients``: ``"process"`` (default: the etcd-v3 nodes and
    the floors' nodes of one worker share one client, or every ``nodes_per_client`` of
    them one) or ``"node"`` (one each)."""
    conf = dict(conf or {})
    boxes = {c: float((box or {}).get(c, (box or {}).get("*", timeout))) for c in contenders}
    series: dict[str, dict[int, Series]] = {c: {n: Series() for n in ns} for c in contenders}
    deltas: dict[str, dict[int, list[dict[str, Any]]]] = {c: {n: [] for n in ns} for c in contenders}
    watches: dict[str, dict[int, list[dict[str, float]]]] = {c: {n: [] for n in ns} for c in contenders}
    failures: dict[str, dict[int, list[str]]] = {c: {n: [] for n in ns} for c in contenders}
    dnf: dict[str, dict[int, float]] = {c: {} for c in contenders}  # N -> the box it overran
    skipped: dict[str, dict[int, str]] = {c: {} for c in contenders}
    # One untimed round per contender first, with a node in every worker: code paths warm.
    warm_n = max(2, min(max_workers, max(ns)))
    for c in contenders if warmup else []:
        server = None if c == C10D else farm.get(c)
        res = measure_round(pool, c, warm_n, server, tcp_endpoint, conf, timeout, max_workers, boxes[c],
                            clients=clients, nodes_per_client=nodes_per_client)
        if res["error"]:
            say(f"B2 warm-up {c}: FAILED {res['error'][:300]}")
    gave_up: dict[str, str] = {}  # contender -> why it is not run at larger N
    for n in ns:
        for rep in range(reps):
            for c in rotated(contenders, rep):
                if c in gave_up:
                    skipped[c].setdefault(n, gave_up[c])
                    continue
                if dnf[c].get(n) is not None:
                    continue  # one overrun of the box per N is enough
                if len(failures[c][n]) >= 2:
                    continue
                server = None if c == C10D else farm.get(c)
                res = measure_round(pool, c, n, server, tcp_endpoint, conf, timeout, max_workers, boxes[c],
                                    clients=clients, nodes_per_client=nodes_per_client)
                if res["error"]:
                    say(f"B2 N={n} {c}: FAILED {res['error'][:300]}")
                    failures[c][n].append(res["error"])
                    series[c][n].add_run([])
                    if res["did_not_finish"] is not None:
                        dnf[c][n] = res["did_not_finish"]
                    continue
                series[c][n].add_run([res["elapsed"]])
                deltas[c][n].append(res["delta"])
                if res["watch"] is not None:
                    watches[c][n].append(res["watch"])
                w = res["watch"]
                wtxt = f", watch events/node mean {w['events_mean']:.1f} max {w['events_max']}" if w else ""
                say(f"B2 N={n} rep {rep} {c}: {res['elapsed'] * 1000:.0f} ms, "
                    f"etcd deltas {res['delta']}{wtxt}")
        for c in contenders:
            if c in gave_up:
                continue
            if dnf[c].get(n) is not None:
                gave_up[c] = f"not run: did not finish in {dnf[c][n]:g} s at N={n}"
            elif len(failures[c][n]) >= 2:
                gave_up[c] = f"not run: failed twice at N={n}"
    out = summarize_b2(series, deltas, watches, failures, dnf, skipped, contenders, ns, conf, max_workers, boxes)
    out["clients"] = clients
    out["nodes_per_client"] = nodes_per_client
    return out


def _median_int(values: list[int | None]) -> float | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    mid = len(vals) // 2
    return float(vals[mid]) if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def _watch_summary(rounds: list[dict[str, float]]) -> dict[str, Any] | None:
    """Over the rounds: the median of the per-round means, and the largest per-node figure."""
    if not rounds:
        return None
    return {"events_mean": statistics.median(r["events_mean"] for r in rounds),
            "events_max": max(r["events_max"] for r in rounds),
            "bytes_mean": statistics.median(r["bytes_mean"] for r in rounds),
            "bytes_max": max(r["bytes_max"] for r in rounds),
            "rounds": len(rounds)}


def summarize_b2(series: dict[str, dict[int, Series]], deltas: dict[str, dict[int, list[dict[str, Any]]]],
                 watches: dict[str, dict[int, list[dict[str, float]]]],
                 failures: dict[str, dict[int, list[str]]], dnf: dict[str, dict[int, float]],
                 skipped: dict[str, dict[int, str]], contenders: list[str], ns: list[int],
                 conf: dict[str, Any], max_workers: int, boxes: dict[str, float]) -> dict[str, Any]:
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
                                   "revisions": revisions, "watch": _watch_summary(watches[c][n]),
                                   "failures": failures[c][n][:3], "failed_runs": len(failures[c][n]),
                                   "did_not_finish": dnf[c].get(n), "skipped": skipped[c].get(n)}
            for base in (C10D, TORCH_ETCD_V2, FLOOR, FLOOR_BARRIER):
                if base != c and base in series:
                    row[f"ratio_vs_{base}"] = ratio_summary(series[c][n], series[base][n])
            rows.append(row)
    return {"ns": ns, "contenders": contenders, "conf": conf, "workers": max_workers, "box_s": boxes, "rows": rows,
            "note": "revisions: v3 header revision delta; for torch etcd-v2 the v2 store index delta. "
                    "etcd writes: raft index delta (every v2/v3 write, lease grant and revoke). "
                    "Watch events per node: the events the watches of a node's etcd clients delivered "
                    "in the round (median over rounds of the mean over nodes / the largest of any node); "
                    "bytes: the serialized size of those watch responses. n/a for c10d and torch's "
                    "etcd-v2, which use no client of this package."}
