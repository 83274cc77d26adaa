"""Chaos soak: random process faults against a 3-member etcd cluster under store load.

A torchrun job of three local nodes (``--nnodes=2:3``) trains against a 3-member
:class:`etcd_server.EtcdCluster` on loopback while two threads load an ``EtcdStore`` on the
same cluster (``add`` on one shared counter, ``set``/``get`` of their own key). For the
soak's duration, one fault at a time, drawn from a seeded ``random.Random``:

* SIGKILL of a node (agent and workers), started again 1-3 s later as a pod restart;
* SIGSTOP of a node for 1-5 s, then SIGCONT;
* SIGKILL of an etcd member, started again 1-4 s later (a quorum stays up);
* SIGSTOP of an etcd member for 1-4 s, then SIGCONT.

Each kind comes once first (in a seeded order), then at random; a fault starts only
before the time box ends.

After a fault is undone, the next one comes once the job trains again or after 20 s
(so faults also land on a job that is still recovering); after the last one the job must
train at world size 3 again within 180 s. Invariants, checked after every fault and at the end: never two worker groups training at once (a step a frozen node
logs when thawed, completed before the freeze, is not training); no agent exits while etcd
keeps a quorum; every store call succeeds and reads back what it wrote; the counter equals
the number of acknowledged ``add`` calls exactly; the job finishes (every agent exits 0);
no process of the job is left; every key and every lease is gone once the TTLs passed.

Knobs (environment): ``ETCD_RDZV_SOAK_MINUTES`` (fault phase per backend, default 0.75),
``ETCD_RDZV_SOAK_SEED`` (default 1313; printed, with every fault, so a run can be
replayed), ``ETCD_RDZV_SOAK_BACKENDS`` (default ``etcd-v3,etcd-v2``; the gate soaks etcd-v2,
``--full-matrix`` both). By hand:
``python tests/e2e/scripts/chaos_soak.py --minutes 10``. Runs on the newest etcd selected.
Times and counts go to benchmarks/results/recovery.json (``chaos_soak/...``).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from helpers.elastic import Job, assert_groups_never_overlap, exclusive_records, record_timing, steps_of
from helpers.matrix import ETCD_BINARIES, FULL_VERSIONS, version_param

from etcd_server import EtcdCluster
from etcd_store import EtcdStore

MINUTES = float(os.environ.get("ETCD_RDZV_SOAK_MINUTES", "0.75"))
SEED = int(os.environ.get("ETCD_RDZV_SOAK_SEED", "1313"))
SOAK_BACKENDS = [b for b in os.environ.get("ETCD_RDZV_SOAK_BACKENDS", "etcd-v3,etcd-v2").split(",") if b]
STATE_TTL = 10  # the run's state outlives the job by 1.5 x this
STORE_LEASE_TTL = 5
NODES = ("n0", "n1", "n2")
PACE_S = 20.0  # at most this long between one fault's end and the next one

pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(360 + MINUTES * 60 * 2))]


def _newest() -> list[str]:
    """The newest etcd that runs the whole suite (a subset version, such as 3.8's pre-release, would
    deselect the soak from the gate), else the newest selected."""
    def order(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in v.split("."))

    full = sorted((v for v in ETCD_BINARIES if v in FULL_VERSIONS), key=order)
    return (full or sorted(ETCD_BINARIES, key=order))[-1:]


#: The backend the gate (``python -m pytest``, CI) soaks; the others soak under ``--full-matrix``.
GATE_BACKEND = "etcd-v2"


def _param(version: str, backend: str) -> Any:
    return version_param(version, backend, version, id=f"{backend}-etcd{version}", full_matrix=backend != GATE_BACKEND)


PARAMS = [_param(v, b) for v in _newest() for b in SOAK_BACKENDS]


class StoreLoad:
    """Threads doing ``add``/``set``/``get`` on one store prefix until stopped."""

    def __init__(self, endpoints: str, prefix: str, threads: int = 2) -> None:
        self.endpoints = endpoints
        self.prefix = prefix
        self.acked = [0] * threads
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._started = False
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _store(self) -> EtcdStore:
        return EtcdStore(self.endpoints, prefix=self.prefix, timeout=timedelta(seconds=30),
                         lease_ttl=STORE_LEASE_TTL)  # fmt: skip

    def _run(self, i: int) -> None:
        try:
            store = self._store()
        except Exception as e:
            self.errors.append(f"thread {i}: opening the store: {e!r}")
            return
        try:
            n = 0
            while not self._stop.is_set():
                n += 1
                store.add("count", 1)
                self.acked[i] += 1
                store.set(f"w{i}", str(n))
                got = store.get(f"w{i}")
                if got != str(n).encode():
                    self.errors.append(f"thread {i}: set {n} read back {got!r}")
        except Exception as e:
            self.errors.append(f"thread {i} after {self.acked[i]} adds: {e!r}")
        finally:
            store.close()

    def start(self) -> None:
        for t in self._threads:
            t.start()
        self._started = True

    def stop(self) -> None:
        """Stop the threads (each finishes its current call, bounded by the store timeout)."""
        self._stop.set()
        if not self._started:
            return
        for t in self._threads:
            t.join(60)
        assert not any(t.is_alive() for t in self._threads), "a store load thread hangs"

    def count(self) -> int:
        """The counter's value, read by a fresh store."""
        store = self._store()
        try:
            return store.add("count", 0)
        finally:
            store.close()


