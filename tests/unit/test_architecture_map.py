"""docs/architecture.md is the map of the rooms: every product module is named in it, and the arrows
it draws hold (no package imports one above it). No etcd."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAP = (ROOT / "docs" / "architecture.md").read_text()
PACKAGES = ("etcd_server", "etcd_store", "etcd_rdzv")
MODULES = sorted(
    p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
    if p.name != "__init__.py" and "testing" not in p.relative_to(ROOT).parts[1:-1]
)  # fmt: skip


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_module_is_on_the_map(path: Path) -> None:
    assert f"`{path.name}`" in MAP or f"{path.name} " in MAP, f"docs/architecture.md does not name {path.name}"


#: What each package may import of ours, the arrows of the map.
ALLOWED = {"etcd_server": set(), "etcd_store": set(), "etcd_rdzv": {"etcd_store"}}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_arrow_runs_back_up(path: Path) -> None:
    """Module-level imports only: etcd_server's lazy make_client() import of the client is the map's
    one stated exception, inside a function."""
    package = path.relative_to(ROOT).parts[0]
    tree = ast.parse(path.read_text())
    for node in tree.body:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        for name in names:
            top = name.split(".")[0]
            if top in PACKAGES and top != package:
                assert top in ALLOWED[package], f"{path.relative_to(ROOT)} imports {name}"
