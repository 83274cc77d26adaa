"""The targets of the issue: each with its figure and met / not met / not measured.

:func:`targets` reads a results dict (as :mod:`benchmarks.run` writes it) and
returns one entry per target; :mod:`benchmarks.report` renders them. Pure
functions, no I/O.
"""

from __future__ import annotations

from typing import Any

from .common import (
    C10D,
    FLOOR,
    FLOOR_BARRIER,
    OURS_ETCD_V2,
    OURS_ETCD_V3,
    OURS_STORE,
    TCP_STORE,
    TORCH_ETCD_V2,
    TORCH_V2_STORE,
)
from .figures import PRODUCTION_RERDZV_S, fig, fmt, ratio

__all__ = ["PRODUCTION_RERDZV_S", "fig", "fmt", "ratio", "targets"]

# B1 waits (issue 12): a blocked get wakes within 5 ms of the write (median) while another rank
# keeps writing; torch's store_util.barrier of 4 ranks under 15 ms.
B1_WAKE_MS = 5.0
B1_BARRIER_MS = 15.0
_B1_WAIT_TARGETS = {"wake_busy": ("within", B1_WAKE_MS), "barrier_4": ("under", B1_BARRIER_MS)}
# B2 targets (issue 12): etcd-v3 within 2x of the barrier floor at these N, and its growth
# from 1024 to 2048 nodes; N = 2 under 20 ms; watch events per waiting node.
B2_BARRIER_NS = (64, 256, 1024, 2048)
B2_BARRIER_RATIO = 2.0
B2_GROWTH = (1024, 2048, 2.5)
B2_N2_MS = 20.0
B2_EVENTS_PER_NODE = 3  # + the nodes that left; none leaves in B2
# B5 (issue 12): gloo start-up over EtcdStore at most 3x TCPStore's at world 16.
B5_WORLD, B5_RATIO = 16, 3.0
# B6 (issue 24): J concurrent jobs on one cluster: per-job rendezvous median within 2x of one job
# alone; 0 revisions while they idle. The CLI's own check: list and gc within its default --timeout.
B6_RATIO = 2.0
B6_CLI_TIMEOUT_S = 10.0


# --------------------------------------------------------------------------- targets


