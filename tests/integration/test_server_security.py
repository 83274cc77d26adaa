"""``etcd_server`` hardening (issue 23, item 6): the auth set-up refuses users and roles that someone
added before auth was on and resets the passwords of the users it expects; ``python -m etcd_server``
serves TLS and auth from options, passwords from files.

Issue 32, item 1: with TLS the peer port serves TLS and requires a peer certificate (a local user reads
no ``/members``, no lease, no raft stream); auth, users and roles are in place before the client port
first accepts a connection (set up over a private unix socket), and a write during the set-up stops it."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO_ROOT
from helpers.certs import CertPaths, have_openssl, make_certs

import etcd_server.cluster as cluster_module
from etcd_server import AuthConfig, EtcdCluster, EtcdServer, TLSConfig
from etcd_server.__main__ import main as server_main
from etcd_server.gateway import EtcdGatewayError, Gateway
from etcd_server.process import free_ports
from etcd_store.client import EtcdClient
from etcd_store.errors import EtcdAuthError, EtcdError, EtcdPermissionDenied

pytestmark = [pytest.mark.timeout(180), pytest.mark.etcd_matrix("3.6")]  # issue 23: each finding on etcd 3.7 and 3.6

ROOT_PW, ALICE_PW = "r00t-srv-sec-pw", "al1ce-srv-sec-pw"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    if not have_openssl():
        pytest.skip("openssl command not available")
    return make_certs(tmp_path_factory.mktemp("server-sec-certs"))


def _plant(data_dir: str, binary: str, *users: tuple[str, str], roles: tuple[str, ...] = ()) -> None:
    """What a client that reached the port before auth was enabled could leave behind."""
    with EtcdServer(data_dir, binary=binary) as plain:
        for name, password in users:
            plain.gateway_call("/v3/auth/user/add", {"name": name, "password": password})
        for role in roles:
            plain.gateway_call("/v3/auth/role/add", {"name": role})


def test_auth_set_up_refuses_a_user_added_before_auth_was_on(etcd_binary: str, tmp_path: Path) -> None:
    data_dir = str(tmp_path / "data")
    _plant(data_dir, etcd_binary, ("mallory", "m4llory-pw"))
    server = EtcdServer(data_dir, binary=etcd_binary, auth=AuthConfig(ROOT_PW, user="alice", password=ALICE_PW))
    try:
        with pytest.raises(EtcdGatewayError, match=r"did not create.*users \['mallory'\]"):
            server.start(timeout=30)
    finally:
        server.stop()


def test_auth_set_up_refuses_a_role_added_before_auth_was_on(etcd_binary: str, tmp_path: Path) -> None:
    data_dir = str(tmp_path / "data")
    _plant(data_dir, etcd_binary, roles=("wide",))  # no user holds it: a role alone is refused
    server = EtcdServer(data_dir, binary=etcd_binary, auth=AuthConfig(ROOT_PW, user="alice", password=ALICE_PW))
    try:
        with pytest.raises(EtcdGatewayError, match=r"did not create.*: roles \['wide'\]; refusing") as info:
            server.start(timeout=30)
        assert "users [" not in str(info.value)
    finally:
        server.stop()


def test_a_user_planted_before_auth_gets_the_configured_password(etcd_binary: str, tmp_path: Path) -> None:
    data_dir = str(tmp_path / "data")
    _plant(data_dir, etcd_binary, ("alice", "att4cker-pw"), ("root", "att4cker-root"))
    auth = AuthConfig(ROOT_PW, user="alice", password=ALICE_PW, prefix=b"/jobs/alice/")
    with EtcdServer(data_dir, binary=etcd_binary, auth=auth) as server:
        with server.get_client(user="alice", password=ALICE_PW, timeout=10) as alice:
            alice.put(b"/jobs/alice/k", b"1")
        for user, password in (("alice", "att4cker-pw"), ("root", "att4cker-root")):
            with server.get_client(user=user, password=password, timeout=10) as attacker:
                with pytest.raises(EtcdAuthError):
                    attacker.get(b"/jobs/alice/k")


@pytest.fixture
def secrets(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "root-pw").write_text(ROOT_PW + "\n")
    (tmp_path / "alice-pw").write_text(ALICE_PW + "\n")
    return {"root": str(tmp_path / "root-pw"), "alice": str(tmp_path / "alice-pw")}


def _serve(args: list[str], binary: str) -> Iterator[tuple[subprocess.Popen[str], str, list[str]]]:
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    proc = subprocess.Popen([sys.executable, "-m", "etcd_server", "--binary", binary, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        while not lines or not lines[-1].startswith("Press Ctrl-C"):
            line = proc.stdout.readline()
            assert line, f"server ended: {lines} {proc.stderr.read() if proc.stderr else ''}"
            lines.append(line.rstrip("\n"))
        (endpoints,) = [ln.split("=", 1)[1] for ln in lines if ln.startswith("ETCD_ENDPOINTS=")]
        yield proc, endpoints, lines
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_python_m_etcd_server_serves_tls_and_auth(
    etcd_binary: str, certs: CertPaths, secrets: dict[str, str]
) -> None:
    args = ["--tls-cert", certs.server_cert, "--tls-key", certs.server_key, "--tls-ca", certs.ca,
            "--root-password-file", secrets["root"], "--user", "alice", "--password-file", secrets["alice"],
            "--user-prefix", "/jobs/alice/"]
    for proc, endpoints, lines in _serve(args, etcd_binary):
        assert endpoints.startswith("https://127.0.0.1:")
        text = "\n".join(lines)
        assert f"--rdzv-conf=ca_cert={certs.ca}" in text and "ETCD_RDZV_USER=alice" in text
        assert ALICE_PW not in text and ROOT_PW not in text
        tls = {"ca_cert": certs.ca, "cert": certs.client_cert, "key": certs.client_key}
        with EtcdClient(endpoints, user="alice", password=ALICE_PW, timeout=10, **tls) as alice:
            alice.put(b"/jobs/alice/k", b"1")
            with pytest.raises(EtcdPermissionDenied):
                alice.put(b"/other", b"1")
        with EtcdClient(endpoints, timeout=10, **tls) as anonymous:  # its certificate's CN is no user
            with pytest.raises((EtcdAuthError, EtcdPermissionDenied)):
                anonymous.put(b"/jobs/alice/k", b"2")
        with EtcdClient(endpoints.replace("https", "http"), timeout=3, connect_timeout=2) as plain:
            with pytest.raises(EtcdError):  # no plain text on the client port
                plain.get(b"/jobs/alice/k")
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert ALICE_PW.encode() not in f.read()
        (etcd_pid,) = [int(ln.split("(pid ", 1)[1].rstrip(")")) for ln in lines if " ready (pid " in ln]
        with open(f"/proc/{etcd_pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        peer_url = argv[argv.index("--listen-peer-urls") + 1]
        assert peer_url.startswith("https://127.0.0.1:")  # issue 32: the peer port is TLS too
        _assert_peer_port_closed_to_strangers(int(peer_url.rsplit(":", 1)[1]), certs)


@pytest.mark.parametrize("args, match", [
    (["--tls-cert", "c.pem"], "missing --tls-key, --tls-ca"),
    (["--user", "alice"], "need --root-password-file"),
    (["--root-password-file", "/no/such/file"], "--root-password-file '/no/such/file'"),
    (["--client-cert", "c.pem", "--client-key", "k.pem"], "need --tls-cert"),
])
def test_bad_tls_or_auth_options_exit_2_with_the_option_named(
    args: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert server_main(args) == 2
    assert match in capsys.readouterr().err


# -- issue 32: the peer port ------------------------------------------------------------------------


def _peer_request(
    port: int, method: str, path: str, *, context: ssl.SSLContext | None = None, body: bytes | None = None
) -> tuple[int, bytes]:
    """One request to a peer port (plain http when ``context`` is None): ``(status, body)``."""
    conn: http.client.HTTPConnection
    if context is None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=5, context=context)
    try:
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _members_listed(port: int, context: ssl.SSLContext | None = None) -> bool:
    """Whether ``GET /members`` on the peer port hands out the member list (what a peer gets)."""
    try:
        status, body = _peer_request(port, "GET", "/members", context=context)
    except OSError:  # refused, TLS handshake failed, connection reset by the server
        return False
    try:
        members = json.loads(body)
    except ValueError:
        return False
    return status == 200 and isinstance(members, list) and bool(members)


def _assert_peer_port_closed_to_strangers(port: int, certs: CertPaths) -> None:
    """No member list over plain http, nor over https without a certificate (or with a client's one)."""
    assert not _members_listed(port), "plain http GET /members answered on the peer port"
    no_cert = ssl.create_default_context(cafile=certs.ca)
    assert not _members_listed(port, no_cert), "https GET /members answered without a client certificate"
    for method, path, body in (("POST", "/leases/internal", b"\x08\x01"), ("POST", "/leases", b"\x08\x01")):
        for context in (None, no_cert):
            try:
                status, _ = _peer_request(port, method, path, context=context, body=body)
            except OSError:
                continue
            assert status >= 400, f"{method} {path} answered {status} without a peer certificate"
    peer = ssl.create_default_context(cafile=certs.ca)
    peer.load_cert_chain(certs.server_cert, certs.server_key)
    assert _members_listed(port, peer), "the peer port does not serve members with the peer certificate"


def _tls(certs: CertPaths, **kw: Any) -> TLSConfig:
    return TLSConfig(certs.server_cert, certs.server_key, certs.ca,
                     client_cert_file=certs.client_cert, client_key_file=certs.client_key, **kw)


def test_with_tls_the_peer_port_needs_a_peer_certificate(etcd_binary: str, certs: CertPaths) -> None:
    with EtcdServer(binary=etcd_binary, tls=_tls(certs), auth=AuthConfig(ROOT_PW)) as server:
        _assert_peer_port_closed_to_strangers(server.get_peer_port(), certs)
        with server.get_client(timeout=10) as root:
            root.put(b"k", b"v")
            kv = root.get(b"k")
            assert kv is not None and kv.value == b"v"


def test_without_tls_the_peer_port_is_open_to_local_users(etcd_binary: str) -> None:
    """What docs/server.md says is open without TLS: the peer port answers anyone on this host."""
    with EtcdServer(binary=etcd_binary, auth=AuthConfig(ROOT_PW)) as server:
        assert _members_listed(server.get_peer_port())


def test_peer_allowed_cn_refuses_a_client_certificate_of_the_same_ca(etcd_binary: str, certs: CertPaths) -> None:
    with EtcdServer(binary=etcd_binary, tls=_tls(certs, peer_allowed_cn="server")) as server:
        port = server.get_peer_port()
        client = ssl.create_default_context(cafile=certs.ca)
        client.load_cert_chain(certs.client_cert, certs.client_key)  # CN "client": signed by the CA
        assert not _members_listed(port, client)
        _assert_peer_port_closed_to_strangers(port, certs)


def test_tls_cluster_forms_over_tls_peers_and_keeps_strangers_off(etcd_binary: str, certs: CertPaths) -> None:
    pw = "al1ce-peer-pw"
    auth = AuthConfig(ROOT_PW, user="alice", password=pw, prefix=b"/jobs/alice/")
    with EtcdCluster(3, binary=etcd_binary, tls=_tls(certs), auth=auth) as cluster:
        assert all(u.startswith("https://127.0.0.1:") for u in cluster.peer_urls)
        for url in cluster.peer_urls:
            _assert_peer_port_closed_to_strangers(int(url.rsplit(":", 1)[1]), certs)
        with cluster.get_client(user="alice", password=pw, timeout=20) as alice:
            alice.put(b"/jobs/alice/k", b"1")
        tls_files = {"ca_cert": certs.ca, "cert": certs.client_cert, "key": certs.client_key}
        for url in cluster.client_urls:  # replicated to every member, which serves it
            with EtcdClient(url, user="alice", password=pw, timeout=20, **tls_files) as one:
                kv = one.get(b"/jobs/alice/k")
                assert kv is not None and kv.value == b"1"
            with EtcdClient(url, timeout=10, **tls_files) as anonymous:  # CN "client" is no etcd user
                with pytest.raises((EtcdAuthError, EtcdPermissionDenied)):
                    anonymous.get(b"/jobs/alice/k")


# -- issue 32: the auth window -------------------------------------------------------------------------


class _EarlyWatcher:
    """A local user polling ``connect()`` on the client port while the server starts, and opening a
    watch on the whole keyspace the moment it accepts (no credentials)."""

    def __init__(self, port: int, tls_files: dict[str, str]) -> None:
        self.port = port
        endpoint = f"https://127.0.0.1:{port}" if tls_files else f"127.0.0.1:{port}"
        self.client = EtcdClient(endpoint, timeout=5, **tls_files)
        self.connected_at: float | None = None
        self.watch: Any = None
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="early-watcher", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
            except OSError:
                time.sleep(0.001)
                continue
            self.connected_at = time.monotonic()
            try:
                self.watch = self.client.watch(b"\0", b"\0")
                self.watch.wait_created(10)
            except BaseException as e:
                self.error = e
            return

    def close(self) -> None:
        self.stop.set()
        self.thread.join(15)
        if self.watch is not None:
            self.watch.cancel()
        self.client.close()


@pytest.mark.parametrize("with_tls", [False, True], ids=["plain", "tls"])
def test_a_watch_opened_when_the_client_port_first_accepts_gets_nothing(
    etcd_binary: str, certs: CertPaths, with_tls: bool
) -> None:
    (port,) = free_ports(1)
    tls = _tls(certs) if with_tls else None
    tls_files = {"ca_cert": certs.ca, "cert": certs.client_cert, "key": certs.client_key} if with_tls else {}
    server = EtcdServer(binary=etcd_binary, port=port, tls=tls,
                        auth=AuthConfig(ROOT_PW, user="alice", password=ALICE_PW, prefix=b"/jobs/alice/"))
    early = _EarlyWatcher(port, tls_files)
    try:
        server.start(timeout=30)
        ready_at = time.monotonic()
        with server.get_client(timeout=10) as root:
            root.put(b"/jobs/alice/secret", b"s3cret")
        early.thread.join(15)
        assert early.connected_at is not None, "the client port never accepted a connection"
        assert early.watch is not None or early.error is not None
        events: list[Any] = []
        if early.watch is not None:
            try:
                events = early.watch.get(timeout=2)
            except (EtcdAuthError, EtcdError):
                events = []
        assert not [ev for ev in events if b"secret" in ev.kv.key], (
            f"an unauthenticated watch opened {ready_at - early.connected_at:.3f} s before 'ready' "
            "received a later write"
        )
        with pytest.raises((EtcdAuthError, EtcdPermissionDenied)):
            early.client.get(b"/jobs/alice/secret")
        with pytest.raises((EtcdAuthError, EtcdPermissionDenied)):
            early.client.range(b"\0", b"\0")
    finally:
        early.close()
        server.stop()


def test_a_write_during_the_auth_set_up_stops_the_server(
    etcd_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keyspace revision is read before and after the set-up: one that moved means someone wrote."""
    real_call = Gateway.call

    def call(self: Gateway, path: str, body: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        if path == "/v3/auth/enable":  # a write that slipped in just before auth is on
            real_call(self, "/v3/kv/put", {"key": "c3B5", "value": "MQ=="}, timeout=5)
        return real_call(self, path, body, **kw)

    monkeypatch.setattr(Gateway, "call", call)
    server = EtcdServer(binary=etcd_binary, auth=AuthConfig(ROOT_PW))
    try:
        with pytest.raises(EtcdGatewayError, match="revision moved"):
            server.start(timeout=30)
        assert not server.is_running()
    finally:
        server.stop()


def test_the_client_port_is_closed_while_auth_is_set_up(etcd_binary: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the set-up runs, etcd serves clients only on a unix socket in a 0700 directory."""
    (port,) = free_ports(1)
    seen: dict[str, Any] = {}
    real = cluster_module.setup_auth

    def setup_auth(gateway: Gateway, auth: AuthConfig, **kw: Any) -> None:
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        assert gateway.unix_socket is not None
        seen["socket"] = gateway.unix_socket
        seen["mode"] = os.stat(os.path.dirname(gateway.unix_socket)).st_mode & 0o777
        real(gateway, auth, **kw)

    monkeypatch.setattr(cluster_module, "setup_auth", setup_auth)
    with EtcdServer(binary=etcd_binary, port=port, auth=AuthConfig(ROOT_PW)) as server:
        assert seen["mode"] == 0o700
        assert not os.path.exists(seen["socket"])
        socket.create_connection(("127.0.0.1", server.get_port()), timeout=1).close()
