"""Turn a results dict into a markdown report (with the targets table) and PNG plots.

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
from .figures import COLORS, PRODUCTION_RERDZV_S
from .figures import fig as _fig
from .figures import fmt as _fmt
from .figures import ratio as _ratio
from .targets import targets

log = logging.getLogger(__name__)



# --------------------------------------------------------------------------- formatting


def _b2_cell(r: dict[str, Any] | None) -> str:
    """A B2 figure, or why there is none (did not finish in its box, not run)."""
    if r is None:
        return "—"
    dnf = r.get("did_not_finish")
    if r.get("skipped"):
        return str(r["skipped"])
    if r["ms"]["median"] is None and dnf is not None:
        return f"did not finish in {dnf:g} s"
    cell = _fig(r["ms"])
    if dnf is not None:
        cell += f" (a run did not finish in {dnf:g} s)"
    elif r.get("failed_runs"):
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

# --------------------------------------------------------------------------- markdown


def markdown(results: dict[str, Any]) -> str:
    m = results.get("machine", {})
    v = m.get("versions", {})
    parts = [
        "# Benchmark results: " + ("B3 with torchrun agents" if results.get("config", {}).get("sections") == ["b3t"]
                                    else f"{results.get('mode', '?')} mode"),
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
            f"Nodes spread over {b2['workers']} worker processes, one thread each"
            f"{_clients_note(b2.get('clients', 'node'), b2.get('nodes_per_client', 0))}; conf {b2['conf']}. "
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
            f"{st['dead_after_s']:g} s (etcd-v3: its lease TTL, the same product, unless a survivor evicts it first: a lease that missed evict_misses 2 renewals of renew_interval 1 s while the survivor's own were steady, docs/etcd-v3-design.md); then last_call_timeout "
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
    if results.get("b6"):
        from .b6_many_jobs import markdown_lines

        parts += markdown_lines(results["b6"])
    if results.get("b3t"):
        from .b3_torchrun_report import markdown_lines as b3t_lines

        parts += b3t_lines(results["b3t"])
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
    if results.get("b3t"):
        from .b3_torchrun_report import plot as b3t_plot

        path = b3t_plot(results["b3t"], outdir, title_suffix)
        if path:
            written.append(path)
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



def _clients_note(clients: str, per_client: int = 0) -> str:
    if clients == "process":
        share = f"every {per_client} share" if per_client > 0 else "share"
        return f" (the etcd-v3 and floor nodes of a worker {share} one etcd client; the others have one each)"
    return " (every node has its own etcd client)"


if __name__ == "__main__":
    raise SystemExit(main())
