"""The fixed cost of idle ``EtcdClient`` objects in one process (B2 with a client per node).

``python -m benchmarks.client_cost K [--interval S] [--watches W] [--window S] [--no-grpc-poll]``
starts one etcd (``etcd_server``), makes ``K`` clients in this process, each connected (one
Range) with one lease kept alive every ``--interval`` seconds and ``--watches`` idle watches,
then prints the CPU this process and etcd spent per second of ``--window`` while nothing else
happens, and the threads (Python threads and the OS threads of the process).

``--no-grpc-poll`` is a diagnosis, not a setting: it raises grpc's
``_common.MAXIMUM_WAIT_TIMEOUT`` (0.1 s: every thread blocked on a stream's next message
wakes ten times a second to let signal handlers run) for this process only, to show what
that poll costs. Nothing here asserts; it prints one line.
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
                   "python_threads": threading.active_count(), "os_threads": _os_threads()}
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
    p.add_argument("--no-grpc-poll", action="store_true", help="diagnosis: no 10 Hz poll of blocked stream readers")
    args = p.parse_args(argv)
    if args.no_grpc_poll:
        import grpc._common

        grpc._common.MAXIMUM_WAIT_TIMEOUT = 3600.0
    r = measure(args.clients, args.interval, args.watches, args.window)
    per = 1000.0 / max(r["clients"], 1)
    print(f"{r['clients']} clients, keep-alive every {r['interval_s']:g} s, {r['watches_per_client']} watch(es) each"
          f"{', no grpc poll' if args.no_grpc_poll else ''}: this process {r['process_cores']:.3f} cores "
          f"({r['process_cores'] * per:.2f} ms CPU per client per s), etcd {r['etcd_cores']:.3f} cores; "
          f"{r['python_threads']} Python threads, {r['os_threads']} OS threads; connect {r['connect_s']:.2f} s")


if __name__ == "__main__":
    main()
