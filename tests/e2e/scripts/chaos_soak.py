"""Run the chaos soak (tests/e2e/test_chaos_soak.py) by hand for longer than CI does.

    python tests/e2e/scripts/chaos_soak.py --minutes 10 [--seed 1313] [--backends etcd-v3]

Sets ``ETCD_RDZV_SOAK_MINUTES``/``_SEED``/``_BACKENDS`` and runs that test module with pytest
from the repository root (``PYTHONPATH`` set to it, so the checkout's code is tested);
returns pytest's exit status. The etcd version is the newest of ``ETCD_RDZV_TEST_ETCD``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="fault phase per backend (default 10)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: the test's, 1313)")
    p.add_argument("--backends", default=None, help="comma-separated (default etcd-v3,etcd-v2)")
    args, rest = p.parse_known_args(argv)
    env = {**os.environ, "ETCD_RDZV_SOAK_MINUTES": str(args.minutes)}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (ROOT, env.get("PYTHONPATH")) if x)
    if args.seed is not None:
        env["ETCD_RDZV_SOAK_SEED"] = str(args.seed)
    if args.backends:
        env["ETCD_RDZV_SOAK_BACKENDS"] = args.backends
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-n", "0", "tests/e2e/test_chaos_soak.py", *rest]
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
