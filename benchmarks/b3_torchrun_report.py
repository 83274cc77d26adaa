"""The B3-torchrun section of results.md, its targets (issue 24) and its plot.

Reads the ``b3t`` section that :func:`benchmarks.b3_torchrun.run_b3t` returns; writes nothing but the
markdown lines, the target rows and ``b3_torchrun.png``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from .common import OURS_ETCD_V2, OURS_ETCD_V3, Series
from .figures import fig

log = logging.getLogger(__name__)

# The targets with the defaults (seconds from the fault to the first step of the new group; the SIGKILL
# one also bounds its rendezvous part): issue 24's for etcd-v3, issue 29's hang bound for this package's
# etcd-v2 (torch's own handlers wait for the collective's timeout). Met when every run is within.
TARGETS = (
    (OURS_ETCD_V3, "sigkill", "total_s", 8.0, "SIGKILL of 1 of 3 whole nodes → survivors' first step"),
    (OURS_ETCD_V3, "sigkill", "rendezvous_s", 3.0,
     "SIGKILL of 1 of 3 whole nodes, rendezvous part (→ \"Rendezvous complete\")"),
    (OURS_ETCD_V3, "sigterm", "total_s", 4.0, "SIGTERM of 1 of 3 agents → survivors' first step"),
    (OURS_ETCD_V3, "spare", "total_s", 8.0, "hot spare (2:2 + 1): SIGKILL of a member's node → whole again, first step"),
    (OURS_ETCD_V3, "hang", "total_s", 40.0, "SIGSTOP of 1 of 3 whole nodes (hung) → survivors' first step"),
    (OURS_ETCD_V2, "hang", "total_s", 40.0, "SIGSTOP of 1 of 3 whole nodes (hung) → survivors' first step"),
)
SCENARIO_TITLES = {
    "sigkill": "SIGKILL of one whole node (agent + worker), --nnodes=2:3, 3 agents",
    "sigterm": "SIGTERM of one agent (graceful), --nnodes=2:3, 3 agents",
    "hang": "SIGSTOP of one whole node (a hung host), --nnodes=2:3, 3 agents",
    "spare": "hot spare: --nnodes=2:2, 3 agents, SIGKILL of a member's whole node",
}


def _figures(b3t: dict[str, Any], contender: str, scenario: str, key: str) -> list[float] | None:
    """Every run's figure, or None when a run failed or none ran."""
    mine = [f for f in b3t["figures"] if f["contender"] == contender and f["scenario"] == scenario]
    if not mine or any(f["error"] for f in mine):
        return None
    return [float(f[key]) for f in mine]


def targets(b3t: dict[str, Any]) -> list[dict[str, Any]]:
    """The target rows (``target``, ``figure``, ``status``, ``note``) of :data:`TARGETS`."""
    out = []
    for contender, scenario, key, bound, what in TARGETS:
        issue = 24 if contender == OURS_ETCD_V3 else 29
        name = f"B3t (issue {issue}): {contender}, defaults, {what} ≤ {bound:g} s"
        if contender not in b3t["contenders"] or scenario not in b3t["scenarios"]:
            out.append({"target": name, "figure": "—", "status": "not measured", "note": "not in this run"})
            continue
        values = _figures(b3t, contender, scenario, key)
        if values is None:
            out.append({"target": name, "figure": "—", "status": "not met", "note": "a run failed"})
            continue
        runs = ", ".join(f"{v:.2f}" for v in values)
        out.append({"target": name, "figure": f"{max(values):.2f} s (worst of {len(values)})",
                    "status": "met" if max(values) <= bound else "not met",
                    "note": f"runs: {runs} s; load average (1 min) at the faults: "
                            + ", ".join(str(f["loadavg_1m"]) for f in b3t["figures"]
                                        if f["contender"] == contender and f["scenario"] == scenario)})
    return out


