"""Shared pieces of the benchmarks: statistics, etcd snapshots, machine facts, contender names.

Statistics convention (every benchmark follows it):

* A benchmark repeats a measurement ``reps`` times ("runs"); within a run the
  contenders are measured one after the other in an order that rotates from run
  to run (so a slow period of the shared machine hits every contender alike).
* A figure is the median over all samples, with its *spread*: the lowest and
  highest per-run median (``lo``-``hi``).
* A ratio A/B is computed inside each run (both measured minutes apart at most)
  and the reported ratio is the median of the per-run ratios, with their range.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# Contender keys, in display order, and their display names.
OURS_STORE = "EtcdStore"
TORCH_V2_STORE = "torch v2 EtcdStore"
TCP_STORE = "TCPStore"
FLOOR = "floor"
FLOOR_BARRIER = "floor-barrier"

C10D = "c10d"
TORCH_ETCD_V2 = "torch etcd-v2"
OURS_ETCD_V2 = "etcd-v2"
OURS_ETCD_V3 = "etcd-v3"
#: This package's etcd-v2 with issue 29's rules undone (B3's before/after; only when --contenders names it).
OURS_ETCD_V2_BEFORE = "etcd-v2-before"
OURS_ETCD_V2_FAST = "etcd-v2-fast"
EXTRA_CONTENDERS = (OURS_ETCD_V2_BEFORE, OURS_ETCD_V2_FAST)

RDZV_CONTENDERS = (C10D, TORCH_ETCD_V2, OURS_ETCD_V2, OURS_ETCD_V3, FLOOR, FLOOR_BARRIER)
# The B2-only contenders that are no rendezvous handler (B3 and B4 leave them out).
FLOORS = (FLOOR, FLOOR_BARRIER)
STORE_CONTENDERS = (OURS_STORE, TORCH_V2_STORE, TCP_STORE, FLOOR)

DESCRIPTIONS = {
    OURS_STORE: "etcd_store.EtcdStore (this package, etcd v3 API, gRPC)",
    TORCH_V2_STORE: "torch.distributed.elastic.rendezvous.etcd_store.EtcdStore (v2 API, python-etcd, HTTP)",
    TCP_STORE: "torch.distributed.TCPStore (server in the benchmark process)",
    FLOOR: "bare etcd_store.client.EtcdClient calls doing the same work (B2: one Put per node, then a "
           "prefix watch until N keys exist: every node receives every later join, O(N²) events in all)",
    FLOOR_BARRIER: "B2's O(N) barrier floor: per node a watch on one `go` key (from now), then one Txn "
                   "[count the joined keys, put mine] whose count is its rank; the N-th node puts `go` "
                   "(one event per waiting node)",
    C10D: "torch's c10d handler (DynamicRendezvousHandler over a TCPStore hosted by the benchmark)",
    TORCH_ETCD_V2: "torch's built-in etcd-v2 (DynamicRendezvousHandler + EtcdRendezvousBackend, v2 API)",
    OURS_ETCD_V2: "this package's etcd-v2 (DynamicRendezvousHandler over the etcd v3 API)",
    OURS_ETCD_V3: "this package's etcd-native etcd-v3 handler",
    OURS_ETCD_V2_BEFORE: "this package's etcd-v2 as before issue 29 (the last member's exit ends a sealed round; "
                         "heartbeat refresh after the keep-alive timer starts; member expiry padded by one interval)",
    OURS_ETCD_V2_FAST: "this package's etcd-v2 with fast_recovery=true (opt-in, a deviation from torch: a "
                       "re-forming round completes once every live node it knows joined, no last call)",
}


def say(msg: str) -> None:
    """Progress line on stderr (the benchmarks' only chatter)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN when empty."""
    if not values:
        return float("nan")
    data = sorted(values)
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


@dataclass
class Series:
    """Samples of one figure, grouped by run."""

    runs: list[list[float]] = field(default_factory=list)

    def add_run(self, samples: Iterable[float]) -> None:
        self.runs.append([float(s) for s in samples])

    @property
    def samples(self) -> list[float]:
        return [s for run in self.runs for s in run]

    def run_medians(self) -> list[float]:
        return [statistics.median(r) for r in self.runs if r]

    def summary(self, scale: float = 1.0) -> dict[str, Any]:
        """``median``, ``p99``, ``lo``/``hi`` (range of per-run medians), ``n``, ``runs``."""
        all_samples = self.samples
        meds = self.run_medians()
        if not all_samples:
            return {"median": None, "p99": None, "lo": None, "hi": None, "n": 0, "runs": 0}
        return {
            "median": statistics.median(all_samples) * scale,
            "p99": percentile(all_samples, 99) * scale,
            "lo": min(meds) * scale,
            "hi": max(meds) * scale,
            "n": len(all_samples),
            "runs": len(meds),
        }


def ratio_summary(numer: Series, denom: Series) -> dict[str, Any] | None:
    """Median of the per-run ratios of per-run medians (runs paired by index)."""
    ratios = [
        statistics.median(a) / statistics.median(b)
        for a, b in zip(numer.runs, denom.runs, strict=False)
        if a and b and statistics.median(b) > 0
    ]
    if not ratios:
        return None
    return {"ratio": statistics.median(ratios), "lo": min(ratios), "hi": max(ratios), "runs": len(ratios)}


def rotated(items: Sequence[str], rep: int) -> list[str]:
    """``items`` rotated by ``rep`` (the alternation of contenders between runs)."""
    if not items:
        return []
    k = rep % len(items)
    return list(items[k:]) + list(items[:k])


# --------------------------------------------------------------------------- etcd


def start_etcd(binary: str | None = None, *, enable_v2: bool | None = None) -> Any:
    """Start a fresh single-member etcd (v2 API on where the binary has it, so torch's
    built-ins can use it too; ``enable_v2`` forces it on or off).

    Returns the started :class:`etcd_server.EtcdServer`; the caller stops it. etcd 3.6+
    has no v2 API: the v2 contenders then fail with etcd's answer, the others run.
    """
    from etcd_server import EtcdServer
    from etcd_server.binary import etcd_version, find_etcd_binary, has_v2_api

    if enable_v2 is None:
        enable_v2 = has_v2_api(etcd_version(find_etcd_binary(binary)))
    server = EtcdServer(binary=binary, enable_v2=enable_v2)
    server.start(timeout=60)
    return server


class EtcdFarm:
    """One etcd per contender (same binary, same flags, v2 API on), started lazily.

    Separate servers keep one contender's traffic out of another's counters: a
    v2 key with a TTL (torch's built-in backend writes one) makes the etcd leader
    propose a SYNC raft entry twice a second for as long as it exists.
    """

    def __init__(self, binary: str | None = None) -> None:
        self.binary = binary
        self.servers: dict[str, Any] = {}

    def get(self, contender: str) -> Any:
        server = self.servers.get(contender)
        if server is None:
            server = start_etcd(self.binary)
            self.servers[contender] = server
        return server

    def stop(self) -> None:
        for server in self.servers.values():
            try:
                server.stop()
            except Exception as e:  # keep stopping the others
                log.warning("stopping %r failed: %s", server, e)
        self.servers.clear()

    def __enter__(self) -> EtcdFarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def etcd_snapshot(server: Any) -> dict[str, int | None]:
    """Counters of one etcd: v3 ``revision``, ``raft_index`` (every write, v2 and v3,
    lease grants and revokes), ``db_size`` (bytes of the v3 bbolt file) and
    ``v2_index`` (the v2 store's index, None when the v2 API is off).

    Read through the server's JSON gateway and the v2 HTTP API, so the snapshot
    costs no RPC on the clients being measured.
    """
    status = server.gateway_call("/v3/maintenance/status", {})
    snap: dict[str, int | None] = {
        "revision": int(status["header"]["revision"]),
        "raft_index": int(status.get("raftIndex", 0)),
        "db_size": int(status.get("dbSize", 0)),
        "v2_index": None,
    }
    if getattr(server, "enable_v2", False):
        try:
            with urllib.request.urlopen(f"{server.get_client_url()}/v2/keys/", timeout=5) as resp:
                snap["v2_index"] = int(resp.headers.get("X-Etcd-Index", "0"))
        except OSError as e:
            log.warning("could not read the v2 index: %s", e)
    return snap


def snapshot_delta(before: dict[str, int | None], after: dict[str, int | None]) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for k, v in before.items():
        w = after.get(k)
        out[k] = None if v is None or w is None else w - v
    return out


# --------------------------------------------------------------------------- availability


def ours_store_missing() -> str | None:
    """None when ``etcd_store.store.EtcdStore`` imports, else why not."""
    try:
        from etcd_store.store import EtcdStore  # noqa: F401
    except Exception as e:  # ImportError, or a half-written module
        return f"etcd_store.store not importable: {type(e).__name__}: {e}"
    return None


def ours_handler_missing(backend: str) -> str | None:
    """None when torch's registry maps ``backend`` to this package's creator, else why not."""
    try:
        from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as reg
    except Exception as e:
        return f"torch rendezvous registry: {e}"
    creator = getattr(reg, "_registry", {}).get(backend)
    if creator is None:
        return f"no {backend!r} handler registered (torchrun.handlers entry point missing)"
    module = getattr(creator, "__module__", "") or ""
    if not module.startswith("etcd_rdzv"):
        return f"{backend!r} resolves to {module or creator!r}, not to etcd_rdzv"
    return None


# --------------------------------------------------------------------------- machine facts


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def raise_fd_limit() -> None:
    """Raise this process's soft limit of open files to the hard limit (B2 at N = 4096
    opens a connection per node, in the workers and in etcd, which inherits it)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = 65536 if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError) as e:  # pragma: no cover - non-Linux or not allowed
        log.debug("could not raise the open-files limit: %s", e)


def machine_facts(etcd_binary: str | None, label: str | None) -> dict[str, Any]:
    """CPU, cores, memory, OS, versions of everything measured, and the git commit."""
    from etcd_server import etcd_version, find_etcd_binary

    binary = find_etcd_binary(etcd_binary)
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    cores = usable_cores()
    cpu = _cpu_model()
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {
        "machine": label or f"{cores}-core {cpu}",
        "cpu": cpu,
        "cores": cores,
        "memory_gib": mem_gib,
        "os": f"{platform.system()} {platform.release()}",
        "loadavg_at_start": [round(x, 2) for x in load],
        "python": platform.python_version(),
        "versions": {
            "torch": _version("torch"),
            "grpcio": _version("grpcio"),
            "protobuf": _version("protobuf"),
            "python-etcd": _version("python-etcd"),
            "python3-etcd3": _version("python3-etcd3"),
            "etcd-rdzv": _version("etcd-rdzv"),
            "etcd": etcd_version(binary),
        },
        "etcd_binary": binary,
        "git_commit": commit,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_json(path: str, data: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)
