"""The one entry point: ``python -m benchmarks.run [--quick | --scale] [options]``.

Modes (sizes in :data:`MODES`):

* default (full): B1-B6 at the issues' sizes, about 20 minutes on 2 cores.
* ``--quick``: every benchmark at a tiny size, under 2 minutes on 2 cores; the
  CI smoke test. Exits 1 when a benchmark crashed or a contender produced no
  figure at all (something is broken), 0 otherwise.
* ``--scale``: B2 up to N = 4096 and B4 up to N = 1024, for a 16-core machine.
* ``--only b3t``: B3 with real torchrun agents and every backend's default settings
  (:mod:`benchmarks.b3_torchrun`), about 11 minutes on 2 cores; in no mode by default. Results go to
  ``benchmarks/results/b3-torchrun-<cores>core/`` unless ``--out`` says otherwise.

B2 time-boxes every round (``--box``): a contender that does not finish in its
box is reported as "did not finish in X s" and not run at larger N.

Results go to ``benchmarks/results/<mode>-<cores>core/`` (``--out`` to change):
``results.json`` (every figure, machine facts, versions, the command),
``results.md`` (tables and the targets table) and PNG plots. The targets table
is also printed at the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time
import traceback
from typing import Any

from . import report
from .common import (
    EXTRA_CONTENDERS,
    FLOOR,
    FLOORS,
    OURS_ETCD_V2,
    OURS_ETCD_V3,
    OURS_STORE,
    RDZV_CONTENDERS,
    STORE_CONTENDERS,
    TCP_STORE,
    TORCH_ETCD_V2,
    TORCH_V2_STORE,
    EtcdFarm,
    machine_facts,
    ours_handler_missing,
    ours_store_missing,
    raise_fd_limit,
    say,
    usable_cores,
    write_json,
)

log = logging.getLogger(__name__)

# B3 with real torchrun agents (--only b3t): in no mode's default sections.
B3T = {"reps": 2, "scenarios": ["sigkill", "sigterm", "hang", "spare"], "timeout": 240.0, "stagger": 10.0}
SECTIONS = ("b1", "b2", "b3", "b3t", "b4", "b5", "b6")

FAST_B3 = {"keep_alive_interval": "1", "keep_alive_max_attempt": "2", "last_call_timeout": "1"}

MODES: dict[str, dict[str, Any]] = {
    "quick": {
        "sections": ["b1", "b2", "b3", "b4", "b5", "b6"],
        "b1": {"reps": 2, "ops": 10, "late_ops": 3, "batch_budget": 0.2},
        "b2": {"ns": [4], "reps": 2, "workers": 2, "warmup": False, "box": {"*": 60.0}},
        "b3": {"n": 3, "reps": 1, "conf": FAST_B3, "scenarios": ["shrink"], "workers": 2, "timeout": 30.0},
        "b4": {"ns": [4], "window": 5.0, "workers": 2},
        "b5": {"worlds": [2, 4], "reps": 1},
        "b6": {"jobs": [1, 10], "reps": 1, "solo_rounds": 3, "window": 5.0, "cli_runs": 20, "workers": 2},
        "timeout": 60.0,
    },
    "full": {
        "sections": ["b1", "b2", "b3", "b4", "b5", "b6"],
        "b1": {"reps": 4, "ops": 100, "late_ops": 15, "batch_budget": 2.0},
        "b2": {"ns": [2, 4, 8, 16, 32, 64], "reps": 3, "workers": 4, "box": {"*": 120.0}},
        "b3": {"n": 8, "reps": 2, "conf": {}, "scenarios": ["shrink", "replace"], "tuned": ["shrink"],
               "workers": 4, "timeout": 80.0},
        "b4": {"ns": [8, 64], "window": 60.0, "workers": 4, "timeout": 120.0},
        "b5": {"worlds": [2, 4, 8, 16], "reps": 3},
        "b6": {"jobs": [1, 100], "reps": 2, "solo_rounds": 5, "window": 60.0, "cli_runs": 1000, "workers": 4},
        "timeout": 180.0,
    },
    "scale": {
        "sections": ["b2", "b4"],
        "b2": {"ns": [64, 256, 512, 1024, 2048, 4096], "reps": 3, "workers": 16,
               "box": {"*": 120.0, OURS_ETCD_V3: 300.0, FLOOR: 300.0}},
        "b4": {"ns": [64, 256, 1024], "window": 60.0, "workers": 16, "together": False},
        "timeout": 600.0,
    },
}


def _parse_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _parse_contenders(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in RDZV_CONTENDERS + EXTRA_CONTENDERS]
    if not names or unknown:
        known = ",".join(RDZV_CONTENDERS + EXTRA_CONTENDERS)
        raise argparse.ArgumentTypeError(f"unknown contender(s) {unknown or text!r}; use {known}")
    return names


def _parse_scenarios(text: str) -> list[str]:
    from .b3_torchrun import SCENARIOS

    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in SCENARIOS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown scenario(s) {unknown or text!r}; use {','.join(SCENARIOS)}")
    return names


def _parse_conf(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` (an rdzv-conf setting)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def _parse_box(text: str) -> tuple[str, float]:
    """``SECONDS`` (every contender) or ``CONTENDER=SECONDS``."""
    name, _, value = text.rpartition("=")
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"expected SECONDS or CONTENDER=SECONDS (seconds > 0), got {text!r}")
    if name and name not in RDZV_CONTENDERS:
        raise argparse.ArgumentTypeError(f"unknown contender {name!r} in {text!r}; one of {list(RDZV_CONTENDERS)}")
    return name or "*", seconds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="tiny sizes, under 2 minutes (CI smoke test)")
    mode.add_argument("--scale", action="store_true", help="B2 up to N = 4096, B4 up to 1024 (16-core machine)")
    p.add_argument("--only", default="", help="comma-separated subset of b1,b2,b3,b3t,b4,b5,b6 (b3t: B3 with "
                   "real torchrun agents, only when named here)")
    p.add_argument("--ns", type=_parse_ints, help="N list for B2 and B4 (overrides the mode's)")
    p.add_argument("--jobs", type=_parse_ints, help="B6: J list of concurrent jobs (overrides the mode's)")
    p.add_argument("--reps", type=int, help="runs per figure (overrides the mode's)")
    p.add_argument("--window", type=float, help="B4 idle window in seconds (overrides the mode's)")
    p.add_argument("--contenders", type=_parse_contenders,
                   help=f"comma-separated rendezvous contenders of B2-B4 (default all: {','.join(RDZV_CONTENDERS)})")
    p.add_argument("--scenarios", type=_parse_scenarios,
                   help="B3t: comma-separated subset of sigkill,sigterm,hang,spare (default all)")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="B3t: run every contender alone (default: etcd-v3 alone, the others concurrently)")
    p.add_argument("--no-agent-store", action="store_true",
                   help="B3t: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for every agent (torch's workaround of its "
                        "scale-down failure, docs/operations.md; not the default)")
    p.add_argument("--box", type=_parse_box, action="append", default=[], metavar="[CONTENDER=]SECONDS",
                   help="B2 time box of one round (repeatable; a bare number sets every contender's)")
    p.add_argument("--workers", type=int, help="worker processes hosting the nodes of B2-B4")
    p.add_argument("--clients", choices=("process", "node"), default="process",
                   help="B2: the etcd-v3 and floor nodes of a worker share one etcd client (process, the "
                        "default) or have one each (node)")
    p.add_argument("--nodes-per-client", type=int, default=0, metavar="K",
                   help="B2 with --clients process: every K nodes of a worker share one client (default 0: all)")
    p.add_argument("--v3-conf", type=_parse_conf, action="append", default=[], metavar="KEY=VALUE",
                   help="B6: an rdzv-conf setting of every etcd-v3 node (repeatable), e.g. renew_interval=5")
    p.add_argument("--etcd-binary", help="etcd binary (default: etcd_server's lookup)")
    p.add_argument("--machine-name", help="label of this machine in the results")
    p.add_argument("--out", help="output directory (default benchmarks/results/<mode>-<cores>core)")
    p.add_argument("-v", "--verbose", action="store_true", help="INFO logs from the workers too")
    return p


def _config(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    mode = "quick" if args.quick else "scale" if args.scale else "full"
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in MODES[mode].items()}
    if args.only:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = [s for s in wanted if s not in SECTIONS]
        if unknown:
            raise SystemExit(f"--only: unknown section(s) {unknown}; use {','.join(SECTIONS)}")
        cfg["sections"] = wanted
        for s in wanted:  # a section outside the mode gets the full mode's sizes
            cfg.setdefault(s, dict(B3T if s == "b3t" else MODES["full"][s]))
    if args.scenarios and "b3t" in cfg:
        cfg["b3t"]["scenarios"] = args.scenarios
    for s in ("b2", "b4"):
        if args.ns and s in cfg:
            cfg[s]["ns"] = args.ns
    if args.jobs and "b6" in cfg:
        cfg["b6"]["jobs"] = args.jobs
    if args.reps:
        for s in ("b1", "b2", "b3", "b3t", "b5", "b6"):
            if s in cfg:
                cfg[s]["reps"] = args.reps
    for s in ("b4", "b6"):
        if args.window and s in cfg:
            cfg[s]["window"] = args.window
    if args.box and "b2" in cfg:
        box = dict(cfg["b2"].get("box", {}))
        for name, seconds in args.box:
            if name == "*":
                box = {}  # a bare number replaces the mode's per-contender boxes too
            box[name] = seconds
        cfg["b2"]["box"] = box
    if args.workers:
        for s in ("b2", "b3", "b4", "b6"):
            if s in cfg:
                cfg[s]["workers"] = args.workers
    return mode, cfg


def _facts_etcd(etcd_binary: str | None, sections: list[str]) -> str | None:
    """The etcd named in the machine facts: B3t alone runs this package's backends on etcd 3.7."""
    if etcd_binary is None and sections == ["b3t"]:
        from .b3_torchrun import default_etcd_binaries

        return default_etcd_binaries(None)[OURS_ETCD_V3]
    return etcd_binary


