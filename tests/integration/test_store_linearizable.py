"""EtcdStore is linearizable under member kills, SIGSTOP, compaction and lost replies (issue 21).

Seeded runs of :mod:`helpers.store_workload` against a 3-member cluster, checked by
:mod:`helpers.linearizability` against TCPStore's sequential semantics; every store call must end
within its timeout. CI runs a few short seeds. The long mode, by hand::

    ETCD_RDZV_CHECK_SEED=1,2,3 ETCD_RDZV_CHECK_OPS=10000 ETCD_RDZV_TEST_ETCD=3.7 \\
        python -m pytest -n 0 -s tests/integration/test_store_linearizable.py

(``ETCD_RDZV_CHECK_SEED``: comma-separated seeds; ``ETCD_RDZV_CHECK_OPS``: operations per seed).
A failing seed prints the minimal non-linearizable fragment and writes the whole history as JSON
(``check(History.load(path).ops())`` checks it again).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator

import pytest
from helpers.linearizability import check
from helpers.matrix import ETCD_BINARIES, SELECTED, version_param
from helpers.store_workload import Config, run

from etcd_server import EtcdCluster

pytestmark = pytest.mark.etcd_matrix

SEEDS = [int(s) for s in os.environ.get("ETCD_RDZV_CHECK_SEED", "1,2").split(",")]
OPS = int(os.environ.get("ETCD_RDZV_CHECK_OPS", "160"))
#: Seconds between faults, on average: denser in a short run, so that it sees every kind.
FAULT_EVERY = 0.3 if OPS < 1000 else 0.6


#: The newest etcd and the newest subset version (each run costs ~20 s of CI time).
VERSIONS = [v for v in SELECTED if v in ("3.7", "3.6")]


@pytest.fixture(scope="module", params=[version_param(v) for v in VERSIONS])
def cluster(request: pytest.FixtureRequest) -> Iterator[EtcdCluster]:
    with EtcdCluster(3, binary=ETCD_BINARIES[request.param]) as c:
        yield c


@pytest.mark.parametrize("seed", SEEDS)
def test_store_history_is_linearizable_under_faults(cluster: EtcdCluster, seed: int) -> None:
    done = run(cluster, Config(seed=seed, ops=OPS, fault_every=FAULT_EVERY))
    ops = done.history.ops()
    start = time.monotonic()
    verdict = check(ops)
    took = time.monotonic() - start
    unknown = sum(o.outcome == "unknown" for o in ops)
    faults = [n.what for n in done.history.notes()]
    summary = (f"seed {seed}: {len(ops)} ops ({unknown} unknown outcomes), {len(faults)} faults "
               f"({', '.join(sorted(set(faults)))}; {done.lost_replies} lost replies, {done.unsent} unsent), run {done.wall:.1f} s, check {took:.1f} s")
    print(summary)
    for note in [n for n in done.history.notes() if n.what == "fault failed"][:3]:
        print(f"  a fault could not be applied: {note.detail}")
    if not verdict.ok or done.late:
        path = os.path.join(tempfile.gettempdir(), f"store-history-seed{seed}.json")
        done.history.dump(path)
        summary += f"; history in {path}"
    assert not done.late, f"{summary}\ncalls past their timeout:\n" + "\n".join(done.late)
    assert verdict.ok, f"{summary}\n" + verdict.explain(done.history.render)
