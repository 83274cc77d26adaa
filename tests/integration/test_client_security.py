"""No plaintext credentials (issue 23, item 2), through the real client against etcd with and
without TLS: mixed schemes, a scheme contradicting the TLS options, a password bound for http
(refused unless ``allow_insecure_auth``, then warned about), credentials in endpoint URLs (refused
without echoing them), a password sent to an etcd without auth (warned about once)."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.certs import CertPaths, have_openssl, make_certs
from torch.distributed.elastic.rendezvous import RendezvousParameters

from etcd_rdzv.conf import parse_rdzv_config
from etcd_rdzv.conf_keys import PASSWORD_ENV, USER_ENV
from etcd_server import AuthConfig, EtcdServer, TLSConfig
from etcd_store.client import EtcdClient

pytestmark = [pytest.mark.timeout(120), pytest.mark.etcd_matrix("3.6")]  # issue 23: each finding on etcd 3.7 and 3.6

PW = "al1ce-s3cret-pw"
AUTH = AuthConfig("r00t-s3cret-pw", user="alice", password=PW, prefix=b"/jobs/alice/")
CLIENT_LOG = "etcd_store.client.transport"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    if not have_openssl():
        pytest.skip("openssl command not available")
    return make_certs(tmp_path_factory.mktemp("client-sec-certs"))


def _tls(certs: CertPaths) -> TLSConfig:
    return TLSConfig(certs.server_cert, certs.server_key, certs.ca,
                     client_cert_file=certs.client_cert, client_key_file=certs.client_key)  # fmt: skip


@pytest.fixture(scope="module")
def tls_auth_etcd(etcd_binary_module: str, certs: CertPaths) -> Iterator[EtcdServer]:
    with EtcdServer(binary=etcd_binary_module, tls=_tls(certs), auth=AUTH) as server:
        yield server


@pytest.fixture(scope="module")
def plain_auth_etcd(etcd_binary_module: str) -> Iterator[EtcdServer]:
    with EtcdServer(binary=etcd_binary_module, auth=AUTH) as server:
        yield server


@pytest.fixture(scope="module")
def etcd_binary_module(etcd_server: EtcdServer) -> str:
    """The binary of the module's etcd version (the matrix of ``etcd_server``)."""
    binary = etcd_server.binary
    assert binary
    return str(binary)


