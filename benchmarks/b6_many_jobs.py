"""B6: many etcd-v3 jobs on one 3-member etcd cluster.

One :class:`etcd_server.EtcdCluster` of 3 members serves every phase:

1. **Rendezvous under load.** ``J`` jobs of ``nodes`` simulated nodes each (in-process
   etcd-v3 handlers in the worker pool, as B2 builds them; the nodes of one job in one
   worker share a client, as B2's ``clients="process"``) are created untimed, then all
   released at one instant (:func:`benchmarks.workers.go_together`). A job's figure is
   the time from that instant until its last node holds its ``RendezvousInfo``. Every
   J of ``jobs`` is measured in every run (order rotating between runs); one job alone
   (J = 1) is repeated ``solo_rounds`` times per run. The ratio is the median of the
   per-run ratios of the per-run medians (J = max against J = 1). Job ``i``'s clients
   list the members starting at member ``i % 3``, so the connections spread over the
   members as behind a load-balanced service.
2. **Idle load.** After the last round of the largest J its jobs stay up (only their
   keep-alives run) for ``window`` seconds. Read around the window: keep-alive requests
   etcd received (``grpc_server_msg_received_total{grpc_method="LeaseKeepAlive"}``
   summed over the members' ``/metrics``), revisions and raft entries (maintenance
   status), live leases (``LeaseLeases``), the CPU of each member and the threads of
   each worker process.
3. **CLI over many runs.** While those jobs still run, ``cli_runs`` tiny 1-node jobs
   run and end (90 % close the run as torchrun does at the end of a job; 10 % only
   leave it, so it stays open until its run lease expires, and ``gc`` must keep it).
   Then ``etcd-rdzv list`` / ``gc`` are timed as a user runs them: each a subprocess
   ``python -m etcd_rdzv --endpoints <all 3> ...`` (Python start-up included; an
   ``list`` on an empty prefix gives that fixed part).

Nothing here asserts: the figures go to the results, :mod:`benchmarks.targets` judges them.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .b2_rendezvous import handler_spec, validate
from .b4_idle_load import etcd_cpu_seconds
from .common import OURS_ETCD_V3, Series, ratio_summary, say
from .workers import NodeGroup, Pool, WorkerError, assign, go_together

log = logging.getLogger(__name__)

NODES_PER_JOB = 8
#: Of the CLI phase's runs, one in this many is left open (its node leaves, nobody closes it).
LEFT_OPEN_EVERY = 10
KEEPALIVE_METRIC = "grpc_server_msg_received_total"
CLI_TIMEOUT_S = 300.0  # the commands' --timeout (their default is 10 s: see "within_default_timeout")
CLI_DEFAULT_TIMEOUT_S = 10.0


# --------------------------------------------------------------------------- etcd counters


def metric_sum(text: str, name: str, labels: dict[str, str]) -> float:
    """Sum of the samples of metric ``name`` in a Prometheus text page whose labels include
    ``labels`` (0.0 when there is none)."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] != name or not all(w in head for w in wanted):
            continue
        try:
            total += float(value)
        except ValueError:
            log.debug("unparsable metric line %r", line)
    return total


def cluster_counters(cluster: Any) -> dict[str, float]:
    """Keep-alive requests received (all members), revision, raft index, live leases and
    the members' CPU seconds, read over HTTP (no RPC of the clients being measured)."""
    from etcd_server.gateway import Gateway

    keepalives = 0.0
    leader_changes = 0.0
    for url in cluster.client_urls:
        _status, body = Gateway(url).get("/metrics", timeout=10)
        text = body.decode()
        keepalives += metric_sum(text, KEEPALIVE_METRIC, {"grpc_method": "LeaseKeepAlive"})
        leader_changes = max(leader_changes, metric_sum(text, "etcd_server_leader_changes_seen_total", {}))
    gw = Gateway(cluster.client_urls[0])
    status = gw.call("/v3/maintenance/status", {}, timeout=10)
    leases = gw.call("/v3/lease/leases", {}, timeout=30).get("leases", [])
    cpu = [etcd_cpu_seconds(pid) for pid in cluster.pids]
    return {
        "time": time.monotonic(),
        "keepalives": keepalives,
        "revision": float(status["header"]["revision"]),
        "raft_index": float(status.get("raftIndex", 0)),
        "leases": float(len(leases)),
        "leader_changes": leader_changes,
        "cpu_s": sum(c for c in cpu if c is not None),
    }


