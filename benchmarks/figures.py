"""How the benchmarks write a figure: ``median (lo–hi)``, ratios, the plots' colours per contender,
and the production report's re-rendezvous time drawn as a reference line.

Imported by :mod:`benchmarks.targets`, :mod:`benchmarks.report` and the sections' own report code
(``b3_torchrun_report``, ``b6_many_jobs``), so none of them imports another for these. Pure.
"""

from __future__ import annotations

from typing import Any

from .common import (
    C10D,
    FLOOR,
    FLOOR_BARRIER,
    OURS_ETCD_V2,
    OURS_ETCD_V2_BEFORE,
    OURS_ETCD_V2_FAST,
    OURS_ETCD_V3,
    OURS_STORE,
    TCP_STORE,
    TORCH_ETCD_V2,
    TORCH_V2_STORE,
)

__all__ = ["COLORS", "PRODUCTION_RERDZV_S", "fig", "fmt", "ratio"]

#: The seed report's re-rendezvous time (Volcano + TorchElastic), seconds.
PRODUCTION_RERDZV_S = 14.5

COLORS = {
    OURS_STORE: "tab:blue", OURS_ETCD_V2: "tab:blue", OURS_ETCD_V3: "tab:green",
    TORCH_V2_STORE: "tab:orange", TORCH_ETCD_V2: "tab:orange",
    TCP_STORE: "tab:gray", C10D: "tab:gray", FLOOR: "black", FLOOR_BARRIER: "tab:purple",
    OURS_ETCD_V2_BEFORE: "tab:cyan", OURS_ETCD_V2_FAST: "tab:red",
}


def fmt(x: float | None, digits: int = 0) -> str:
    if x is None:
        return "—"
    if abs(x) >= 100 or digits == 0:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def fig(s: dict[str, Any] | None, unit: str = "", digits: int = 0) -> str:
    """``median (lo–hi)``."""
    if not s or s.get("median") is None:
        return "—"
    med, lo, hi = s["median"], s.get("lo"), s.get("hi")
    spread = f" ({fmt(lo, digits)}–{fmt(hi, digits)})" if s.get("runs", 0) > 1 else ""
    return f"{fmt(med, digits)}{unit}{spread}"


def ratio(r: dict[str, Any] | None) -> str:
    if not r:
        return "—"
    spread = f" ({r['lo']:.2f}–{r['hi']:.2f})" if r.get("runs", 0) > 1 else ""
    return f"{r['ratio']:.2f}×{spread}"