class Listener:
    """A TCP port standing for a plain-text proxy: counts the connections it gets."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def proxy() -> Iterator[Listener]:
    listener = Listener()
    try:
        yield listener
    finally:
        listener.close()


def _tls_files(certs: CertPaths) -> dict[str, str]:
    return {"ca_cert": certs.ca, "cert": certs.client_cert, "key": certs.client_key}


def test_a_tls_member_beside_a_plaintext_one_is_refused_before_any_connection(
    tls_auth_etcd: EtcdServer, certs: CertPaths, proxy: Listener
) -> None:
    https = tls_auth_etcd.get_client_url()
    mixed = f"{https},http://127.0.0.1:{proxy.port}"
    with pytest.raises(ValueError, match="mix https and http"):
        EtcdClient(mixed, user="alice", password=PW)
    with pytest.raises(ValueError, match="says http but the client is configured for https"):
        EtcdClient(mixed, user="alice", password=PW, **_tls_files(certs))  # the reproduced set-up
    # An explicit http:// no longer overrides protocol=https or the TLS files.
    for options in ({"protocol": "https"}, _tls_files(certs)):
        with pytest.raises(ValueError, match="says http but the client is configured for https"):
            EtcdClient(f"http://127.0.0.1:{proxy.port}", user="alice", password=PW, **options)
    # Nor does protocol=http beside them: the TLS files would be ignored, the password sent in plain text.
    with pytest.raises(ValueError, match="protocol 'http' with TLS certificate files"):
        EtcdClient(f"http://127.0.0.1:{proxy.port}", user="alice", password=PW, protocol="http", **_tls_files(certs))
    assert proxy.accepted == 0
    with EtcdClient(https, user="alice", password=PW, timeout=10, **_tls_files(certs)) as alice:
        alice.put(b"/jobs/alice/k", b"v")  # https for every endpoint: works, no warning needed
        assert alice.get(b"/jobs/alice/k") is not None


def test_a_password_over_http_needs_the_named_opt_in_and_is_warned_about(
    plain_auth_etcd: EtcdServer, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    endpoint = plain_auth_etcd.get_endpoint()
    with pytest.raises(ValueError, match="in plain text to http://.*allow_insecure_auth") as info:
        EtcdClient(endpoint, user="alice", password=PW)
    assert PW not in str(info.value)
    with caplog.at_level(logging.WARNING, logger=CLIENT_LOG):
        with EtcdClient(endpoint, user="alice", password=PW, allow_insecure_auth=True, timeout=10) as alice:
            alice.put(b"/jobs/alice/k", b"v")
    warned = [r.getMessage() for r in caplog.records if "plain text" in r.getMessage()]
    assert len(warned) == 1 and "allow_insecure_auth" in warned[0] and PW not in warned[0]
    # The rendezvous options refuse it at parse time, naming the key, and take the opt-in.
    secret = tmp_path / "alice-pw"
    secret.write_text(PW)
    params = RendezvousParameters(backend="etcd-v2", endpoint=endpoint, run_id="r", min_nodes=1,
                                  max_nodes=1, user="alice", password_file=str(secret))
    with pytest.raises(ValueError, match="allow_insecure_auth"):
        parse_rdzv_config(params)
    params.config["allow_insecure_auth"] = "1"
    with EtcdClient.from_options(parse_rdzv_config(params).client, timeout=10) as alice:
        alice.put(b"/jobs/alice/k2", b"v")


@pytest.mark.parametrize("url", ["http://alice:{pw}@127.0.0.1:2379", "alice:{pw}@127.0.0.1:2379",
                                 "https://alice:{pw}@[::1]:2379/"])
def test_credentials_in_an_endpoint_url_are_refused_without_echoing_them(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = url.format(pw=PW)
    with pytest.raises(ValueError, match="credentials in an endpoint URL") as info:
        EtcdClient(endpoint)
    assert PW not in str(info.value) and "***@" in str(info.value)
    params = RendezvousParameters(backend="etcd-v3", endpoint=endpoint, run_id="r", min_nodes=1, max_nodes=1)
    with pytest.raises(ValueError, match="credentials") as info:
        parse_rdzv_config(params)
    assert PW not in str(info.value)
    monkeypatch.delenv(USER_ENV, raising=False)
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    out = subprocess.run([sys.executable, "-m", "etcd_rdzv", "--endpoints", endpoint, "list"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "credentials" in out.stderr, out.stderr
    assert PW not in out.stdout + out.stderr


@pytest.mark.parametrize("with_tls", [False, True], ids=["http", "https"])
def test_a_password_sent_to_an_etcd_without_auth_warns_once(
    with_tls: bool, etcd_binary_module: str, certs: CertPaths, caplog: pytest.LogCaptureFixture
) -> None:
    tls = _tls(certs) if with_tls else None
    with EtcdServer(binary=etcd_binary_module, tls=tls) as server:
        options = _tls_files(certs) if with_tls else {"allow_insecure_auth": True}
        target = server.get_client_url() if with_tls else server.get_endpoint()
        with caplog.at_level(logging.WARNING, logger=CLIENT_LOG):
            with EtcdClient(target, user="alice", password=PW, timeout=10, **options) as client:
                for i in range(3):
                    client.put(f"/k{i}".encode(), b"v")
                    assert client.get(f"/k{i}".encode()) is not None
    warned = [r.getMessage() for r in caplog.records if "authentication disabled" in r.getMessage()]
    assert len(warned) == 1 and "'alice'" in warned[0] and PW not in warned[0]