_DELTAS = ("revision", "raft_index", "keepalives", "cpu_s", "workers_cpu_s", "time", "leader_changes")


def _cpu(pids: list[int | None]) -> float:
    return sum(c for c in (etcd_cpu_seconds(p) for p in pids) if c is not None)


def _threads(pid: int | None) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration, ValueError, TypeError):
        return None


# --------------------------------------------------------------------------- jobs


def _endpoints(cluster: Any, k: int) -> str:
    eps = list(cluster.endpoints)
    k %= len(eps)
    return ",".join(eps[k:] + eps[:k])


def create_jobs(pool: Pool, cluster: Any, count: int, nodes: int, workers: int, timeout: float,
                conf: dict[str, Any]) -> list[NodeGroup]:
    """``count`` etcd-v3 jobs of ``nodes`` nodes each, built (untimed) in the first ``workers``
    workers. Raises WorkerError naming the first node that could not be built (the jobs
    built so far are closed)."""
    layout = pool.workers[: max(1, min(workers, nodes))]
    groups: list[NodeGroup] = []
    try:
        for k in range(count):
            run_id = f"b6-{count}x{nodes}-{k}-{uuid.uuid4().hex[:6]}"
            group = NodeGroup(run_id, assign(list(range(nodes)), layout))
            groups.append(group)
            kind, spec = handler_spec(OURS_ETCD_V3, _endpoints(cluster, k), "", run_id, nodes, nodes, conf,
                                      clients="process")
            errors = group.create(kind, spec, timeout)
            if errors:
                raise WorkerError(f"job {run_id}: {len(errors)} node(s) not built: {next(iter(errors.values()))}")
    except BaseException:
        close_jobs(groups)
        raise
    return groups


def rendezvous_together(groups: list[NodeGroup], nodes: int, timeout: float) -> tuple[list[float], list[str]]:
    """Arm every job, release them at once, collect: (seconds per finished job, errors)."""
    for g in groups:
        g.arm("rendezvous")
    t0 = go_together(groups)
    times: list[float] = []
    errors: list[str] = []
    for g in groups:
        run = g.collect(t0, timeout)
        err = validate(run, nodes)
        if err is None and run.elapsed is not None:
            times.append(run.elapsed)
        else:
            errors.append(f"{g.name}: {err}")
    return times, errors


def close_jobs(groups: list[NodeGroup]) -> None:
    for g in groups:
        g.close()


# --------------------------------------------------------------------------- phases


def _measure_rounds(pool: Pool, cluster: Any, jobs: list[int], reps: int, solo_rounds: int, nodes: int,
                    workers: int, timeout: float, conf: dict[str, Any]
                    ) -> tuple[dict[int, Series], dict[int, list[str]], dict[int, list[dict[str, float]]],
                               list[NodeGroup], int]:
    """Every J of ``jobs`` in every run; returns the series, errors, etcd deltas per round, the
    still-running jobs of the last round of the largest J (the caller closes them) and how
    many of those failed their rendezvous."""
    series = {j: Series() for j in jobs}
    errors: dict[int, list[str]] = {j: [] for j in jobs}
    deltas: dict[int, list[dict[str, float]]] = {j: [] for j in jobs}
    biggest = max(jobs)
    kept: list[NodeGroup] = []
    kept_failed = 0
    for rep in range(reps):
        k = rep % len(jobs)
        order = jobs[k:] + jobs[:k]  # the rotation of benchmarks.common.rotated
        for j in order:
            samples: list[float] = []
            for _ in range(solo_rounds if j == 1 and biggest > 1 else 1):
                try:
                    groups = create_jobs(pool, cluster, j, nodes, workers, timeout, conf)
                except WorkerError as e:
                    errors[j].append(f"creating {j} job(s): {e}")
                    continue
                keep = rep == reps - 1 and j == biggest
                pids = [w.proc.pid for w in pool.workers[:workers]]
                try:
                    before = {**cluster_counters(cluster), "workers_cpu_s": _cpu(pids)}
                    times, errs = rendezvous_together(groups, nodes, timeout)
                    after = {**cluster_counters(cluster), "workers_cpu_s": _cpu(pids)}
                finally:
                    if not keep:
                        close_jobs(groups)
                if keep:
                    kept = groups
                    kept_failed = len(errs)
                samples += times
                errors[j] += errs
                deltas[j].append({k: after[k] - before[k] for k in _DELTAS})
            series[j].add_run(samples)
            med = statistics.median(samples) * 1000 if samples else float("nan")
            say(f"B6 run {rep} J={j}: {len(samples)} job(s), median {med:.0f} ms, "
                f"max {max(samples, default=float('nan')) * 1000:.0f} ms, {len(errors[j])} failed so far")
    return series, errors, deltas, kept, kept_failed