def available(results: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(store contenders, rendezvous contenders) that can run here; the rest go to results["skipped"]."""
    skipped: dict[str, str] = results.setdefault("skipped", {})
    store_missing = ours_store_missing()
    try:
        import etcd  # noqa: F401

        v2_missing = None
    except ImportError as e:
        v2_missing = f"python-etcd not installed ({e})"
    stores, rdzv = [], []
    for c in STORE_CONTENDERS:
        why = store_missing if c == OURS_STORE else v2_missing if c == TORCH_V2_STORE else None
        if why:
            skipped[c] = why
        else:
            stores.append(c)
    for c in RDZV_CONTENDERS:
        why = (ours_handler_missing("etcd-v2") if c == OURS_ETCD_V2 else
               ours_handler_missing("etcd-v3") if c == OURS_ETCD_V3 else
               v2_missing if c == TORCH_ETCD_V2 else None)
        if why:
            skipped[c] = why
        else:
            rdzv.append(c)
    return stores, rdzv


def broken_contenders(results: dict[str, Any]) -> list[str]:
    """Contenders that produced no figure in some section they ran in."""
    broken: list[str] = []

    def check(section: str, rows: list[dict[str, Any]], key: str) -> None:
        ok: dict[str, bool] = {}
        for r in rows:
            if r.get("na"):
                continue
            c = r["contender"]
            fig = r.get(key)
            good = fig is not None and (not isinstance(fig, dict) or fig.get("median") is not None)
            ok[c] = ok.get(c, False) or good
        broken.extend(f"{section}: {c}" for c, good in ok.items() if not good)

    if results.get("b1"):
        check("B1", results["b1"]["rows"], "us")
    if results.get("b2"):
        check("B2", results["b2"]["rows"], "ms")
    for b3 in results.get("b3") or []:
        check(f"B3 {b3['scenario']}", b3["rows"], "s")
    if results.get("b3t"):
        check("B3t", [{**r, "contender": f"{r['contender']} {r['scenario']}"} for r in results["b3t"]["rows"]],
              "total_s")
    if results.get("b4"):
        check("B4", results["b4"]["rows"], "revisions_per_min")
    if results.get("b5"):
        check("B5", results["b5"]["rows"], "ms")
    if results.get("b6"):
        check("B6", [{**r, "contender": f"etcd-v3 J={r['jobs']}"} for r in results["b6"]["rows"]], "ms")
    return broken


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    raise_fd_limit()  # etcd (started from here) and the workers hold a connection per node
    mode, cfg = _config(args)
    cores = usable_cores()
    name = f"b3-torchrun-{cores}core" if cfg["sections"] == ["b3t"] else f"{mode}-{cores}core"
    outdir = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    os.makedirs(outdir, exist_ok=True)
    started = time.monotonic()
    results: dict[str, Any] = {
        "mode": mode,
        "command": "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "config": cfg,
        "machine": machine_facts(_facts_etcd(args.etcd_binary, cfg["sections"]), args.machine_name),
    }
    json_path = os.path.join(outdir, "results.json")
    stores, rdzv = available(results)
    if args.contenders:
        rdzv = [c for c in rdzv if c in args.contenders]
        if OURS_ETCD_V2 in rdzv:  # B3's before/after: only when named
            rdzv += [c for c in EXTRA_CONTENDERS if c in args.contenders]
    say(f"{mode} mode, sections {cfg['sections']}, output {outdir}")
    for c, why in results["skipped"].items():
        say(f"not measured: {c}: {why}")
    crashed: list[str] = []

    import torch.distributed as dist

    from .workers import Pool

    # The c10d contenders' TCPStore server lives here, as etcd lives in its own process.
    tcp_server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    tcp_endpoint = f"127.0.0.1:{tcp_server.port}"
    timeout = float(cfg["timeout"])
    sections = cfg["sections"]
    # Enough workers for the widest section: the node spread of B2-B4, one rank each in B5.
    pool_size = max([cfg[s]["workers"] for s in ("b2", "b3", "b4", "b6") if s in sections]
                    + [max(cfg["b5"]["worlds"]) for s in ("b5",) if s in sections] + [1])
    pool = None
    try:
        with EtcdFarm(args.etcd_binary) as farm:
            if any(s in sections for s in ("b2", "b3", "b4", "b5", "b6")):
                pool = Pool(pool_size, log_level=logging.INFO if args.verbose else logging.WARNING)
            for section in sections:
                t0 = time.monotonic()
                say(f"=== {section.upper()}")
                try:
                    c = cfg[section]
                    if section == "b1":
                        from .b1_store import run_b1

                        results["b1"] = run_b1(farm, tcp_endpoint, stores, c["reps"], c["ops"], c["late_ops"],
                                               c["batch_budget"])
                    elif section == "b2":
                        from .b2_rendezvous import run_b2

                        assert pool is not None
                        results["b2"] = run_b2(pool, farm, tcp_endpoint, rdzv, c["ns"], c["reps"], timeout,
                                               c["workers"], warmup=c.get("warmup", True), box=c.get("box"),
                                               clients=args.clients, nodes_per_client=args.nodes_per_client)
                    elif section == "b3":
                        from .b3_rerendezvous import TUNED, run_b3

                        assert pool is not None
                        b3_cases = [(sc, c["conf"], sc) for sc in c["scenarios"]]
                        b3_cases += [(sc, TUNED, f"{sc}-tuned") for sc in c.get("tuned", [])]
                        results["b3"] = [
                            run_b3(pool, farm, tcp_endpoint, [x for x in rdzv if x not in FLOORS], c["n"], c["reps"],
                                   conf, c.get("timeout", timeout), c["workers"], scenario=sc, name=name)
                            for sc, conf, name in b3_cases
                        ]
                    elif section == "b3t":
                        from .b3_torchrun import run_b3t

                        results["b3t"] = run_b3t([x for x in rdzv if x not in FLOORS], c["scenarios"], c["reps"],
                                                 c["timeout"], etcd_binary=args.etcd_binary, stagger=c["stagger"],
                                                 one_at_a_time=args.one_at_a_time,
                                                 agent_env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
                                                 if args.no_agent_store else None)
                    elif section == "b4":
                        from .b4_idle_load import run_b4

                        assert pool is not None
                        results["b4"] = run_b4(pool, args.etcd_binary, rdzv, c["ns"], c["window"], {},
                                               c.get("timeout", timeout), c["workers"],
                                               together=c.get("together", True))
                    elif section == "b5":
                        from .b5_pg_startup import run_b5

                        assert pool is not None
                        b5_stores = [x for x in (OURS_STORE, TCP_STORE) if x in stores]
                        results["b5"] = run_b5(pool, farm, tcp_endpoint, b5_stores, c["worlds"], c["reps"], timeout)
                    elif section == "b6":
                        from .b6_many_jobs import run_b6

                        assert pool is not None
                        results["b6"] = run_b6(pool, args.etcd_binary, c["jobs"], c["reps"], c["solo_rounds"],
                                               c["window"], c["cli_runs"], c.get("timeout", timeout), c["workers"],
                                               conf=dict(args.v3_conf) or None)
                except Exception as e:
                    crashed.append(f"{section}: {type(e).__name__}: {e}")
                    say(f"{section.upper()} CRASHED: {type(e).__name__}: {e}\n{traceback.format_exc()}")
                results.setdefault("section_wall_s", {})[section] = round(time.monotonic() - t0, 1)
                results["wall_s"] = time.monotonic() - started
                write_json(json_path, results)
    finally:
        if pool is not None:
            pool.close()
    try:
        load_end: tuple[float, ...] | list[float] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load_end = []
    results["loadavg_at_end"] = load_end
    results["wall_s"] = time.monotonic() - started
    results["crashed"] = crashed
    results["broken"] = broken_contenders(results)
    results["targets"] = report.targets(results)
    write_json(json_path, results)
    try:
        report.write_all(results, outdir)
    except Exception as e:
        crashed.append(f"report: {type(e).__name__}: {e}")
        say(f"report CRASHED: {traceback.format_exc()}")
    report.print_targets(results["targets"])
    print(f"\nResults: {outdir}/results.md ({results['wall_s']:.0f} s)")
    problems = crashed + [f"no figure: {b}" for b in results["broken"]]
    for p in problems:
        print(f"PROBLEM: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
