"""The nemesis suite's long mode (tests/e2e/test_nemesis.py): many schedules, their figures.

    python tests/e2e/scripts/nemesis.py --seeds 1-50 [--faults 6] [--backends etcd-v2,etcd-v3]
        [--kinds kill_node,...] [--out benchmarks/results/nemesis.json]

Runs the test module with pytest from the repository root (the checkout's code) for every seed and
backend, each schedule drawing from every kind, the CPU hog included (the gate leaves it out), then
prints and writes per backend: schedules run and failed, invariant violations, and per fault kind
the count and the median and p99 of its stall (the longest time no training step was done after
it). Returns pytest's exit status. The etcd version is the newest of ``ETCD_RDZV_TEST_ETCD``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(0.99 * len(ordered) + 0.5) - 1))]


def report(lines: list[dict[str, object]]) -> dict[str, object]:
    """Figures per backend from the schedules' summaries (see the module docstring)."""
    out: dict[str, object] = {}
    for backend in sorted({str(s["backend"]) for s in lines}):
        runs = [s for s in lines if s["backend"] == backend]
        kinds: dict[str, list[float]] = {}
        for s in runs:
            for f in s["faults"]:  # type: ignore[attr-defined]
                kinds.setdefault(f["kind"], []).append(float(f["stall_s"]))
        out[backend] = {
            "schedules": len(runs),
            "violations": sum(len(s["violations"]) for s in runs),  # type: ignore[misc, arg-type]
            "stall_s": {k: {"n": len(v), "median": round(statistics.median(v), 2), "p99": round(_p99(v), 2)}
                        for k, v in sorted(kinds.items())},
        }  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1-50", help="seeds: 1-50 or 1,2,3 (default 1-50)")
    p.add_argument("--faults", type=int, default=6, help="faults per schedule (default 6)")
    p.add_argument("--backends", default="etcd-v2,etcd-v3")
    p.add_argument("--kinds", default="", help="comma-separated fault kinds (default: every kind)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "nemesis.json"))
    args, rest = p.parse_known_args(argv)
    from helpers.nemesis import KINDS  # tests/ is on the path (set below)

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as tmp:
        lines_file = tmp.name
    env = {**os.environ, "ETCD_RDZV_NEMESIS_SEEDS": args.seeds, "ETCD_RDZV_NEMESIS_FAULTS": str(args.faults),
           "ETCD_RDZV_NEMESIS_BACKENDS": args.backends, "ETCD_RDZV_NEMESIS_OUT": lines_file,
           "ETCD_RDZV_NEMESIS_KINDS": args.kinds or ",".join(KINDS)}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(x for x in (ROOT, env.get("PYTHONPATH")) if x)
    started = time.time()
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-n", "0", "-p", "no:cacheprovider",
           "tests/e2e/test_nemesis.py", *rest]  # fmt: skip
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    with open(lines_file) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    os.unlink(lines_file)
    figures = {"command": " ".join(["python tests/e2e/scripts/nemesis.py", *(argv or sys.argv[1:])]),
               "seeds": args.seeds, "faults_per_schedule": args.faults, "pytest_rc": rc,
               "minutes": round((time.time() - started) / 60, 1), **report(lines), "schedules": lines}  # fmt: skip
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(figures, f, indent=1)
    print(json.dumps({k: v for k, v in figures.items() if k != "schedules"}, indent=1))
    return rc


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    sys.exit(main())
