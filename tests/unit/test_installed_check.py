"""The session's check that the installed etcd-rdzv is this checkout's code (tests/helpers/installed.py):
CI tests the wheel it builds, while the test process and its agents import the checkout's modules."""

from __future__ import annotations

from pathlib import Path

from helpers import REPO_ROOT
from helpers.installed import PACKAGES, check, difference


def _tree(base: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        (base / name).write_text(text)
    return base


def test_a_copy_equal_byte_for_byte_passes_and_each_kind_of_difference_is_named(tmp_path: Path) -> None:
    files = {f"{p}/__init__.py": f"# {p}\n" for p in PACKAGES} | {"etcd_rdzv/testing/train.py": "x = 1\n"}
    checkout = _tree(tmp_path / "checkout", files | {"README.md": "not a module\n"})
    site = _tree(tmp_path / "site", files | {"etcd_rdzv/__pycache__/x.py": "cached\n", "other/y.py": ""})
    assert difference(checkout, site) is None  # caches, other packages and non-modules do not count

    (site / "etcd_rdzv/testing/train.py").write_text("x = 2\n")
    assert difference(checkout, site) == "differs from the checkout in etcd_rdzv/testing/train.py (1 module(s) in all)"
    (site / "etcd_rdzv/testing/train.py").unlink()
    assert difference(checkout, site) == "lacks etcd_rdzv/testing/train.py (1 module(s) in all)"
    _tree(site, {"etcd_rdzv/testing/train.py": "x = 1\n", "etcd_store/gone.py": ""})
    assert difference(checkout, site) == "has etcd_store/gone.py, which the checkout has not (1 module(s) in all)"


def test_this_session_tests_this_checkout() -> None:
    assert "this checkout" in check(REPO_ROOT) or "equal the checkout's" in check(REPO_ROOT)
