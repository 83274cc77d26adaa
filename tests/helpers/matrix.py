"""The etcd version matrix of this test session: which versions are selected, their binaries, and the
``pytest.param`` that carries a version (the rules applied to it live in tests/conftest.py).

Test modules import these names from here, never from ``conftest``.
"""

from __future__ import annotations

from typing import Any

import pytest

from . import etcd_versions


def _version_mark(version: str) -> pytest.MarkDecorator:
    return pytest.mark.etcd_version(version)


#: Set to 1, the session also runs the items marked ``full_matrix`` (as ``--full-matrix`` does).
FULL_MATRIX_ENV = "ETCD_RDZV_FULL_MATRIX"


def version_param(version: str, *values: object, id: str | None = None, full_matrix: bool = False) -> Any:
    """A ``pytest.param`` of a test that runs on etcd ``version`` (``values`` default to the version).

    The param carries the ``etcd_version`` mark, so the matrix rules below apply to it: skipped (or
    failed under CI) when the binary is missing, deselected on a subset version unless the test is
    marked ``etcd_matrix``. ``full_matrix``: it also carries the ``full_matrix`` mark (run only under ``--full-matrix``).
    """
    marks = [_version_mark(version)] + ([pytest.mark.full_matrix] if full_matrix else [])
    return pytest.param(*(values or (version,)), id=id or f"etcd{version}", marks=marks)


SELECTED: tuple[str, ...] = etcd_versions.selected()
ETCD_BINARIES: dict[str, str] = {v: p for v, p in etcd_versions.discover().items() if v in SELECTED}
#: Versions that run the whole suite in this session (present or not: a missing one skips).
FULL_VERSIONS: tuple[str, ...] = tuple(v for v in SELECTED if v in etcd_versions.FULL)