def _target(name: str, figure: str, met: bool | None, note: str = "", status: str | None = None) -> dict[str, Any]:
    if status is None:
        status = "met" if met else ("not met" if met is not None else "not measured")
    return {"target": name, "figure": figure, "status": status, "note": note}


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of the issue, with its figure and met / not met / not measured."""
    out: list[dict[str, Any]] = []
    b1 = results.get("b1")
    if b1:
        by = {(r["op"], r["contender"]): r for r in b1["rows"]}
        for op in b1["ops"]:
            label = b1["labels"][op]
            ours = by.get((op, OURS_STORE))
            if op in _B1_WAIT_TARGETS:
                word, limit = _B1_WAIT_TARGETS[op]
                name = f"B1 {label}: EtcdStore {word} {limit:g} ms (median)"
                if ours is None or ours.get("na") or ours["us"]["median"] is None:
                    out.append(_target(name, "—", None, (ours or {}).get("na", "")))
                    continue
                ms = ours["us"]["median"] / 1000.0
                tcp = by.get((op, TCP_STORE))
                note = (f"TCPStore {tcp['us']['median'] / 1000.0:.2f} ms"
                        if tcp and not tcp.get("na") and tcp["us"]["median"] is not None else "")
                out.append(_target(name, f"{ms:.2f} ms", ms < limit if word == "under" else ms <= limit, note))
                continue
            if ours is None or ours.get("na") or ours["us"]["median"] is None:
                out.append(_target(f"B1 {label}: EtcdStore ≤ 1.2× floor", "—", None,
                                   (ours or {}).get("na", "")))
                continue
            r = ours.get(f"ratio_vs_{FLOOR}")
            out.append(_target(f"B1 {label}: EtcdStore ≤ 1.2× floor", ratio(r),
                               None if r is None else r["ratio"] <= 1.2,
                               f"{fmt(ours['us']['median'])} µs vs {fmt(by[(op, FLOOR)]['us']['median'])} µs"
                               if (op, FLOOR) in by else ""))
        for op in b1["ops"]:
            label = b1["labels"][op]
            ours = by.get((op, OURS_STORE))
            torch_row = by.get((op, TORCH_V2_STORE))
            if torch_row is None or ours is None or op in _B1_WAIT_TARGETS:
                continue
            if torch_row.get("na"):
                out.append(_target(f"B1 {label}: EtcdStore faster than torch's v2 EtcdStore", "—", None,
                               "torch's v2 EtcdStore does not implement it", status="n/a"))
                continue
            r = ours.get(f"ratio_vs_{TORCH_V2_STORE}")
            out.append(_target(f"B1 {label}: EtcdStore faster than torch's v2 EtcdStore", ratio(r),
                               None if r is None else r["ratio"] < 1.0))
    b2 = results.get("b2")
    if b2:
        by2 = {(r["n"], r["contender"]): r for r in b2["rows"]}
        for n in b2["ns"]:
            row = by2.get((n, OURS_ETCD_V2))
            if row is None or n > 64:
                continue
            r = row.get(f"ratio_vs_{C10D}")
            out.append(_target(f"B2 N={n}: etcd-v2 within 1.2× of c10d", ratio(r),
                               None if r is None else r["ratio"] <= 1.2))
        for n in b2["ns"]:
            row = by2.get((n, OURS_ETCD_V2))
            if row is None or row.get("skipped"):
                continue
            r = row.get(f"ratio_vs_{TORCH_ETCD_V2}")
            out.append(_target(f"B2 N={n}: etcd-v2 faster than torch's etcd-v2", ratio(r),
                               None if r is None else r["ratio"] < 1.0))
        row = by2.get((64, OURS_ETCD_V3))
        if row is not None:
            r = row.get(f"ratio_vs_{FLOOR}")
            out.append(_target("B2 N=64: etcd-v3 within 2× of the floor", ratio(r),
                               None if r is None else r["ratio"] <= 2.0,
                               f"{fig(row['ms'], ' ms')} vs floor {fig(by2.get((64, FLOOR), {}).get('ms'), ' ms')}"))
        else:
            out.append(_target("B2 N=64: etcd-v3 within 2× of the floor", "—", None,
                               "N=64 not in this mode's N list"))
        out += _b2_v3_targets(b2, by2)
        row = by2.get((512, OURS_ETCD_V3))
        cores = results.get("machine", {}).get("cores", 0)
        if row is not None and row["ms"]["median"] is not None:
            med = row["ms"]["median"]
            out.append(_target(f"B2 N=512: etcd-v3 under 1 s on 16 cores (this machine: {cores} cores)",
                               fig(row["ms"], " ms"), med < 1000 if cores >= 16 else None,
                               "" if cores >= 16 else "measured on fewer than 16 cores: indicative only"))
        else:
            out.append(_target("B2 N=512: etcd-v3 under 1 s on 16 cores", "—", None,
                               "run `python -m benchmarks.run --scale` on a 16-core machine"))
    for b3 in results.get("b3") or []:
        st = b3["settings"]
        setting = (f"dead after {st['dead_after_s']:g} s (keep_alive_interval {st['keep_alive_interval']} × "
                   f"max_attempt {st['keep_alive_max_attempt']}), last_call_timeout {st['last_call_timeout']} s, "
                   f"min {st['min_nodes']} / max {st['max_nodes']}, "
                   f"{'defaults' if st['defaults'] else 'NOT the defaults'}")
        for row in b3["rows"]:
            if row["contender"] not in (OURS_ETCD_V2, OURS_ETCD_V3):
                continue
            med = row["s"]["median"]
            met = None if med is None else med < PRODUCTION_RERDZV_S / 2
            note = setting
            if row["contender"] == OURS_ETCD_V3 and st.get("fast_recovery"):
                note += "; etcd-v3 fast_recovery on (no last call when the round only re-forms the group)"
            out.append(_target(f"B3 {b3.get('name', b3['scenario'])} N={b3['n']}: {row['contender']} "
                               f"re-rendezvous well under {PRODUCTION_RERDZV_S} s (met: < half of it, "
                               f"settings stated)", fig(row["s"], " s", 2), met, note))
    b4 = results.get("b4")
    if b4:
        for row in b4["rows"]:
            if row["contender"] != OURS_ETCD_V3:
                continue
            if row.get("error"):
                out.append(_target(f"B4 N={row['n']}: etcd-v3 idle job makes 0 revisions/min", "failed",
                                   False, row["error"][:100]))
                continue
            others = [r for r in b4["rows"] if r["n"] == row["n"] and r["contender"] in (OURS_ETCD_V2, TORCH_ETCD_V2)
                      and r.get("revisions_per_min") is not None]
            beside = "; ".join(f"{r['contender']}: {r['revisions_per_min']:.0f}/min" for r in others)
            out.append(_target(f"B4 N={row['n']}: etcd-v3 idle job makes 0 revisions/min",
                               f"{row['revisions_per_min']:.1f}/min", row["revisions_per_min"] == 0, beside))
    b5 = results.get("b5")
    if b5:
        name = f"B5 world={B5_WORLD}: gloo start-up over EtcdStore at most {B5_RATIO:g}× TCPStore's"
        row5 = next((r for r in b5["rows"] if r["world"] == B5_WORLD and r["contender"] == OURS_STORE), None)
        r5 = (row5 or {}).get("ratio_vs_TCPStore")
        if row5 is None or not r5 or r5.get("ratio") is None:
            out.append(_target(name, "—", None, f"world {B5_WORLD} (or TCPStore) not in this run"))
        else:
            tcp = next(r for r in b5["rows"] if r["world"] == B5_WORLD and r["contender"] == TCP_STORE)
            out.append(_target(name, ratio(r5), r5["ratio"] <= B5_RATIO,
                               f"{fig(row5['ms'], ' ms')} vs {fig(tcp['ms'], ' ms')}"))
    if results.get("b6"):
        out += _b6_targets(results["b6"])
    if results.get("b3t"):
        from .b3_torchrun_report import targets as b3t_targets

        out += b3t_targets(results["b3t"])
    return out


def _b6_targets(b6: dict[str, Any]) -> list[dict[str, Any]]:
    """Many jobs against one alone, their idle revisions, and list / gc over many runs."""
    out: list[dict[str, Any]] = []
    rows = {r["jobs"]: r for r in b6["rows"]}
    big, n = max(b6["jobs"]), b6["nodes_per_job"]
    name = f"B6 J={big}×{n} nodes: per-job rendezvous median within {B6_RATIO:g}× of one job alone"
    r, solo, many = b6.get("ratio"), rows.get(1), rows[big]
    if big == 1 or solo is None:
        out.append(_target(name, "—", None, "J=1 and a larger J not both in this run"))
    elif many["failed_jobs"] or r is None:
        out.append(_target(name, ratio(r), False, f"{many['failed_jobs']} job(s) failed: "
                                                   f"{(many['failures'] or ['?'])[0][:100]}"))
    else:
        p99 = many["ms"]["p99"]
        out.append(_target(name, ratio(r), r["ratio"] <= B6_RATIO,
                           f"J={big}: {fig(many['ms'], ' ms')}, p99 {fmt(p99)} ms; J=1: {fig(solo['ms'], ' ms')}"))
    idle = b6.get("idle")
    name = f"B6 J={big} idle jobs: 0 etcd revisions/min"
    if not idle:
        out.append(_target(name, "—", None, "no idle window in this run"))
    else:
        out.append(_target(name, f"{idle['revisions_per_min']:.1f}/min", idle["revisions_per_min"] == 0,
                           f"{idle['keepalives_per_s']:.1f} keep-alives/s, {idle['leases']} live leases, "
                           f"{idle['raft_entries_per_min']:.1f} raft entries/min over {idle['window_s']:g} s"))
    out += _b6_cli_targets(b6.get("cli"))
    return out


def _b6_cli_targets(cli: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not cli:
        return [_target("B6 etcd-rdzv list and gc over many runs", "—", None, "no CLI phase in this run")]
    cmds, want = cli["commands"], cli["expected"]
    runs = cli["made"]["runs"]
    out = []
    for key, label, count, expected in (("list", "list", "runs_listed", want["listed"]),
                                        ("gc", "gc", "runs_removed", want["removed"])):
        c = cmds.get(key) or {}
        name = (f"B6 etcd-rdzv {label} over {runs:,} ended runs (+{cli['live_jobs']} running jobs) within "
                f"its default --timeout ({B6_CLI_TIMEOUT_S:g} s), {count.split('_')[1]} all of them")
        if c.get("seconds") is None or c.get("rc") != 0:
            out.append(_target(name, "failed", False, str(c.get("error", "no result"))[:100]))
            continue
        got, slack = c.get(count), cli.get("unsure_jobs", 0)  # failed jobs' runs: closed or open
        note = f"{got} {count.split('_')[1]} (expected {expected}"
        note += f" + up to {slack} failed jobs); " if slack else "); "
        if key == "gc":
            after = (cmds.get("list_after_gc") or {}).get("runs_listed")
            note += f"then {after} listed (expected {want['listed_after_gc']}); "
        note += f"start-up alone {cmds['startup']['seconds']:.2f} s"
        ok = got is not None and expected <= got <= expected + slack
        out.append(_target(name, f"{c['seconds']:.2f} s", c["seconds"] < B6_CLI_TIMEOUT_S and ok, note))
    return out


def _b2_v3_targets(b2: dict[str, Any], by2: dict[tuple[int, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """etcd-v3 against the barrier floor, its growth 1024 -> 2048, N = 2, watch events per node."""
    out: list[dict[str, Any]] = []

    def unfinished(row: dict[str, Any]) -> str | None:
        if row.get("did_not_finish") is not None:
            return f"did not finish in {row['did_not_finish']:g} s"
        if row.get("skipped"):
            return str(row["skipped"])
        if row["ms"]["median"] is None:
            return f"failed: {(row.get('failures') or ['?'])[0][:100]}"
        return None

    for n in B2_BARRIER_NS:
        name = f"B2 N={n}: etcd-v3 within {B2_BARRIER_RATIO:g}× of the barrier floor"
        row, base = by2.get((n, OURS_ETCD_V3)), by2.get((n, FLOOR_BARRIER))
        if row is None or base is None:
            out.append(_target(name, "—", None, f"N={n} (or the barrier floor) not in this run"))
            continue
        why = unfinished(row)
        if why:
            out.append(_target(name, "—", False, why))
            continue
        r = row.get(f"ratio_vs_{FLOOR_BARRIER}")
        out.append(_target(name, ratio(r), None if r is None else r["ratio"] <= B2_BARRIER_RATIO,
                           f"{fig(row['ms'], ' ms')} vs barrier floor {fig(base['ms'], ' ms')}"))
    lo_n, hi_n, limit = B2_GROWTH
    name = f"B2 N={lo_n}→{hi_n}: etcd-v3 time grows at most {limit:g}×"
    lo_row, hi_row = by2.get((lo_n, OURS_ETCD_V3)), by2.get((hi_n, OURS_ETCD_V3))
    if lo_row is None or hi_row is None:
        out.append(_target(name, "—", None, f"N={lo_n} and N={hi_n} not both in this run"))
    elif unfinished(lo_row) or unfinished(hi_row):
        out.append(_target(name, "—", False, "; ".join(f"N={r['n']}: {unfinished(r)}" for r in (lo_row, hi_row)
                                                       if unfinished(r))))
    else:
        growth = hi_row["ms"]["median"] / lo_row["ms"]["median"]
        floor_lo, floor_hi = by2.get((lo_n, FLOOR_BARRIER)), by2.get((hi_n, FLOOR_BARRIER))
        note = f"{fmt(lo_row['ms']['median'])} → {fmt(hi_row['ms']['median'])} ms"
        if floor_lo and floor_hi and floor_lo["ms"]["median"] and floor_hi["ms"]["median"]:
            note += f"; barrier floor {floor_hi['ms']['median'] / floor_lo['ms']['median']:.2f}×"
        out.append(_target(name, f"{growth:.2f}×", growth <= limit, note))
    row = by2.get((2, OURS_ETCD_V3))
    name = f"B2 N=2: etcd-v3 under {B2_N2_MS:g} ms"
    if row is None:
        out.append(_target(name, "—", None, "N=2 not in this run"))
    else:
        why = unfinished(row)
        med = row["ms"]["median"]
        out.append(_target(name, fig(row["ms"], " ms"), False if why else med < B2_N2_MS, why or ""))
    for n in b2["ns"]:
        row = by2.get((n, OURS_ETCD_V3))
        if row is None:
            continue
        name = (f"B2 N={n}: etcd-v3 watch events per waiting node ≤ {B2_EVENTS_PER_NODE} "
                f"(+ nodes that left: none)")
        w = row.get("watch")
        if not w:
            out.append(_target(name, "—", None, unfinished(row) or "no watch counts"))
            continue
        out.append(_target(name, f"mean {w['events_mean']:,.1f}, max {w['events_max']:,.0f}",
                           w["events_max"] <= B2_EVENTS_PER_NODE,
                           f"bytes/node mean {w['bytes_mean']:,.0f}, max {w['bytes_max']:,.0f}; "
                           f"over {w['rounds']} round(s), every node counted"))
    return out
