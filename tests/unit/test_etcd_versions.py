"""The etcd version matrix itself (tests/helpers/etcd_versions.py, tests/conftest.py): selection, discovery,
and what a missing binary does (skip with how-to locally, fail the session under ``CI=true``)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
from helpers import REPO_ROOT, etcd_versions

ROOT = REPO_ROOT
ONE_TEST = "tests/integration/test_store_conformance.py::test_namespaces_are_separate"


def _pytest(tmp_path: Any, **env: str) -> subprocess.CompletedProcess[str]:
    """Run one store test in a child pytest with an empty etcd build cache (no 3.6/3.7 binaries)."""
    child_env = {k: v for k, v in os.environ.items() if k not in ("CI", "TORCHELASTIC_ETCD_BINARY_PATH")}
    child_env.update({etcd_versions.CACHE_VAR: str(tmp_path / "empty-cache"), **env})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-n", "0", "-p", "no:cacheprovider", ONE_TEST],
        cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_selection_reads_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(etcd_versions.ENV_VAR, raising=False)
    assert etcd_versions.selected() == ("3.4", "3.5", "3.6", "3.7", "3.8")
    monkeypatch.setenv(etcd_versions.ENV_VAR, "etcd3.7, 3.5")
    assert etcd_versions.selected() == ("3.5", "3.7")
    monkeypatch.setenv(etcd_versions.ENV_VAR, "3.7,3.9")
    with pytest.raises(ValueError, match=r"ETCD_RDZV_TEST_ETCD='3.7,3.9': unknown etcd version\(s\) \['3.9'\]"):
        etcd_versions.selected()


def test_discovery_maps_minor_versions_to_binaries_of_that_version() -> None:
    from etcd_server.binary import etcd_version

    found = etcd_versions.discover()
    assert found, "no etcd binary at all on this machine"
    for minor, path in found.items():
        assert etcd_versions.minor(etcd_version(path)) == minor


def test_cache_directories_sort_as_versions() -> None:
    """Newest first among the built binaries: numbers as numbers, a pre-release before its release."""
    names = ["v3.8.0", "v3.6.9", "v3.8.0-alpha.0", "v3.6.16", "v3.8.0-beta.0", "v3.8.0-alpha.10", "v3.7.3"]
    assert sorted(names, key=etcd_versions.cache_order) == [
        "v3.6.9", "v3.6.16", "v3.7.3", "v3.8.0-alpha.0", "v3.8.0-alpha.10", "v3.8.0-beta.0", "v3.8.0",
    ]  # fmt: skip


def test_a_pre_release_in_the_cache_is_found_under_its_minor_version(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache directory such as ``v3.8.0-alpha.0`` is found as "3.8" (its binary prints 3.8.0-alpha.0)."""
    for name, version in (("v3.8.0-alpha.0", "3.8.0-alpha.0"), ("v3.9.1", "3.9.1")):
        os.makedirs(tmp_path / name)
        script = tmp_path / name / "etcd"
        script.write_text(f"#!/bin/sh\necho 'etcd Version: {version}'\n")
        script.chmod(0o755)
    monkeypatch.setenv(etcd_versions.CACHE_VAR, str(tmp_path))
    monkeypatch.setattr(etcd_versions, "is_native_executable", os.path.isfile)  # shell scripts stand in
    found = etcd_versions.discover()
    assert found["3.8"] == str(tmp_path / "v3.8.0-alpha.0" / "etcd")
    assert found["3.9"] == str(tmp_path / "v3.9.1" / "etcd")


def test_a_missing_version_is_skipped_locally_with_how_to_build_it(tmp_path: Any) -> None:
    proc = _pytest(tmp_path, **{etcd_versions.ENV_VAR: "3.7"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "1 skipped" in out, out
    assert "no etcd 3.7 binary found; to test on it: bash .ci/build-etcd" in out, out


def test_a_missing_version_fails_the_session_under_ci(tmp_path: Any) -> None:
    proc = _pytest(tmp_path, CI="true", **{etcd_versions.ENV_VAR: "3.7"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out  # pytest's usage error: nothing ran
    assert "CI=true and the etcd test matrix is incomplete: no etcd 3.7 binary found" in out, out
