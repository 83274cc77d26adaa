"""etcd_server's command lines: with TLS the peer port is https with peer client-cert
auth; a private set-up start listens for clients on a unix socket only. No etcd is started."""

from __future__ import annotations

import os

import pytest

from etcd_server.member import EtcdMember, TLSConfig


def _member(tls: TLSConfig | None, tmp: str) -> EtcdMember:
    return EtcdMember(binary="/bin/etcd", name="m", data_dir=os.path.join(tmp, "data"), work_dir=tmp,
                      client_port=2379, peer_port=2380, tls=tls, enable_v2=False, extra_args=(),
                      die_with_parent=False)


def _flag(cmd: list[str], name: str) -> str | None:
    for i, arg in enumerate(cmd):
        if arg == name:
            return cmd[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def test_with_tls_the_peer_port_is_https_with_client_cert_auth(tmp_path: object) -> None:
    tls = TLSConfig("s.pem", "s-key.pem", "ca.pem")
    cmd = _member(tls, str(tmp_path)).command()
    for flag in ("--listen-peer-urls", "--initial-advertise-peer-urls"):
        assert _flag(cmd, flag) == "https://127.0.0.1:2380"
    assert _flag(cmd, "--initial-cluster") == "m=https://127.0.0.1:2380"
    assert _flag(cmd, "--peer-client-cert-auth") == "true"
    assert _flag(cmd, "--peer-cert-file") == os.path.abspath("s.pem")
    assert _flag(cmd, "--peer-key-file") == os.path.abspath("s-key.pem")
    assert _flag(cmd, "--peer-trusted-ca-file") == os.path.abspath("ca.pem")
    assert _flag(cmd, "--peer-cert-allowed-cn") is None


def test_separate_peer_material_and_allowed_cn(tmp_path: object) -> None:
    tls = TLSConfig("s.pem", "s-key.pem", "ca.pem", peer_cert_file="p.pem", peer_key_file="p-key.pem",
                    peer_ca_file="peer-ca.pem", peer_allowed_cn="etcd-peer")
    cmd = _member(tls, str(tmp_path)).command()
    assert _flag(cmd, "--peer-cert-file") == os.path.abspath("p.pem")
    assert _flag(cmd, "--peer-trusted-ca-file") == os.path.abspath("peer-ca.pem")
    assert _flag(cmd, "--peer-cert-allowed-cn") == "etcd-peer"
    assert _flag(cmd, "--trusted-ca-file") == os.path.abspath("ca.pem")


def test_peer_cert_and_key_go_together() -> None:
    with pytest.raises(ValueError, match="peer_cert_file and peer_key_file"):
        TLSConfig("s.pem", "s-key.pem", "ca.pem", peer_cert_file="p.pem")


def test_without_tls_the_peer_port_is_plain_http(tmp_path: object) -> None:
    cmd = _member(None, str(tmp_path)).command()
    assert _flag(cmd, "--listen-peer-urls") == "http://127.0.0.1:2380"
    assert not [a for a in cmd if a.startswith("--peer-")]


def test_a_private_set_up_start_serves_clients_on_a_unix_socket_only(tmp_path: object) -> None:
    member = _member(TLSConfig("s.pem", "s-key.pem", "ca.pem"), str(tmp_path))
    member.private_dir = str(tmp_path)
    cmd = member.command()
    assert _flag(cmd, "--listen-client-urls") == "unix://localhost:2379"
    assert _flag(cmd, "--advertise-client-urls") == "unix://localhost:2379"
    assert _flag(cmd, "--cert-file") is None and _flag(cmd, "--client-cert-auth") is None
    assert _flag(cmd, "--listen-peer-urls") == "https://127.0.0.1:2380"  # the real peer port, TLS
    assert member.gateway.unix_socket == os.path.join(str(tmp_path), "localhost:2379")
    member.private_dir = None
    assert _flag(member.command(), "--listen-client-urls") == "https://127.0.0.1:2379"
    assert member.client_url == "https://127.0.0.1:2379"