def _states(job: Job) -> dict[str, dict[int, str]]:
    """Each node's processes and their /proc state letters (a node left stopped shows T)."""
    out: dict[str, dict[int, str]] = {}
    for name, agent in job.nodes.items():
        out[name] = {}
        for pid in sorted(agent.pids()):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/stat", "rb") as f:
                    out[name][pid] = f.read().rpartition(b")")[2].split()[0].decode()
    return out


def _all_keys(client: Any) -> list[Any]:
    return list(client.range(b"\0", b"\0").kvs)


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[EtcdCluster]:
    c = EtcdCluster(3, binary=ETCD_BINARIES[request.param], heartbeat_ms=50, election_timeout_ms=500)
    c.start()
    try:
        yield c
    finally:
        for pid in c.pids:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        c.stop(graceful=False)


@pytest.mark.parametrize(("backend", "cluster"), PARAMS, indirect=["cluster"])
def test_chaos_soak(backend: str, cluster: EtcdCluster, tmp_path: Any) -> None:
    rng = random.Random(f"{SEED}-{backend}")
    say = print
    say(f"\n[soak] seed {SEED} backend {backend} minutes {MINUTES:g} etcd {cluster.version}")
    client = cluster.get_client()
    job = Job(str(tmp_path / "job"), backend=backend, endpoint=cluster.endpoint_string, nnodes="2:3",
              pg_timeout=6, max_restarts=1000, conf={"state_ttl": STATE_TTL, "read_timeout": 10})  # fmt: skip
    load = StoreLoad(cluster.endpoint_string, f"/soak-{uuid.uuid4().hex[:8]}/")
    faults: dict[str, int] = {}
    thaws: list[tuple[str, float]] = []
    leases: set[int] = set()
    recoveries: list[float] = []
    stopped_member: int | None = None
    try:
        for n in NODES:
            job.start(n)
        job.wait_for("a world of 3 training", lambda r: [g for g in steps_of(r) if g.world_size == 3][1:], 240)
        load.start()
        end = time.monotonic() + MINUTES * 60
        kinds = ["kill_node", "stop_node", "kill_member", "stop_member"]
        first = rng.sample(kinds, len(kinds))  # each kind once first, then at random
        while time.monotonic() < end:
            kind = first.pop(0) if first else rng.choice(kinds)
            hold = rng.uniform(1, 5 if kind == "stop_node" else 4 if "member" in kind else 3)
            at = time.time()
            if kind in ("kill_node", "stop_node"):
                name = rng.choice(NODES)
                say(f"[soak] {at:.2f} {kind} {name} for {hold:.1f} s")
                if kind == "kill_node":
                    job.nodes[name].kill()
                    time.sleep(hold)  # the fault's length (a pod restart delay), not a synchronisation
                    job.start(name)
                else:
                    job.nodes[name].freeze()
                    time.sleep(hold)  # the fault's length
                    job.nodes[name].thaw()
                    thaws.append((name, time.time()))
            else:
                i = rng.randrange(3)
                say(f"[soak] {at:.2f} {kind} member {i} for {hold:.1f} s")
                if kind == "kill_member":
                    cluster.stop_member(i, graceful=False)
                    time.sleep(hold)  # the fault's length
                    cluster.start_member(i)
                else:
                    pid = cluster.pids[i]
                    assert pid is not None
                    stopped_member = pid
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(hold)  # the fault's length
                    os.kill(pid, signal.SIGCONT)
                    stopped_member = None
            faults[kind] = faults.get(kind, 0) + 1
            # The next fault comes once the job trains again, or after PACE_S anyway (faults
            # then land on a job still recovering; the end checks that it recovers).
            undone = time.time()
            pace = time.monotonic() + PACE_S
            while len({s.step for s in steps_of(job.records()) if s.t > undone + 0.5}) < 2:
                if time.monotonic() > pace:
                    break
                time.sleep(0.2)  # log polling period
            else:
                recoveries.append(time.time() - undone)
            exited = {n: a.returncode for n, a in job.nodes.items() if not a.running()}
            assert not exited, f"agents exited with etcd at quorum (seed {SEED}): {exited}\n{job.diagnostics()}"
            assert not load.errors, f"store load failed (seed {SEED}): {load.errors}"
            assert_groups_never_overlap(exclusive_records(job.records(), thaws))
            leases.update(kv.lease for kv in _all_keys(client) if kv.lease)
        calm = time.time()
        try:
            job.wait_for(
                f"a world of 3 training after the last fault (seed {SEED})",
                lambda r: len({s.step for s in steps_of(r) if s.t > calm + 0.5 and s.world_size == 3}) >= 2,
                180,
            )
        except AssertionError as e:
            raise AssertionError(f"{e}\nprocess states: {_states(job)}") from None
        final_recovery = time.time() - calm
        load.stop()
        count = load.count()
        acked = sum(load.acked)
        assert not load.errors, f"store load failed (seed {SEED}): {load.errors}"
        assert count == acked, f"counter {count} != {acked} acknowledged adds (seed {SEED})"
        job.finish()
        codes = job.wait_exit(timeout=180)
        assert set(codes.values()) == {0}, f"exit codes {codes} (seed {SEED})\n{job.diagnostics()}"
        records = job.records()
        assert any(r.kind == "done" for r in records), job.diagnostics()
        assert_groups_never_overlap(exclusive_records(records, thaws))
        job.close()  # fails if a process of the job is left
        finished = time.monotonic()
        # Every key and lease goes once the TTLs passed (the run state's 1.5 x state_ttl).
        deadline = finished + 1.5 * STATE_TTL + STORE_LEASE_TTL + 30
        while (left := _all_keys(client)) and time.monotonic() < deadline:
            leases.update(kv.lease for kv in left if kv.lease)
            time.sleep(0.5)  # polling the keyspace against the TTL deadline
        assert not left, f"keys left after the TTLs: {[kv.key for kv in left][:10]}"
        # A lease that lost its keys to a rewrite under another lease lives on until its own TTL, which
        # may end after the last key went: every lease seen must be gone by the same deadline.
        while (alive := [lease for lease in leases if client.lease_time_to_live(lease) != -1]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.5)  # polling the leases against the TTL deadline
        assert not alive, f"leases left after the TTLs: {alive}"
        # A lease granted by a process killed before it attached a key has no key to wait for: it goes
        # at its own TTL. What must hold is that nothing keeps any lease alive once the job is gone.
        while (listed := _etcdctl_leases(cluster)) and time.monotonic() < deadline:
            time.sleep(0.5)  # polling etcd's lease list against the TTL deadline
        if listed:
            ids = _etcdctl_lease_ids(cluster)
            first = {lease: client.lease_time_to_live(lease) for lease in ids}
            time.sleep(2.5)  # two and a half seconds: a kept-alive lease would be back at its TTL
            renewed = [f"{lease:x}" for lease in ids if client.lease_time_to_live(lease) >= first[lease] > 0]
            assert not renewed, f"leases still kept alive after the job ended: {renewed} (of {listed} listed)"
        record_timing(
            f"chaos_soak/{backend}/etcd{'.'.join(cluster.version.split('.')[:2])}",
            {"seed": SEED, "minutes": MINUTES, "faults": dict(sorted(faults.items())),
             "recovered_within_pace": f"{len(recoveries)}/{sum(faults.values())}",
             "recovery_mean_s": round(sum(recoveries) / max(len(recoveries), 1), 2),
             "last_fault_to_world3_training_s": round(final_recovery, 2),
             "store_adds": acked, "groups": len({r.group for r in records}),
             "keys_gone_after_job_s": round(time.monotonic() - finished, 1)},
        )  # fmt: skip
    finally:
        if stopped_member is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped_member, signal.SIGCONT)
        with contextlib.suppress(AssertionError):
            load.stop()
        client.close()
        job.close()