def measure_idle(cluster: Any, pool: Pool, window: float, settle: float) -> dict[str, Any]:
    """The cluster's counters over ``window`` seconds while the running jobs idle."""
    threading.Event().wait(settle)  # trailing writes of the round
    c0 = cluster_counters(cluster)
    say(f"B6 idle window of {window:g} s ({c0['leases']:.0f} live leases)")
    threading.Event().wait(window)
    c1 = cluster_counters(cluster)
    secs = c1["time"] - c0["time"]
    return {
        "window_s": round(secs, 2),
        "keepalives_per_s": (c1["keepalives"] - c0["keepalives"]) / secs,
        "revisions_per_min": (c1["revision"] - c0["revision"]) * 60.0 / secs,
        "raft_entries_per_min": (c1["raft_index"] - c0["raft_index"]) * 60.0 / secs,
        "leases": int(c1["leases"]),
        "etcd_cpu_pct": 100.0 * (c1["cpu_s"] - c0["cpu_s"]) / secs,
        "worker_threads": [_threads(w.proc.pid) for w in pool.workers],
    }


def make_finished_runs(cluster: Any, count: int, threads: int = 16) -> dict[str, Any]:
    """``count`` 1-node etcd-v3 jobs that rendezvous and end: most close their run
    (``shutdown()``, as torchrun at the end of a job), one in :data:`LEFT_OPEN_EVERY`
    only leaves it (``leave()``). Returns counts, errors and the seconds it took."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from etcd_rdzv.conf import parse_v3_settings
    from etcd_store.client import EtcdClient

    from .nodes import ours_creator

    creator, _how = ours_creator("etcd-v3")
    tag = uuid.uuid4().hex[:6]

    def params(i: int) -> Any:
        return RendezvousParameters(backend="etcd-v3", endpoint=cluster.endpoint_string,
                                    run_id=f"b6-done-{tag}-{i:05d}", min_nodes=1, max_nodes=1,
                                    local_addr="127.0.0.1")

    client = EtcdClient.from_options(parse_v3_settings(params(0))[1])

    def one(i: int) -> str | None:
        try:
            handler = creator(params(i), client=client)
            handler.next_rendezvous()
            if i % LEFT_OPEN_EVERY == LEFT_OPEN_EVERY - 1:
                handler.leave()
            elif not handler.shutdown():
                return f"run {i}: shutdown() could not close it"
            return None
        except Exception as e:  # reported, the phase goes on
            return f"run {i}: {type(e).__name__}: {e}"

    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(threads) as ex:
            errors = [e for e in ex.map(one, range(count)) if e]
    finally:
        client.close()
    left = sum(1 for i in range(count) if i % LEFT_OPEN_EVERY == LEFT_OPEN_EVERY - 1)
    return {"runs": count, "closed": count - left, "left_open": left, "errors": errors[:5],
            "failed": len(errors), "seconds": round(time.monotonic() - t0, 2)}


def time_cli(cluster: Any, args: list[str], timeout: float = CLI_TIMEOUT_S) -> dict[str, Any]:
    """One ``etcd-rdzv`` command as a subprocess: wall seconds, exit code, parsed --json output."""
    cmd = [sys.executable, "-m", "etcd_rdzv", "--endpoints", cluster.endpoint_string,
           "--timeout", f"{timeout:g}", *args]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return {"args": args, "seconds": None, "rc": None, "error": f"no exit within {timeout + 60:g} s"}
    secs = time.monotonic() - t0
    out: dict[str, Any] = {"args": args, "seconds": round(secs, 3), "rc": proc.returncode,
                           "within_default_timeout": secs < CLI_DEFAULT_TIMEOUT_S}
    if proc.returncode != 0:
        out["error"] = (proc.stderr.strip() or proc.stdout.strip())[-300:]
    elif "--json" in args:
        try:
            out["json"] = json.loads(proc.stdout)
        except ValueError:
            out["error"] = f"not JSON: {proc.stdout[:200]!r}"
    return out


def measure_cli(cluster: Any, runs: int, live_jobs: int, ended_jobs: int = 0, unsure: int = 0) -> dict[str, Any]:
    """Make ``runs`` finished runs, then time list / gc --dry-run / gc / list. ``live_jobs``
    still run, ``ended_jobs`` (closed) are there from before: both are listed too; ``unsure``
    running jobs failed their rendezvous (their runs may be closed or open): the expected
    counts allow for either."""
    say(f"B6 making {runs} finished runs (1-node jobs) beside {live_jobs} running jobs")
    made = make_finished_runs(cluster, runs)
    say(f"B6 {made['runs']} runs made in {made['seconds']:g} s ({made['failed']} failed)")
    steps = [("startup", ["--key-prefix", "/b6-empty-prefix", "list"]), ("list", ["list", "--json"]),
             ("gc_dry_run", ["gc", "--dry-run", "--json"]), ("gc", ["gc", "--json"]),
             ("list_after_gc", ["list", "--json"])]
    timed: dict[str, Any] = {}
    for name, args in steps:
        res = time_cli(cluster, args)
        doc = res.pop("json", None) or {}
        if "runs" in doc:
            res["runs_listed"] = len(doc["runs"])
        if "removed" in doc:
            res["runs_removed"] = len(doc["removed"])
        timed[name] = res
        say(f"B6 etcd-rdzv {' '.join(args)}: {res['seconds']} s, rc {res['rc']}"
            + (f", {res.get('runs_listed', res.get('runs_removed'))} runs" if doc else "")
            + (f", {res['error']}" if res.get("error") else ""))
    return {"made": made, "commands": timed, "live_jobs": live_jobs,
            "ended_jobs": ended_jobs, "unsure_jobs": unsure,
            "expected": {"listed": live_jobs + unsure + ended_jobs + runs - made["failed"],
                         "removed": ended_jobs + made["closed"],
                         "listed_after_gc": live_jobs + made["left_open"]}}


def run_b6(pool: Pool, binary: str | None, jobs: list[int], reps: int, solo_rounds: int, window: float,
           cli_runs: int, timeout: float, workers: int, nodes: int = NODES_PER_JOB, settle: float = 2.0,
           conf: dict[str, Any] | None = None) -> dict[str, Any]:
    """Measure B6 on a fresh 3-member cluster of ``binary``; returns the B6 section."""
    from etcd_server import EtcdCluster

    conf = dict(conf or {})
    conf.setdefault("join_timeout", str(int(timeout)))
    jobs = sorted(set(jobs))
    out: dict[str, Any] = {"jobs": jobs, "nodes_per_job": nodes, "reps": reps, "solo_rounds": solo_rounds,
                           "workers": workers, "window_s": window, "cli_runs": cli_runs, "conf": conf,
                           "members": 3, "idle": None, "cli": None}
    with EtcdCluster(3, binary) as cluster:
        out["etcd_version"] = cluster.version
        series, errors, deltas, kept, kept_failed = _measure_rounds(pool, cluster, jobs, reps, solo_rounds, nodes,
                                                       workers, timeout, conf)
        try:
            if kept:
                out["idle"] = measure_idle(cluster, pool, window, settle)
                say(f"B6 idle J={len(kept)}: {out['idle']}")
            if cli_runs > 0:
                # The rounds' other jobs closed their runs (so may a job that failed its rendezvous).
                ended = sum(j * len(deltas[j]) for j in jobs) - len(kept)
                out["cli"] = measure_cli(cluster, cli_runs, len(kept) - kept_failed, ended, kept_failed)
        finally:
            close_jobs(kept)
    out["rows"] = [_row(j, series, errors, deltas) for j in jobs]
    if len(jobs) > 1:
        out["ratio"] = ratio_summary(series[max(jobs)], series[min(jobs)])
    return out


def _row(j: int, series: dict[int, Series], errors: dict[int, list[str]],
         deltas: dict[int, list[dict[str, float]]]) -> dict[str, Any]:
    d = deltas[j]
    per_job = [x["revision"] / j for x in d]
    def med(key: str, per: float = 1.0) -> float | None:
        return statistics.median(x[key] / per for x in d) if d else None

    return {"jobs": j, "ms": series[j].summary(scale=1000.0), "failed_jobs": len(errors[j]),
            "failures": errors[j][:3], "rounds": len(d),
            "revisions_per_job": statistics.median(per_job) if per_job else None,
            "raft_entries_per_job": med("raft_index", j),
            # CPU seconds of the etcd members and of the worker processes over one round (the
            # counter reads around it included), and its wall seconds: where a round's time goes.
            "etcd_cpu_s": med("cpu_s"), "workers_cpu_s": med("workers_cpu_s"), "round_wall_s": med("time"),
            "leader_changes": sum(x["leader_changes"] for x in d)}


# --------------------------------------------------------------------------- report


def markdown_lines(b6: dict[str, Any]) -> list[str]:
    """The B6 section of results.md (tables of the three phases)."""
    from .figures import fig, fmt, ratio

    rows = [[str(r["jobs"]), fig(r["ms"]), fmt(r["ms"]["p99"]), str(r["ms"]["n"]), str(r["failed_jobs"]),
             fmt(r["revisions_per_job"], 1), fmt(r["raft_entries_per_job"], 1),
             f"{fmt(r.get('etcd_cpu_s'), 2)} / {fmt(r.get('workers_cpu_s'), 2)} / {fmt(r.get('round_wall_s'), 2)}",
             fmt(r.get("leader_changes"))]
            for r in b6["rows"]]
    parts = [
        f"## B6: many etcd-v3 jobs of {b6['nodes_per_job']} nodes on one {b6['members']}-member etcd cluster",
        "",
        _table(["jobs J", "per-job rendezvous ms, median (run range)", "p99 ms", "jobs measured", "failed",
                "revisions per job", "raft entries per job", "CPU s etcd / workers / wall s per round",
                "etcd leader changes"], rows),
        "",
        f"J = {max(b6['jobs'])} against J = 1: {ratio(b6.get('ratio'))} (median of the per-run ratios). "
        f"{b6['reps']} run(s); J = 1 repeated {b6['solo_rounds']} times per run; the nodes of every job spread "
        f"over {b6['workers']} worker processes, the nodes of one job in one worker share an etcd client. "
        f"etcd {b6.get('etcd_version')}, conf {b6['conf']}.",
        "",
    ]
    idle = b6.get("idle")
    if idle:
        parts += [
            f"While the {max(b6['jobs'])} jobs idle ({idle['window_s']:g} s): "
            f"**{idle['keepalives_per_s']:.1f} keep-alive requests/s** (all members), "
            f"**{idle['leases']} live leases**, **{idle['revisions_per_min']:.1f} revisions/min**, "
            f"{idle['raft_entries_per_min']:.1f} raft entries/min, etcd CPU {idle['etcd_cpu_pct']:.1f} % of a core "
            f"(3 members together); worker threads {idle['worker_threads']}.",
            "",
        ]
    cli = b6.get("cli")
    if cli:
        made = cli["made"]
        crow = [[f"`etcd-rdzv {' '.join(c['args'])}`", "—" if c.get("seconds") is None else f"{c['seconds']:.2f}",
                 str(c.get("rc")), str(c.get("runs_listed", c.get("runs_removed", ""))), c.get("error", "")[:80]]
                for c in cli["commands"].values()]
        parts += [
            f"CLI over {made['runs']:,} ended 1-node runs ({made['closed']} closed, {made['left_open']} left "
            f"open; made in {made['seconds']:g} s, {made['failed']} failed), {cli['ended_jobs']} closed runs of "
            f"the rounds above and {cli['live_jobs']} running jobs; each command a subprocess, the first on "
            f"an empty prefix (Python start-up and one Range). Expected: {cli['expected']}.",
            "",
            _table(["command", "seconds", "exit", "runs listed / removed", "error"], crow),
            "",
        ]
    return parts


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])