def summaries(figures: Sequence[dict[str, Any]], contenders: Sequence[str], scenarios: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (contender, scenario): each part's median and range over the runs, failed runs."""
    rows = []
    for c in contenders:
        for s in scenarios:
            mine = sorted((f for f in figures if f["contender"] == c and f["scenario"] == s), key=lambda f: f["rep"])
            if not mine:
                continue
            ok = [f for f in mine if f["error"] is None]
            row: dict[str, Any] = {"contender": c, "scenario": s, "failed_runs": len(mine) - len(ok),
                                   "first_error": next((f["error"] for f in mine if f["error"]), None)}
            for key in ("rendezvous_s", "startup_s", "total_s"):
                series = Series()
                for f in ok:
                    series.add_run([f[key]])
                row[key] = series.summary()
            row["overlapped_runs"] = sum(1 for f in ok if f["overlapped"])
            rows.append(row)
    return rows


def _row_cells(r: dict[str, Any]) -> list[str]:
    return [r["contender"], fig(r["rendezvous_s"], " s", 2), fig(r["startup_s"], " s", 2), fig(r["total_s"], " s", 2),
            str(r["failed_runs"]), str(r["overlapped_runs"]),
            (r["first_error"] or "")[:160].replace("|", "/")]


def markdown_lines(b3t: dict[str, Any]) -> list[str]:
    """The B3-torchrun section of results.md."""
    st, sched = b3t["settings"], b3t["schedule"]
    etcd = ", ".join(f"{c}: etcd {e['version']}" for c, e in b3t["etcd"].items())
    parts = [
        "## B3 with real torchrun agents (the defaults, no --rdzv-conf)",
        "",
        f"3 torchrun agents, {st['nproc_per_node']} worker each (gloo, one training step every "
        f"{st['step_time_s']} s plus its all-reduce), `--max-restarts={st['max_restarts']}`, "
        f"`--monitor-interval={st['monitor_interval_s']}` (torchrun's default), {b3t['reps']} runs per figure "
        f"(a fault not recovered within {b3t.get('fault_timeout_s', '?')} s fails); "
        f"{etcd}; c10d's TCPStore in the first agent. Seconds from the fault: **rendezvous** until the last "
        "agent of the new group logged \"Rendezvous complete for workers\", **start-up** from there until every "
        "worker of the new group finished its first step, **total** the sum. Median over the runs (range). "
        f"Schedule: {', '.join(sched['alone']) or 'none'} alone; {', '.join(sched['concurrent']) or 'none'} "
        f"concurrently (started {sched['stagger_s']:g} s apart; *overlapped*: runs whose start-up overlapped "
        "another job's agent or worker start-up). Load average at start "
        f"{b3t['loadavg_at_start']}, at end {b3t['loadavg_at_end']}; {b3t['wall_s']:.0f} s. Reference: the "
        f"production report's {b3t['reference_s']} s (Volcano + TorchElastic).",
        "",
    ]
    if st.get("agent_env"):
        parts += ["**Not the defaults:** every agent ran with " + ", ".join(
            f"`{k}={v}`" for k, v in st["agent_env"].items()) + ".", ""]
    header = ["backend", "rendezvous", "start-up", "total", "failed runs", "overlapped", "first failure"]
    for scenario in b3t["scenarios"]:
        rows = [r for r in b3t["rows"] if r["scenario"] == scenario]
        parts += [f"### {SCENARIO_TITLES[scenario]}", "", "| " + " | ".join(header) + " |",
                  "|" + "---|" * len(header)]
        parts += ["| " + " | ".join(_row_cells(r)) + " |" for r in rows]
        parts.append("")
    parts += ["### Every run", "",
              "| backend | scenario | run | victim (group rank) | new group | load 1 min | rendezvous | start-up "
              "| total | overlapped with |", "|" + "---|" * 10]
    for f in b3t["figures"]:
        def s(x: float | None) -> str:
            return "—" if x is None else f"{x:.2f}"
        parts.append(f"| {f['contender']} | {f['scenario']} | {f['rep']} | {f['victim']} ({f['victim_group_rank']}) "
                     f"| {','.join(f['new_group'])} | {f['loadavg_1m']} | {s(f['rendezvous_s'])} | {s(f['startup_s'])} "
                     f"| {s(f['total_s']) if not f['error'] else 'FAILED: ' + f['error'][:120].replace('|', '/')} "
                     f"| {'; '.join(f['overlapped']) or '—'} |")
    if b3t.get("events"):
        parts += ["", "Jobs that did not start (their fault counts as failed):", ""]
        parts += [f"- {e}" for e in b3t["events"]]
    parts += ["", "![B3 torchrun](b3_torchrun.png)", ""]
    return parts


def plot(b3t: dict[str, Any], outdir: str, title_suffix: str = "") -> str | None:
    """``b3_torchrun.png``: stacked bars (rendezvous + start-up medians) per scenario and contender, with the
    production report's figure as a reference line. Returns the path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib missing: no B3-torchrun plot")
        return None
    from .figures import COLORS

    cs, scs = b3t["contenders"], b3t["scenarios"]
    by = {(r["contender"], r["scenario"]): r for r in b3t["rows"]}
    fig_, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / max(1, len(cs))
    limit = f"{b3t.get('fault_timeout_s', 0):g}"
    for j, c in enumerate(cs):
        xs, rdzv, start, labels = [], [], [], []
        for i, s in enumerate(scs):
            r = by.get((c, s))
            if r is None:
                continue
            x = i + (j - (len(cs) - 1) / 2) * width
            runs = r["failed_runs"] + (r["total_s"]["runs"] or 0)
            if r["total_s"]["median"] is None:  # every run failed: say so where the bar would be
                ax.text(x, 1, f"{c}: no first step\nwithin {limit} s\n({r['failed_runs']} of {runs} runs)",
                        rotation=90, ha="center", va="bottom", fontsize=7, color=COLORS.get(c))
                continue
            xs.append(x)
            rdzv.append(r["rendezvous_s"]["median"])
            start.append(r["startup_s"]["median"])
            total = r["rendezvous_s"]["median"] + r["startup_s"]["median"]
            labels.append(f"{total:.1f}" + (f"\n({r['failed_runs']} of {runs} failed)" if r["failed_runs"] else ""))
        color = COLORS.get(c)
        ax.bar(xs, rdzv, width, color=color, label=f"{c}: rendezvous")
        bars = ax.bar(xs, start, width, bottom=rdzv, color=color, alpha=0.4, hatch="//", label=f"{c}: start-up")
        ax.bar_label(bars, labels=labels, fontsize=7)
    ref = float(b3t["reference_s"])
    ax.axhline(ref, color="black", linestyle="--", linewidth=1,
               label=f"production report (Volcano + TorchElastic): {ref:g} s")
    ax.set_xticks(range(len(scs)), [{"spare": "hot spare (2:2 + 1)"}.get(s, s) for s in scs])
    ax.set_ylabel("s from the fault: rendezvous (solid) + worker start-up (hatched)")
    env = " ".join(f"{k}={v}" for k, v in b3t["settings"].get("agent_env", {}).items())
    ax.set_title("B3 with 3 torchrun agents, default settings" + (f" + {env}" if env else "") + title_suffix,
                 fontsize=10)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.1)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    path = os.path.join(outdir, "b3_torchrun.png")
    fig_.tight_layout()
    fig_.savefig(path, dpi=110)
    plt.close(fig_)
    return path
