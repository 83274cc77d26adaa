"""The fixed cost of idle ``EtcdClient`` objects in one process (B2 with a client per node).

``python -m benchmarks.client_cost K [--interval S] [--watches W] [--window S]``
starts one etcd (``etcd_server``), makes ``K`` clients in this process, each connected (one
Range) with one lease kept alive every ``--interval`` seconds and ``--watches`` idle watches,
then prints the CPU this process and etcd spent per second of ``--window`` while nothing else
happens, the threads (Python threads and the OS threads of the process) and the TCP
connections this process holds to etcd. Nothing here asserts; it prints one line.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import threading
import time

log = logging.getLogger(__name__)


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_pid(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _os_threads() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def _connections(port: int) -> int:
    """Established TCP connections of this process to ``port`` (from /proc: socket inodes)."""
    inodes = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "01" and int(cols[2].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    mine = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            mine += 1
    return mine


def measure(k: int, interval: float, watches: int, window: float) -> dict[str, float]:
    """CPU per second (this process, etcd) and threads of ``k`` idle clients; see the module docstring."""
    from etcd_server import EtcdServer
    from etcd_store.client import EtcdClient, Session

    with EtcdServer() as server:
        pid = server.pid
        assert pid is not None
        clients = [EtcdClient(server.get_endpoint()) for _ in range(k)]
        try:
            t0 = time.monotonic()
            for c in clients:
                c.range(b"/bench/client-cost")
            connect_s = time.monotonic() - t0
            sessions = [Session(c, 15, interval=interval) for c in clients]
            open_watches = [c.watch(b"/bench/client-cost/quiet") for c in clients for _ in range(watches)]
            time.sleep(max(interval, 1.0) + 1.0)  # every keep-alive stream is open (not a synchronisation)
            mine, etcd, t0 = _cpu_self(), _cpu_pid(pid), time.monotonic()
            time.sleep(window)
            dt = time.monotonic() - t0
            out = {"clients": k, "interval_s": interval, "watches_per_client": watches, "connect_s": connect_s,
                   "process_cores": (_cpu_self() - mine) / dt, "etcd_cores": (_cpu_pid(pid) - etcd) / dt,
                   "python_threads": threading.active_count(), "os_threads": _os_threads(),
                   "connections": _connections(int(server.get_endpoint().rsplit(":", 1)[1]))}
            for w in open_watches:
                w.cancel()
            for s in sessions:
                s.close(revoke=False)
        finally:
            for c in clients:
                c.close()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.client_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("clients", type=int)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between keep-alives (default 1)")
    p.add_argument("--watches", type=int, default=1, help="idle watches per client (default 1)")
    p.add_argument("--window", type=float, default=6.0, help="seconds measured (default 6)")
    args = p.parse_args(argv)
    r = measure(args.clients, args.interval, args.watches, args.window)
    per = 1000.0 / max(r["clients"], 1)
    print(f"{r['clients']} clients, keep-alive every {r['interval_s']:g} s, {r['watches_per_client']} watch(es) each"
          f": this process {r['process_cores']:.3f} cores "
          f"({r['process_cores'] * per:.2f} ms CPU per client per s), etcd {r['etcd_cores']:.3f} cores; "
          f"{r['python_threads']} Python threads, {r['os_threads']} OS threads; {r['connections']} TCP connection(s) "
          f"to etcd; connect {r['connect_s']:.2f} s")


if __name__ == "__main__":
    main()
