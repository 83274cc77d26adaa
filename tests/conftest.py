"""Shared pytest fixtures and the matrix rules: real etcd servers of the version matrix
(tests/helpers/etcd_versions.py, tests/helpers/matrix.py) and leak checks.

Fixtures:

* ``etcd_binary``: parametrized over the selected versions (ids ``etcd3.4`` ... ``etcd3.8``); on
  ``3.4``/``3.5``/``3.6``/``3.8`` only tests marked ``@pytest.mark.etcd_matrix`` run
  (``@pytest.mark.etcd_matrix("3.6")``: on those subset versions named only).
* ``etcd_server``: module-scoped started :class:`etcd_server.EtcdServer`,
  parametrized over the binaries; stopped at module teardown.
* ``etcd_endpoint``: module-scoped ``etcd_server.get_endpoint()``.
* ``fresh_etcd``: a new started server per test (free to stop/restart).

Test modules import the matrix names (``ETCD_BINARIES``, ``FULL_VERSIONS``, ``SELECTED``,
``version_param``) from ``helpers.matrix`` and the process checks (``etcd_pids``, ``pid_alive``) from
``helpers.processes``; they are re-exported here only for older imports.

No torch import here.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
import warnings
from collections.abc import Iterator

import pytest
from helpers import REPO_ROOT, etcd_versions, installed
from helpers.matrix import ETCD_BINARIES, FULL_MATRIX_ENV, FULL_VERSIONS, SELECTED, version_param
from helpers.processes import etcd_pids, pid_alive

from etcd_server import EtcdServer

__all__ = ["ETCD_BINARIES", "FULL_VERSIONS", "SELECTED", "etcd_pids", "pid_alive", "version_param"]


_VERSION_PARAMS = [version_param(v) for v in SELECTED]
_TESTED = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full-matrix", action="store_true", default=os.environ.get(FULL_MATRIX_ENV, "") not in ("", "0"),
        help=(
            "also run the items marked full_matrix: each end-to-end scenario on every backend and version"
            f" it has (the gate runs each once; ${FULL_MATRIX_ENV}=1 does the same)"
        ),
    )


def pytest_configure(config: pytest.Config) -> None:
    """The markers; and a refusal to start when the installed etcd-rdzv is not this checkout's code
    (:func:`helpers.installed.check`: a stale install); pytest's header says what is tested."""
    if not hasattr(config, "workerinput"):  # (an xdist worker: the controller checked)
        try:
            config.stash[_TESTED] = installed.check(REPO_ROOT)
        except installed.NotThisCheckout as e:
            raise pytest.UsageError(str(e)) from None
    config.addinivalue_line("markers", "etcd_version(v): the etcd version a parametrized test runs on")
    subset = ", ".join(etcd_versions.SUBSET)
    config.addinivalue_line(
        "markers", f"etcd_matrix(*versions): also run on the subset versions ({subset}), or on those named")
    config.addinivalue_line(
        "markers",
        "full_matrix(*versions): runs only in the full matrix (--full-matrix), on the etcd versions named or"
        " on all; the gate runs the scenario another way (another backend, version or signal)",
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    missing = [v for v in SELECTED if v not in ETCD_BINARIES]
    if missing and os.environ.get("CI", "").lower() == "true":
        raise pytest.UsageError(
            "CI=true and the etcd test matrix is incomplete: "
            + "; ".join(etcd_versions.missing_message(v) for v in missing)
        )


def pytest_report_header(config: pytest.Config) -> list[str]:
    rows = [f"{v}: {ETCD_BINARIES.get(v, 'MISSING')}" for v in SELECTED]
    tested = [config.stash[_TESTED]] if _TESTED in config.stash else []
    return [*tested, f"etcd matrix (${etcd_versions.ENV_VAR}, whole suite on {', '.join(FULL_VERSIONS)}): "
            + "; ".join(rows)]


def _full_matrix_only(item: pytest.Item) -> bool:
    """Whether ``item`` runs only under ``--full-matrix``: marked ``full_matrix`` without arguments,
    or ``full_matrix(*versions)`` naming one of its etcd versions."""
    mark = item.get_closest_marker("full_matrix")
    if mark is None:
        return False
    versions = {m.args[0] for m in item.iter_markers("etcd_version")}
    return not mark.args or bool(versions & set(mark.args))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect subset-version items not marked ``etcd_matrix`` (or of versions its arguments do not
    name), and items marked ``full_matrix`` unless ``--full-matrix``; skip those of a missing binary."""
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    full = config.getoption("--full-matrix")
    for item in items:
        if not full and _full_matrix_only(item):
            dropped.append(item)
            continue
        versions = {m.args[0] for m in item.iter_markers("etcd_version")}
        matrix = item.get_closest_marker("etcd_matrix")
        subset = versions & set(etcd_versions.SUBSET)
        if subset and (matrix is None or (matrix.args and not subset & set(matrix.args))):
            dropped.append(item)
            continue
        absent = sorted(v for v in versions if v not in ETCD_BINARIES)
        if absent:
            item.add_marker(pytest.mark.skip(reason=etcd_versions.missing_message(absent[0])))
        keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


# etcdctl's variables of the developer's shell would change what the plugin connects to
# (etcd_rdzv/conf_env.py): the suite runs without them; tests set the ones they check.
for _name in [n for n in os.environ if n.startswith("ETCDCTL_")]:
    del os.environ[_name]


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


@pytest.fixture(params=_VERSION_PARAMS)
def etcd_binary(request: pytest.FixtureRequest) -> str:
    """Path of an etcd binary; the test runs once per available version."""
    return ETCD_BINARIES[request.param]


#: tmpfs, where the machine has one: the shared servers' data lives in memory.
RAM_DIR = "/dev/shm"


@pytest.fixture(scope="module", params=_VERSION_PARAMS)
def etcd_server(request: pytest.FixtureRequest) -> Iterator[EtcdServer]:
    """A started :class:`EtcdServer` shared by a module, once per etcd version.

    Its data lives in :data:`RAM_DIR` where that is writable: the module's tests check the protocol,
    not the disk, and some hold etcd to a 1 s deadline (a 200 ms store's floor), which a disk stall
    beside cold torch imports could break (the store conformance tests once answered "no answer from
    etcd within 1 s" twice in one CI phase; not reproduced). Per-test servers (:func:`fresh_etcd`) keep
    the server's own temporary directory: their tests stop and restart it."""
    ram = os.path.isdir(RAM_DIR) and os.access(RAM_DIR, os.W_OK)
    data_dir = tempfile.mkdtemp(prefix="etcd-rdzv-test-", dir=RAM_DIR) if ram else None
    server = EtcdServer(data_dir, binary=ETCD_BINARIES[request.param])
    try:
        server.start(timeout=30)
        yield server
    finally:
        server.stop()
        if data_dir is not None:
            shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def etcd_endpoint(etcd_server: EtcdServer) -> str:
    """``"127.0.0.1:PORT"`` of the module's :func:`etcd_server`."""
    return etcd_server.get_endpoint()


@pytest.fixture(params=_VERSION_PARAMS)
def fresh_etcd(request: pytest.FixtureRequest) -> Iterator[EtcdServer]:
    """A new started :class:`EtcdServer` per test; stop/restart it at will."""
    server = EtcdServer(binary=ETCD_BINARIES[request.param])
    server.start(timeout=30)
    try:
        yield server
    finally:
        server.stop()
