"""``python -m benchmarks.recovery [PYTEST_ARGS ...]``: the recovery figures of the e2e scenarios.

Runs the timed e2e scenarios (the fault scenarios, the partitions, the etcd-v3 node-ends and dead-joiner
jobs, the chaos soak; or the pytest arguments given) with ``ETCD_RDZV_TIMINGS_DIR`` set, so that every
scenario writes its figure into a file of its own (tests/helpers/elastic.py ``record_timing``), then merges
those figures into ``benchmarks/results/recovery.json`` (``--out`` to change), keeping the figures of
scenarios that did not run.
A plain ``pytest`` run only prints the figures (``[timing]`` lines): tests write nothing tracked.

Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_OUT = os.path.join(HERE, "results", "recovery.json")
DEFAULT_TESTS = [
    "tests/e2e/test_elastic_faults.py",
    "tests/e2e/test_partitions.py",
    "tests/e2e/test_v3_torchrun.py::test_a_node_that_ends_leaves_and_the_others_train_again",
    "tests/e2e/test_v3_torchrun.py::test_a_dead_joiner_named_in_a_seal_does_not_end_the_job",
    "tests/e2e/test_docker_suite.py",
    "tests/e2e/test_chaos_soak.py",
]
TIMINGS_DIR_ENV = "ETCD_RDZV_TIMINGS_DIR"  # the name tests/helpers/elastic.py reads


def merge(figures_dir: str, out: str) -> list[str]:
    """Merge every ``*.json`` of ``figures_dir`` into ``out`` (atomically); the keys written."""
    try:
        with open(out) as f:
            data = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        data = {}
    written = []
    for path in sorted(glob.glob(os.path.join(figures_dir, "*.json"))):
        with open(path) as f:
            figure = json.load(f)
        data.update(figure)
        written.extend(figure)
    tmp = f"{out}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(dict(sorted(data.items())), f, indent=2)
        f.write("\n")
    os.replace(tmp, out)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="the recovery.json to update")
    args, pytest_args = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="etcd-rdzv-timings-") as figures:
        env = {**os.environ, TIMINGS_DIR_ENV: figures}
        # --full-matrix: every scenario on both backends (the gate runs some on one only)
        cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-n", "0", "--full-matrix", *(pytest_args or DEFAULT_TESTS)]
        code = subprocess.call(cmd, cwd=ROOT, env=env)
        written = merge(figures, args.out)
    print(f"recovery: {len(written)} figure(s) merged into {args.out}: {', '.join(written) or 'none'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
