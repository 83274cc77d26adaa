"""Running processes read from /proc, for leak checks: etcd processes, whether a pid is alive."""

from __future__ import annotations

import os


def _is_etcd(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # "pid (comm) state ...": comm may contain spaces/parens, split at the last ")"
        comm = stat[stat.index(b"(") + 1 : stat.rindex(b")")]
        state = stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3]
    except (OSError, ValueError):
        return False
    return comm == b"etcd" and state not in (b"Z", b"X")


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def etcd_pids(descendants_of: int | None = None) -> set[int]:
    """PIDs of running (non-zombie) etcd processes, read from /proc.

    With ``descendants_of``, only those whose parent chain reaches that pid
    (e.g. ``os.getpid()`` for "started by this test process").
    """
    pids: set[int] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for entry in entries:
        if entry.isdigit() and _is_etcd(int(entry)):
            pids.add(int(entry))
    if descendants_of is None:
        return pids
    result: set[int] = set()
    for pid in pids:
        p: int | None = pid
        for _ in range(64):
            p = _ppid(p) if p else None
            if p is None or p <= 1:
                break
            if p == descendants_of:
                result.add(pid)
                break
    return result


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] not in (b"Z", b"X")
