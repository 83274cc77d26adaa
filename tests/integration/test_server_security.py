"""``etcd_server`` hardening (issue 23, item 6): the auth set-up refuses users and roles that someone
added before auth was on and resets the passwords of the users it expects; ``python -m etcd_server``
serves TLS and auth from options, passwords from files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import REPO_ROOT
from helpers.certs import CertPaths, have_openssl, make_certs

from etcd_server import AuthConfig, EtcdServer
from etcd_server.__main__ import main as server_main
from etcd_server.errors import EtcdGatewayError
from etcd_store.client import EtcdClient
from etcd_store.errors import EtcdAuthError, EtcdError, EtcdPermissionDenied

pytestmark = [pytest.mark.timeout(180), pytest.mark.etcd_matrix("3.6")]  # issue 23: each finding on etcd 3.7 and 3.6

ROOT_PW, ALICE_PW = "r00t-srv-sec-pw", "al1ce-srv-sec-pw"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    if not have_openssl():
        pytest.skip("openssl command not available")
    return make_certs(tmp_path_factory.mktemp("server-sec-certs"))


def _plant(data_dir: str, binary: str, *users: tuple[str, str]) -> None:
    """What a client that reached the port before auth was enabled could leave behind."""
    with EtcdServer(data_dir, binary=binary) as plain:
        for name, password in users:
            plain.gateway_call("/v3/auth/user/add", {"name": name, "password": password})


def test_auth_set_up_refuses_a_user_added_before_auth_was_on(etcd_binary: str, tmp_path: Path) -> None:
    data_dir = str(tmp_path / "data")
    _plant(data_dir, etcd_binary, ("mallory", "m4llory-pw"))
    server = EtcdServer(data_dir, binary=etcd_binary, auth=AuthConfig(ROOT_PW, user="alice", password=ALICE_PW))
    try:
        with pytest.raises(EtcdGatewayError, match=r"did not create.*users \['mallory'\]"):
            server.start(timeout=30)
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