def _etcdctl_lease_ids(cluster: EtcdCluster) -> list[int]:
    """The ids ``etcdctl lease list`` prints (hexadecimal, one per line after the count)."""
    out = _etcdctl(cluster, "lease", "list")
    return [int(line.strip(), 16) for line in out.splitlines()[1:] if line.strip()] if out else []


def _etcdctl(cluster: EtcdCluster, *args: str) -> str:
    """etcdctl's output ('' where no etcdctl is next to etcd, or it failed)."""
    etcdctl = os.path.join(os.path.dirname(cluster.binary), "etcdctl")
    if not os.path.exists(etcdctl):
        etcdctl = shutil.which("etcdctl") or ""
    if not etcdctl:
        return ""
    out = subprocess.run(
        [etcdctl, f"--endpoints={','.join(cluster.client_urls)}", *args],
        capture_output=True, text=True, timeout=30, env={**os.environ, "ETCDCTL_API": "3"},
    )  # fmt: skip
    return out.stdout if out.returncode == 0 else ""


def _etcdctl_leases(cluster: EtcdCluster) -> int | None:
    """How many leases ``etcdctl lease list`` finds (None where no etcdctl is next to etcd)."""
    etcdctl = os.path.join(os.path.dirname(cluster.binary), "etcdctl")
    if not os.path.exists(etcdctl):
        etcdctl = shutil.which("etcdctl") or ""
    if not etcdctl:
        return None
    out = subprocess.run(
        [etcdctl, f"--endpoints={','.join(cluster.client_urls)}", "lease", "list"],
        capture_output=True, text=True, timeout=30, env={**os.environ, "ETCDCTL_API": "3"},
    )  # fmt: skip
    first = out.stdout.split()
    return int(first[1]) if out.returncode == 0 and len(first) > 1 and first[0] == "found" else None
