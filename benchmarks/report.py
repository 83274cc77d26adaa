"""Turn a results dict into the targets table, a markdown report and PNG plots.

``python -m benchmarks.report benchmarks/results/<dir>/results.json`` rebuilds
``results.md`` and the plots from a saved JSON (no measurement).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from .common import (
    C10D,
    DESCRIPTIONS,
    FLOOR,
    FLOOR_BARRIER,
    OURS_ETCD_V2,
    OURS_ETCD_V3,
    OURS_STORE,
    TCP_STORE,
    TORCH_ETCD_V2,
    TORCH_V2_STORE,
)

log = logging.getLogger(__name__)

PRODUCTION_RERDZV_S = 14.5
COLORS = {
    OURS_STORE: "tab:blue", OURS_ETCD_V2: "tab:blue", OURS_ETCD_V3: "tab:green",
    TORCH_V2_STORE: "tab:orange", TORCH_ETCD_V2: "tab:orange",
    TCP_STORE: "tab:gray", C10D: "tab:gray", FLOOR: "black", FLOOR_BARRIER: "tab:purple",
}
# B2 targets (issue 12): etcd-v3 within 2x of the barrier floor at these N, and its growth
# from 1024 to 2048 nodes; N = 2 under 20 ms; watch events per waiting node.
B2_BARRIER_NS = (64, 256, 1024, 2048)
B2_BARRIER_RATIO = 2.0
B2_GROWTH = (1024, 2048, 2.5)
B2_N2_MS = 20.0
B2_EVENTS_PER_NODE = 3  # + the nodes that left; none leaves in B2


# --------------------------------------------------------------------------- formatting


def _fmt(x: float | None, digits: int = 0) -> str:
    if x is None:
        return "—"
    if abs(x) >= 100 or digits == 0:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def _fig(s: dict[str, Any] | None, unit: str = "", digits: int = 0) -> str:
    """``median (lo–hi)``."""
    if not s or s.get("median") is None:
        return "—"
    med, lo, hi = s["median"], s.get("lo"), s.get("hi")
    spread = f" ({_fmt(lo, digits)}–{_fmt(hi, digits)})" if s.get("runs", 0) > 1 else ""
    return f"{_fmt(med, digits)}{unit}{spread}"


def _ratio(r: dict[str, Any] | None) -> str:
    if not r:
        return "—"
    spread = f" ({r['lo']:.2f}–{r['hi']:.2f})" if r.get("runs", 0) > 1 else ""
    return f"{r['ratio']:.2f}×{spread}"


def _b2_cell(r: dict[str, Any] | None) -> str:
    """A B2 figure, or why there is none (did not finish in its box, not run)."""
    if r is None:
        return "—"
    if r.get("did_not_finish") is not None:
        return f"did not finish in {r['did_not_finish']:g} s"
    if r.get("skipped"):
        return r["skipped"]
    cell = _fig(r["ms"])
    if r.get("failed_runs"):
        cell += f" ({r['failed_runs']} failed)"
    return cell


def _events(w: dict[str, Any] | None) -> str:
    if not w:
        return "n/a"
    return f"{w['events_mean']:,.1f} / {w['events_max']:,.0f}"


def _bytes(w: dict[str, Any] | None) -> str:
    if not w:
        return "n/a"
    return f"{w['bytes_mean']:,.0f} / {w['bytes_max']:,.0f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


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
            if ours is None or ours.get("na") or ours["us"]["median"] is None:
                out.append(_target(f"B1 {label}: EtcdStore ≤ 1.2× floor", "—", None,
                                   (ours or {}).get("na", "")))
                continue
            r = ours.get(f"ratio_vs_{FLOOR}")
            out.append(_target(f"B1 {label}: EtcdStore ≤ 1.2× floor", _ratio(r),
                               None if r is None else r["ratio"] <= 1.2,
                               f"{_fmt(ours['us']['median'])} µs vs {_fmt(by[(op, FLOOR)]['us']['median'])} µs"
                               if (op, FLOOR) in by else ""))
        for op in b1["ops"]:
            label = b1["labels"][op]
            ours = by.get((op, OURS_STORE))
            torch_row = by.get((op, TORCH_V2_STORE))
            if torch_row is None or ours is None:
                continue
            if torch_row.get("na"):
                out.append(_target(f"B1 {label}: EtcdStore faster than torch's v2 EtcdStore", "—", None,
                               "torch's v2 EtcdStore does not implement it", status="n/a"))
                continue
            r = ours.get(f"ratio_vs_{TORCH_V2_STORE}")
            out.append(_target(f"B1 {label}: EtcdStore faster than torch's v2 EtcdStore", _ratio(r),
                               None if r is None else r["ratio"] < 1.0))
    b2 = results.get("b2")
    if b2:
        by2 = {(r["n"], r["contender"]): r for r in b2["rows"]}
        for n in b2["ns"]:
            row = by2.get((n, OURS_ETCD_V2))
            if row is None or n > 64:
                continue
            r = row.get(f"ratio_vs_{C10D}")
            out.append(_target(f"B2 N={n}: etcd-v2 within 1.2× of c10d", _ratio(r),
                               None if r is None else r["ratio"] <= 1.2))
        for n in b2["ns"]:
            row = by2.get((n, OURS_ETCD_V2))
            if row is None or row.get("skipped"):
                continue
            r = row.get(f"ratio_vs_{TORCH_ETCD_V2}")
            out.append(_target(f"B2 N={n}: etcd-v2 faster than torch's etcd-v2", _ratio(r),
                               None if r is None else r["ratio"] < 1.0))
        row = by2.get((64, OURS_ETCD_V3))
        if row is not None:
            r = row.get(f"ratio_vs_{FLOOR}")
            out.append(_target("B2 N=64: etcd-v3 within 2× of the floor", _ratio(r),
                               None if r is None else r["ratio"] <= 2.0,
                               f"{_fig(row['ms'], ' ms')} vs floor {_fig(by2.get((64, FLOOR), {}).get('ms'), ' ms')}"))
        else:
            out.append(_target("B2 N=64: etcd-v3 within 2× of the floor", "—", None,
                               "N=64 not in this mode's N list"))
        out += _b2_v3_targets(b2, by2)
        row = by2.get((512, OURS_ETCD_V3))
        cores = results.get("machine", {}).get("cores", 0)
        if row is not None and row["ms"]["median"] is not None:
            med = row["ms"]["median"]
            out.append(_target(f"B2 N=512: etcd-v3 under 1 s on 16 cores (this machine: {cores} cores)",
                               _fig(row["ms"], " ms"), med < 1000 if cores >= 16 else None,
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
                               f"settings stated)", _fig(row["s"], " s", 2), met, note))
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
        out.append(_target(name, _ratio(r), None if r is None else r["ratio"] <= B2_BARRIER_RATIO,
                           f"{_fig(row['ms'], ' ms')} vs barrier floor {_fig(base['ms'], ' ms')}"))
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
        note = f"{_fmt(lo_row['ms']['median'])} → {_fmt(hi_row['ms']['median'])} ms"
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
        out.append(_target(name, _fig(row["ms"], " ms"), False if why else med < B2_N2_MS, why or ""))
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


# --------------------------------------------------------------------------- markdown


def markdown(results: dict[str, Any]) -> str:
    m = results.get("machine", {})
    v = m.get("versions", {})
    parts = [
        f"# Benchmark results: {results.get('mode', '?')} mode",
        "",
        f"Machine: **{m.get('machine')}** ({m.get('cores')} usable cores, {m.get('memory_gib')} GiB, "
        f"{m.get('os')}); load average at start {m.get('loadavg_at_start')}, at end "
        f"{results.get('loadavg_at_end')}. Python {m.get('python')}, torch {v.get('torch')}, grpcio "
        f"{v.get('grpcio')}, protobuf {v.get('protobuf')}, python-etcd {v.get('python-etcd')}, etcd "
        f"{v.get('etcd')} (`{m.get('etcd_binary')}`), etcd-rdzv {v.get('etcd-rdzv')} at commit "
        f"{m.get('git_commit')}, {m.get('date_utc')}. Command: `{results.get('command')}`, "
        f"{results.get('wall_s', 0):.0f} s.",
        "",
        "Figures: median over all samples, in brackets the range of the per-run medians. Ratios: the "
        "median of per-run ratios (contenders alternate inside every run), range in brackets.",
        "",
    ]
    tg = results.get("targets") or targets(results)
    parts += ["## Targets", "", _table(["target", "figure", "status", "note"],
                                       [[t["target"], t["figure"], f"**{t['status']}**", t["note"]] for t in tg]), ""]
    skipped = results.get("skipped") or {}
    if skipped:
        parts += ["Contenders not measured: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()), ""]
    b1 = results.get("b1")
    if b1:
        cs = b1["contenders"]
        by = {(r["op"], r["contender"]): r for r in b1["rows"]}
        rows = []
        for op in b1["ops"]:
            line = [b1["labels"][op]]
            for c in cs:
                r = by[(op, c)]
                if r.get("na"):
                    line.append("n/a")
                else:
                    line.append(f"{_fig(r['us'])} / p99 {_fmt(r['us']['p99'])}")
            ours = by.get((op, OURS_STORE), {})
            line += [_ratio(ours.get(f"ratio_vs_{FLOOR}")), _ratio(ours.get(f"ratio_vs_{TORCH_V2_STORE}")),
                     _ratio(ours.get(f"ratio_vs_{TCP_STORE}"))]
            line.append(" / ".join(_fmt(by[(op, c)]["rpcs_per_op"], 2) if by[(op, c)]["rpcs_per_op"] is not None
                                   else "—" for c in cs))
            rows.append(line)
        parts += [
            "## B1: store operations (µs per call, one client)",
            "",
            _table(["operation"] + [f"{c} median (run range) / p99" for c in cs]
                   + ["EtcdStore / floor", "EtcdStore / torch v2", "EtcdStore / TCPStore",
                      "RPCs per op (" + " / ".join(cs) + ")"], rows),
            "",
            f"{b1['reps']} runs × up to {b1['ops_per_batch']} calls ({b1['late_ops_per_batch']} for the "
            f"late write; the contenders take turns call by call, each stopping after {b1['batch_budget_s']} s "
            f"of calls), {b1['value_bytes']}-byte values, "
            f"{b1['keys_in_namespace']} keys in the namespace. {b1['note']}",
            "",
            "![B1](b1_store.png)",
            "",
        ]
    b2 = results.get("b2")
    if b2:
        cs = b2["contenders"]
        by2 = {(r["n"], r["contender"]): r for r in b2["rows"]}
        rows = []
        for n in b2["ns"]:
            line = [str(n)] + [_b2_cell(by2.get((n, c))) for c in cs]
            o2 = by2.get((n, OURS_ETCD_V2), {})
            o3 = by2.get((n, OURS_ETCD_V3), {})
            line += [_ratio(o2.get(f"ratio_vs_{C10D}")), _ratio(o2.get(f"ratio_vs_{TORCH_ETCD_V2}")),
                     _ratio(o3.get(f"ratio_vs_{FLOOR}")), _ratio(o3.get(f"ratio_vs_{FLOOR_BARRIER}"))]
            rows.append(line)
        wrows = []
        for n in b2["ns"]:
            wrows.append([str(n)] + [f"{_fmt(by2[(n, c)]['etcd_writes'])} / {_fmt(by2[(n, c)]['revisions'])}"
                                     if c != C10D else "n/a" for c in cs])
        wcs = [c for c in cs if c not in (C10D, TORCH_ETCD_V2)]
        erows = [[str(n)] + [_events(by2[(n, c)].get("watch")) for c in wcs]
                 + [_bytes(by2[(n, c)].get("watch")) for c in wcs] for n in b2["ns"]]
        boxes = b2.get("box_s") or {}
        if isinstance(boxes, dict) and len(set(boxes.values())) == 1:
            box_text = f"{next(iter(boxes.values())):g} s for every contender"
        elif isinstance(boxes, dict):
            box_text = ", ".join(f"{c} {sec:g} s" for c, sec in boxes.items())
        else:
            box_text = f"{boxes} s"
        parts += [
            "## B2: rendezvous of N nodes (ms until all N hold their RendezvousInfo)",
            "",
            _table(["N"] + cs + ["etcd-v2 / c10d", "etcd-v2 / torch etcd-v2", "etcd-v3 / floor",
                                 "etcd-v3 / floor-barrier"], rows),
            "",
            f"Nodes spread over {b2['workers']} worker processes, one thread each; conf {b2['conf']}. "
            f"Time box of one round: {box_text or 'none'}; a contender that did not finish in its box is "
            "not run at larger N.",
            "",
            "etcd writes (raft entries) / revisions consumed per round:",
            "",
            _table(["N"] + cs, wrows),
            "",
            "Watch events delivered per node per round, mean / max over the nodes (left), and the bytes of "
            "those watch responses per node, mean / max (right):",
            "",
            _table(["N"] + [f"{c} events" for c in wcs] + [f"{c} bytes" for c in wcs], erows),
            "",
            b2["note"],
            "",
            "![B2](b2_rendezvous.png)",
            "",
        ]
    for b3 in results.get("b3") or []:
        st = b3["settings"]
        parts += [
            f"## B3 ({b3.get('name', b3['scenario'])}): re-rendezvous after losing 1 of {b3['n']} nodes (s from the kill until "
            "all survivors hold their new RendezvousInfo)",
            "",
            _table(["backend", "seconds", "failed runs", "first failure"],
                   [[r["contender"], _fig(r["s"], "", 2), str(r["failed_runs"]),
                     (r["failures"][0][:160].replace("|", "/") if r["failures"] else "")] for r in b3["rows"]]),
            "",
            f"Settings that decide it: a dead node counts as gone after keep_alive_interval "
            f"{st['keep_alive_interval']} s × keep_alive_max_attempt {st['keep_alive_max_attempt']} = "
            f"{st['dead_after_s']:g} s (etcd-v3: its lease TTL, the same product); then last_call_timeout "
            f"{st['last_call_timeout']} s once min_nodes = {st['min_nodes']} are present (max_nodes = "
            f"{st['max_nodes']}). {'These are the defaults.' if st['defaults'] else 'Not the defaults.'} "
            + ("etcd-v3 skips the last call when the new round only re-forms the group (`fast_recovery`, "
               "default on), so its figure is about the lease TTL alone. " if st.get("fast_recovery") else "")
            + f"{b3['note']}",
            "",
            f"![B3](b3_{b3.get('name', b3['scenario'])}.png)",
            "",
        ]
    b4 = results.get("b4")
    if b4:
        rows = []
        for r in b4["rows"]:
            if r.get("na") or r.get("error"):
                rows.append([str(r["n"]), r["contender"], r.get("na") or f"failed: {r['error'][:80]}", "", "", ""])
                continue
            rows.append([str(r["n"]), r["contender"], _fmt(r["revisions_per_min"], 1),
                         _fmt(r["raft_entries_per_min"], 1),
                         "n/a" if r["db_growth_bytes_per_min"] is None else _fmt(r["db_growth_bytes_per_min"]),
                         _fmt(r["etcd_cpu_pct"], 2)])
        parts += [
            f"## B4: idle job after the rendezvous (per minute, {b4['window_s']:g} s window)",
            "",
            _table(["N", "backend", "revisions/min", "raft entries/min", "db growth bytes/min", "etcd CPU %"], rows),
            "",
            f"{b4['note']} torch etcd-v2: revisions = v2 store index, db growth n/a (the v2 store is not in "
            f"the bbolt db). Conf {b4['conf']}.",
            "",
            "![B4](b4_idle_load.png)",
            "",
        ]
    b5 = results.get("b5")
    if b5:
        cs = b5["contenders"]
        by5 = {(r["world"], r["contender"]): r for r in b5["rows"]}
        rows = [[str(w)] + [_fig(by5[(w, c)]["ms"]) for c in cs]
                + [_ratio(by5.get((w, OURS_STORE), {}).get("ratio_vs_TCPStore"))] for w in b5["worlds"]]
        parts += [
            "## B5: init_process_group(\"gloo\") start-up (ms until the last rank returned)",
            "",
            _table(["world size"] + cs + ["EtcdStore / TCPStore"], rows),
            "",
            f"Runs per world size: {b5['reps']}; one rank per process.",
            "",
            "![B5](b5_pg_startup.png)",
            "",
        ]
    parts += ["## Contenders", ""] + [f"- **{k}**: {v}" for k, v in DESCRIPTIONS.items()] + [""]
    return "\n".join(parts)


def print_targets(tg: list[dict[str, Any]], out: Any = sys.stdout) -> None:
    width = max((len(t["target"]) for t in tg), default=10)
    print("\nTARGETS", file=out)
    for t in tg:
        print(f"  {t['target']:<{width}}  {t['figure']:<28}  {t['status'].upper():<12} {t['note']}", file=out)


# --------------------------------------------------------------------------- plots


def plots(results: dict[str, Any], outdir: str) -> list[str]:
    """Write the PNGs; returns their paths. Needs matplotlib (skipped with a warning without)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib missing: no plots")
        return []
    written: list[str] = []
    title_suffix = f" — {results.get('machine', {}).get('machine', '')}"

    def save(fig: Any, name: str) -> None:
        path = os.path.join(outdir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def err(s: dict[str, Any]) -> list[float]:
        return [max(0.0, s["median"] - s["lo"]), max(0.0, s["hi"] - s["median"])]

    b1 = results.get("b1")
    if b1:
        by = {(r["op"], r["contender"]): r for r in b1["rows"]}
        cs, ops = b1["contenders"], b1["ops"]
        fig, ax = plt.subplots(figsize=(11, 4.5))
        width = 0.8 / len(cs)
        for j, c in enumerate(cs):
            xs, ys, es = [], [], []
            for i, op in enumerate(ops):
                r = by[(op, c)]
                if r.get("na") or r["us"]["median"] is None:
                    continue
                xs.append(i + (j - (len(cs) - 1) / 2) * width)
                ys.append(r["us"]["median"])
                es.append(err(r["us"]))
            ax.bar(xs, ys, width, label=c, color=COLORS.get(c), yerr=list(zip(*es, strict=True)) if es else None,
                   capsize=2)
        ax.set_xticks(range(len(ops)), [b1["labels"][o] for o in ops], rotation=20, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("µs per call (median, run range)")
        ax.set_title("B1 store operations" + title_suffix)
        ax.legend(fontsize=8)
        save(fig, "b1_store.png")
    b2 = results.get("b2")
    if b2:
        by2 = {(r["n"], r["contender"]): r for r in b2["rows"]}
        fig, (ax, ax_ev) = plt.subplots(1, 2, figsize=(12, 4.5))
        for c in b2["contenders"]:
            style = "--" if c in (TORCH_ETCD_V2, C10D, FLOOR, FLOOR_BARRIER) else "-"
            pts = [(n, by2[(n, c)]["ms"]) for n in b2["ns"] if by2[(n, c)]["ms"]["median"] is not None]
            if pts:
                ax.errorbar([p[0] for p in pts], [p[1]["median"] for p in pts],
                            yerr=list(zip(*[err(p[1]) for p in pts], strict=True)), marker="o", capsize=3,
                            label=c, color=COLORS.get(c), linestyle=style)
            evs = [(n, by2[(n, c)]["watch"]) for n in b2["ns"] if by2[(n, c)].get("watch")]
            if evs:
                ax_ev.plot([p[0] for p in evs], [max(p[1]["events_mean"], 0.1) for p in evs], marker="o",
                           label=c, color=COLORS.get(c), linestyle=style)
        for a in (ax, ax_ev):
            a.set_xscale("log", base=2)
            a.set_yscale("log")
            a.set_xlabel("N nodes")
            if a.get_legend_handles_labels()[0]:
                a.legend(fontsize=8)
        ax.set_ylabel("ms until all N hold their RendezvousInfo")
        ax.set_title("B2 rendezvous" + title_suffix, fontsize=10)
        ax_ev.set_ylabel("watch events delivered per node per round (mean)")
        ax_ev.set_title("B2 watch events per node", fontsize=10)
        save(fig, "b2_rendezvous.png")
    for b3 in results.get("b3") or []:
        fig, ax = plt.subplots(figsize=(7, 4))
        rows = [r for r in b3["rows"] if r["s"]["median"] is not None]
        ax.bar([r["contender"] for r in rows], [r["s"]["median"] for r in rows],
               yerr=list(zip(*[err(r["s"]) for r in rows], strict=True)) if rows else None,
               color=[COLORS.get(r["contender"]) for r in rows], capsize=3)
        ax.axhline(PRODUCTION_RERDZV_S, color="red", linestyle=":", label=f"production report {PRODUCTION_RERDZV_S} s")
        ax.set_ylabel("s from the kill to the new round")
        ax.set_title(f"B3 {b3.get('name', b3['scenario'])}: 1 of {b3['n']} nodes killed" + title_suffix,
                     fontsize=10)
        ax.legend(fontsize=8)
        save(fig, f"b3_{b3.get('name', b3['scenario'])}.png")
    b4 = results.get("b4")
    if b4:
        rows = [r for r in b4["rows"] if r.get("revisions_per_min") is not None]
        cs = list(dict.fromkeys(r["contender"] for r in rows))
        if rows:
            fig, ax = plt.subplots(figsize=(7, 4))
            width = 0.8 / max(1, len(cs))
            for j, c in enumerate(cs):
                mine = [r for r in rows if r["contender"] == c]
                xs = [b4["ns"].index(r["n"]) + (j - (len(cs) - 1) / 2) * width for r in mine]
                ax.bar(xs, [r["raft_entries_per_min"] for r in mine], width, color=COLORS.get(c), alpha=0.35)
                bars = ax.bar(xs, [r["revisions_per_min"] for r in mine], width, color=COLORS.get(c), label=c)
                ax.bar_label(bars, fmt="%.0f", fontsize=8)
            ax.set_xticks(range(len(b4["ns"])), [f"N={n}" for n in b4["ns"]])
            ax.set_ylabel("per minute: revisions (solid), raft entries (light)")
            ax.set_title("B4 idle job load on etcd" + title_suffix)
            ax.legend(fontsize=8)
            save(fig, "b4_idle_load.png")
    b5 = results.get("b5")
    if b5:
        by5 = {(r["world"], r["contender"]): r for r in b5["rows"]}
        fig, ax = plt.subplots(figsize=(7, 4))
        for c in b5["contenders"]:
            pts = [(w, by5[(w, c)]["ms"]) for w in b5["worlds"] if by5[(w, c)]["ms"]["median"] is not None]
            if pts:
                ax.errorbar([p[0] for p in pts], [p[1]["median"] for p in pts],
                            yerr=list(zip(*[err(p[1]) for p in pts], strict=True)), marker="o", capsize=3,
                            label=c, color=COLORS.get(c))
        ax.set_xlabel("world size")
        ax.set_ylabel("ms until the last rank's init_process_group returned")
        ax.set_title("B5 gloo process-group start-up" + title_suffix)
        ax.legend(fontsize=8)
        save(fig, "b5_pg_startup.png")
    return written


def write_all(results: dict[str, Any], outdir: str) -> None:
    """results.md and the PNGs in ``outdir`` (results.json is written by the runner)."""
    results.setdefault("targets", targets(results))
    with open(os.path.join(outdir, "results.md"), "w") as f:
        f.write(markdown(results))
    plots(results, outdir)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.report RESULTS.json", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        results = json.load(f)
    results["targets"] = targets(results)
    write_all(results, os.path.dirname(os.path.abspath(args[0])))
    print_targets(results["targets"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
