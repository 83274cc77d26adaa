"""The nemesis suite: seeded schedules of faults against real torchrun jobs (a Jepsen for torchrun).

A job of three local nodes (``--nnodes=2:3``, real agents, real workers training the small model
with checkpoints every 3 steps) meets a 3-member etcd on loopback, each node through its own proxy
per member (:class:`helpers.cut_proxy.CutProxy`, so that one node can be cut off from etcd). The
faults (:mod:`helpers.nemesis`): SIGKILL/SIGSTOP of a node, of its agent, of a worker; kill/SIGSTOP
of an etcd follower and of the leader; a quorum loss of 10 s; one node cut off from etcd; a CPU hog.
One at a time; the next once the job trains at full strength again (or after ``PACE_S``).

Checked from the training log, the faults and the agents' exits: every step done once after the
checkpoint its group resumed from (none lost, none skipped, no two groups at once); every worker
group explained by a fault that may restart one (no false eviction: etcd's members and the CPU
restart nothing); no agent exits while the faults run (a failure never closes the run) and every
one exits 0 at the end; after the last fault the three nodes train together again (none stranded).

Knobs (environment): ``ETCD_RDZV_NEMESIS_SEEDS`` (``1,2``; ``1-50`` for a range), ``_FAULTS``
(faults per schedule, default 3), ``_KINDS`` (comma-separated; default every kind but the CPU hog,
which would starve the tests running beside this one: the long mode adds it), ``_BACKENDS``
(``etcd-v2,etcd-v3``), ``_OUT`` (a JSON-lines file: one line per schedule, the long mode's
figures). The long mode: ``python tests/e2e/scripts/nemesis.py --seeds 1-50`` (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.cut_proxy import CutProxy
from helpers.elastic import Job, assert_groups_never_overlap, exclusive_records, record_timing, steps_of
from helpers.matrix import ETCD_BINARIES, FULL_VERSIONS, version_param
from helpers.nemesis import KINDS, Nemesis, groups, schedule, stalls, violations

from etcd_server import EtcdCluster


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


SEEDS = _seeds(os.environ.get("ETCD_RDZV_NEMESIS_SEEDS", "1,2"))
FAULTS = int(os.environ.get("ETCD_RDZV_NEMESIS_FAULTS", "3"))
KIND_NAMES = [k for k in os.environ.get("ETCD_RDZV_NEMESIS_KINDS", "").split(",") if k] or [
    k for k in KINDS if k != "cpu_hog"
]
BACKENDS = [b for b in os.environ.get("ETCD_RDZV_NEMESIS_BACKENDS", "etcd-v2,etcd-v3").split(",") if b]
OUT = os.environ.get("ETCD_RDZV_NEMESIS_OUT", "")
NODES = ("n0", "n1", "n2")
PACE_S = 20.0
#: read_timeout 20 s: a call rides out the 10 s quorum loss. keep_alive_interval 2 s: etcd-v3's lease
#: TTL (interval x 3 attempts) of 6 s outlasts the longest pause of the etcd leader (5 s). etcd itself
#: may revoke every lease not renewed while its leader was paused for longer than their TTL: on
#: SIGCONT the paused leader's lessor finds them expired and its revoke can reach the new leader
#: before it steps down (etcd-io/etcd#15247; the guard of etcd-io/etcd#16822 skips its leadership
#: check when the member ticked in the last three ticks, as it does at once on resuming). Seen here
#: with a 3 s TTL and a 3.9 s pause: two members' leases revoked, the group restarted. No client can
#: undo a revoke etcd committed; the operations guide says to keep lease TTLs above the longest stall
#: of an etcd member.
CONF = {"state_ttl": 30, "read_timeout": 20, "keep_alive_interval": 2}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420 + FAULTS * 60)]


def _newest() -> str:
    """The newest etcd that runs the whole suite (a subset version would deselect these from the
    gate), else the newest selected."""
    def order(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in v.split("."))

    full = sorted((v for v in ETCD_BINARIES if v in FULL_VERSIONS), key=order)
    return (full or sorted(ETCD_BINARIES, key=order))[-1]


PARAMS = [
    version_param(_newest(), backend, seed, id=f"{backend}-seed{seed}-etcd{_newest()}")
    for backend in BACKENDS for seed in SEEDS
] if ETCD_BINARIES else []  # fmt: skip


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    c = EtcdCluster(3, binary=ETCD_BINARIES[_newest()], heartbeat_ms=50, election_timeout_ms=500)
    c.start()
    try:
        yield c
    finally:
        for pid in c.pids:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        c.stop(graceful=False)


def _world3_steps(job: Job, after: float) -> int:
    return len({s.step for s in steps_of(job.records()) if s.t > after and s.world_size == 3})


@pytest.mark.parametrize(("backend", "seed"), PARAMS)
def test_nemesis(backend: str, seed: int, cluster: EtcdCluster, tmp_path: Any) -> None:
    faults = schedule(seed, backend, FAULTS, KIND_NAMES)
    print(f"\n[nemesis] seed {seed} backend {backend} etcd {cluster.version}: "
          f"{', '.join(f.kind for f in faults)}")  # fmt: skip
    members = [tuple(u.split("//")[-1].rsplit(":", 1)) for u in cluster.client_urls]
    proxies = {n: [CutProxy((h, int(p))) for h, p in members] for n in NODES}
    job = Job(str(tmp_path / "job"), backend=backend, endpoint=cluster.endpoint_string, nnodes="2:3",
              pg_timeout=6, max_restarts=1000, conf=CONF)  # fmt: skip

    def start(name: str) -> None:
        job.start(name, endpoint=",".join(p.endpoint for p in proxies[name]))

    nemesis = Nemesis(job, cluster, proxies, start, random.Random(f"targets-{seed}-{backend}"))
    try:
        for n in NODES:
            start(n)
        job.wait_for("a world of 3 training", lambda r: [g for g in steps_of(r) if g.world_size == 3][1:], 240)
        began = time.time()
        for fault in faults:
            print(f"[nemesis] {time.time():.2f} {fault.describe()}")
            nemesis.inject(fault)
            print(f"[nemesis] {time.time():.2f} {fault.describe()}: undone ({fault.target})")
            pace = time.monotonic() + PACE_S
            while _world3_steps(job, fault.end) < 2 and time.monotonic() < pace:
                time.sleep(0.2)  # log polling period
            exited = {n: a.returncode for n, a in job.nodes.items() if not a.running()}
            assert not exited, f"agents exited during the faults (seed {seed}): {exited}\n{job.diagnostics()}"
        calm = time.time()
        job.wait_for(f"the three nodes train together after the last fault (seed {seed})",
                     lambda r: _world3_steps(job, calm) >= 2, 180)  # fmt: skip
        ended = time.time()
        job.finish()
        codes = job.wait_exit(timeout=180)
        assert set(codes.values()) == {0}, f"exit codes {codes} (seed {seed})\n{job.diagnostics()}"
        records = job.records()
        assert any(r.kind == "done" for r in records), job.diagnostics()
        found = violations(records, faults, since=began)
        assert_groups_never_overlap(exclusive_records(records, nemesis.thaws))
        costs = stalls(records, faults, ended)
        summary = {
            "backend": backend, "seed": seed, "etcd": cluster.version, "violations": found,
            "groups": len([g for g in groups(records) if g.start > began]),
            "faults": [{"kind": f.kind, "target": f.target, "hold_s": f.hold, "stall_s": s}
                       for f, s in zip(faults, costs, strict=True)],
        }  # fmt: skip
        record_timing(f"nemesis/{backend}/seed{seed}", summary)
        if OUT:
            with open(OUT, "a") as f:
                f.write(json.dumps(summary) + "\n")
        assert not found, f"seed {seed} ({backend}): " + "\n".join(found) + f"\n{job.diagnostics()}"
        job.close()  # fails if a process of the job is left
    finally:
        nemesis.heal()
        for ps in proxies.values():
            for p in ps:
                p.close()
        job.close()
