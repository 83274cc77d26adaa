"""EtcdStore across processes: gloo process groups, torch's elastic store helpers, exact
counters under contention, and the cleanup rule when a job crashes.

The process side is this file run as a script: ``launch`` imports torch once and
forks the workers of one job, ``hold`` joins a namespace and waits to be killed.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

WORLD = 4
INCREMENTS = 40  # per process: half by add, half by compare_set loops, over 2 threads
# Run as a script too (the child processes), so no import of the test helpers here.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --------------------------------------------------------------------------- worker side


def _worker(endpoint: str, prefix: str, rank: int) -> dict[str, Any]:
    started = time.monotonic()
    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
    from torch.distributed.elastic.utils import store as store_util

    from etcd_store import EtcdStore

    timeout = datetime.timedelta(seconds=120)
    store = EtcdStore(endpoint, prefix=prefix, timeout=timeout)
    out: dict[str, Any] = {"rank": rank, "seconds": {}}
    clock = [started]

    def phase(name: str) -> None:
        now = time.monotonic()
        out["seconds"][name] = round(now - clock[0], 2)
        clock[0] = now

    # Contention: every process and thread increments the same counters.
    phase("imports and store")
    store_util.barrier(store, WORLD, "start", barrier_timeout=120)
    phase("start barrier")

    def increment(s: EtcdStore, tag: str) -> None:
        for i in range(INCREMENTS // 4):
            s.add("by_add", 1)
            # A counter kept with compare_set only; values carry a unique tag so that
            # "compare_set returned my desired value" means "my swap happened".
            while True:
                current = s.get("by_cas")
                desired = f"{int(current.split(b':')[0]) + 1}:{tag}:{i}"
                if s.compare_set("by_cas", current, desired) == desired.encode():
                    break

    if rank == 0:
        store.compare_set("by_cas", "", "0:init")
    store.wait(["by_cas"])
    threads = [
        threading.Thread(target=increment, args=(store.clone(), f"{rank}.{n}")) for n in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    phase("contention")
    store_util.barrier(store, WORLD, "counted", barrier_timeout=120)
    phase("barrier")
    out["by_add"] = int(store.get("by_add"))
    out["by_cas"] = int(store.get("by_cas").split(b":")[0])

    # torch's elastic helpers.
    out["synchronize"] = [
        v.decode() for v in store_util.synchronize(store, f"data{rank}".encode(), rank, WORLD, "sync/", 120)
    ]
    info = RendezvousStoreInfo.build(rank, store, local_addr="127.0.0.1", server_port=29555 + rank)
    out["store_info"] = [info.master_addr, info.master_port]
    phase("elastic helpers")

    # A gloo process group bootstrapped on the store (gloo calls it from C++ threads).
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    phase("init_process_group")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["all_reduce"] = t.item()
    b = torch.tensor([rank * 10])
    dist.broadcast(b, src=2)
    out["broadcast"] = int(b.item())
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, {"rank": rank})
    out["all_gather_object"] = gathered
    dist.barrier()
    sub = dist.new_group([1, 3])  # a second group: more store traffic through PrefixStore
    if rank in (1, 3):
        s = torch.tensor([rank])
        dist.all_reduce(s, group=sub)
        out["subgroup"] = int(s.item())
    dist.barrier()
    dist.destroy_process_group()
    phase("collectives")
    store.close()
    return out


def _hold(endpoint: str, prefix: str) -> None:
    """Join a namespace (default lease_ttl), write keys, say so, then wait to be killed."""
    from etcd_store import EtcdStore

    store = EtcdStore(endpoint, prefix=prefix)
    store.set("written-by-child", "1")
    store.queue_push("q", "item")
    store.set("big", b"x" * (2 * 1024 * 1024))
    print("ready", flush=True)
    sys.stdin.read()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


# --------------------------------------------------------------------------- tests


def _launch(endpoint: str, prefix: str) -> None:
    """Import torch once, then fork WORLD worker processes; print their reports as JSON.

    Forking after the imports (and before any etcd client or thread exists) spares
    three torch imports per job; each worker then builds its own store, client and
    gloo process group, as separate torchrun workers would.
    """
    import torch.distributed  # noqa: F401 - imported once, before forking
    from torch.distributed.elastic.utils import store  # noqa: F401

    import etcd_store.store  # noqa: F401

    children = []
    for rank in range(WORLD):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            code = 1
            try:
                report = json.dumps(_worker(endpoint, prefix, rank)).encode()
                os.write(write_end, report)
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(write_end)
        children.append((pid, read_end))
    reports = []
    for rank, (pid, read_end) in enumerate(children):
        with os.fdopen(read_end, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        reports.append(json.loads(data) if status == 0 else {"rank": rank, "failed": status})
    print(json.dumps(reports), flush=True)


@pytest.fixture(scope="module")
def job(etcd_endpoint: str) -> Iterator[list[dict[str, Any]]]:
    """Run WORLD worker processes once per etcd version; their reports, by rank."""
    prefix = f"mp/{uuid.uuid4().hex[:8]}"
    proc = subprocess.run(
        [sys.executable, __file__, "launch", etcd_endpoint, prefix],
        capture_output=True, env=_env(), cwd=REPO, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = [r for r in reports if "failed" in r]
    assert not failed, f"workers failed: {failed}\n{proc.stderr[-3000:]}"
    yield reports


def test_counters_are_exact_under_contention(job: list[dict[str, Any]]) -> None:
    # WORLD processes x 2 threads x INCREMENTS/4 each, for both counters.
    expected = WORLD * 2 * (INCREMENTS // 4)
    assert [r["by_add"] for r in job] == [expected] * WORLD
    assert [r["by_cas"] for r in job] == [expected] * WORLD


def test_gloo_process_group_on_the_store(job: list[dict[str, Any]]) -> None:
    assert [r["all_reduce"] for r in job] == [10.0] * WORLD
    assert [r["broadcast"] for r in job] == [20] * WORLD
    assert all(r["all_gather_object"] == [{"rank": i} for i in range(WORLD)] for r in job)
    assert [r.get("subgroup") for r in job] == [None, 4, None, 4]


def test_torch_elastic_store_helpers(job: list[dict[str, Any]]) -> None:
    assert all(r["synchronize"] == [f"data{i}" for i in range(WORLD)] for r in job)
    assert [r["store_info"] for r in job] == [["127.0.0.1", 29555]] * WORLD


def _namespace_count(client: Any, prefix: str) -> int:
    ns = prefix.encode()
    # ns/... (user keys and queues) and ns\0... (lease, chunks, markers).
    return int(client.range(ns + b"\0", ns + b"0", count_only=True).count)


def _deleted_within(client: Any, prefix: str, seconds: float) -> bool:
    """Watch the namespace until it is empty (True) or ``seconds`` pass (False)."""
    ns = prefix.encode()
    start, end = ns + b"\0", ns + b"0"  # ns/... (keys, queues) and ns\0... (lease, chunks, markers)
    res = client.range(start, end, count_only=True)
    if res.count == 0:
        return True
    deadline = time.monotonic() + seconds
    with client.watch(start, end, start_revision=res.revision + 1) as watch:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if watch.get(timeout=remaining) and client.range(start, end, count_only=True).count == 0:
                return True


def test_a_crashed_jobs_namespace_expires_after_the_lease_ttl(etcd_endpoint: str) -> None:
    from etcd_store import EtcdStore
    from etcd_store.client import EtcdClient

    prefix = f"crash/{uuid.uuid4().hex[:8]}"
    client = EtcdClient(etcd_endpoint)
    # This store creates the namespace lease with a 2 s TTL.
    local = EtcdStore(client, prefix=prefix, lease_ttl=2)
    local.set("written-by-parent", "2")
    # The child joins with the default lease_ttl (1 hour): it must refresh at the
    # pace of the lease it adopted, not of its own setting.
    child = subprocess.Popen(
        [sys.executable, __file__, "hold", etcd_endpoint, prefix],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=REPO,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip() == "ready", child.stderr.read() if child.stderr else line
        assert local.get("written-by-child") == b"1"
        # Two live users: the namespace outlives its TTL.
        assert not _deleted_within(client, prefix, 4.0)
        local.close()  # like a crash for etcd: close() stops the keep-alive, revokes nothing
        # One live user (the child) still keeps it.
        assert not _deleted_within(client, prefix, 3.0)
        assert client.get(prefix.encode() + b"/written-by-parent") is not None
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        # The last user crashed: etcd deletes the whole namespace one TTL later.
        assert _deleted_within(client, prefix, 15.0)
        assert _namespace_count(client, prefix) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        local.close()
        client.close()


if __name__ == "__main__":
    mode, endpoint_arg, prefix_arg = sys.argv[1:4]
    if mode == "launch":
        _launch(endpoint_arg, prefix_arg)
    else:
        _hold(endpoint_arg, prefix_arg)
