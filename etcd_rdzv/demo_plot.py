"""The demo's timeline plot (``python -m etcd_rdzv.demo --plot FILE.png``), drawn from the training log.

:func:`plot_timeline` turns the records the demo already collects (the training
log, :mod:`etcd_rdzv.testing.train`) and the demo's own events (the kill and the
re-add of ``--chaos``) into one PNG with two panels over the same time axis
(seconds since the demo started):

* **steps**: the step count rank 0 of each worker group logged, one colour per
  round, each round's span shaded and labelled ``round N  world W``;
* **nodes**: one lane per node (agent) with a bar for each round it trained in,
  labelled with the world size, so the node that was killed shows a gap and the
  rejoin a new bar.

Events are drawn as labelled vertical lines on both panels. matplotlib is an
optional dependency (``pip install "etcd-rdzv[plot]"``): it is imported when a
plot is drawn, with the non-interactive ``Agg`` backend (no display needed);
:func:`require_matplotlib` raises :class:`PlotUnavailable` (an ``ImportError``
saying how to install it) when it is missing, so the demo can refuse ``--plot``
before it starts any agent. Drawing reads no file but the records given and
writes only ``path``; it takes well under a second for a demo-sized log.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .testing.agents import GroupSummary, summarize
from .testing.train import Record

__all__ = ["Event", "PlotUnavailable", "plot_timeline", "require_matplotlib"]


class PlotUnavailable(ImportError):
    """matplotlib is not installed: the plot cannot be drawn."""


@dataclass(frozen=True)
class Event:
    """Something the demo did at ``t`` (``time.time()``), drawn as a vertical line: ``kill node2``."""

    t: float
    label: str


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the ``Agg`` backend; :class:`PlotUnavailable` if matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as e:
        raise PlotUnavailable(
            "the timeline plot needs matplotlib, which is not installed: "
            'pip install "etcd-rdzv[plot]" (or pip install matplotlib)'
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(
    records: Sequence[Record],
    path: str,
    *,
    t0: float | None = None,
    events: Sequence[Event] = (),
    title: str = "",
) -> str:
    """Draw the timeline of ``records`` (and ``events``) into the PNG ``path``; returns ``path``.

    ``t0`` is the time the x axis counts from (default: the first record or event).
    Raises :class:`PlotUnavailable` without matplotlib, ``ValueError`` when there is
    nothing to draw (no record and no event), ``OSError`` when ``path`` cannot be written.
    """
    plt = require_matplotlib()
    if not records and not events:
        raise ValueError("nothing to plot: the training log has no record yet")
    times = [r.t for r in records] + [e.t for e in events]
    origin = min(times) if t0 is None else t0
    groups = summarize(records)
    colours = plt.get_cmap("tab10")
    nodes = sorted({r.node for r in records})
    lane = {node: i for i, node in enumerate(nodes)}

    fig, (ax_steps, ax_nodes) = plt.subplots(
        2, 1, sharex=True, figsize=(10, 3.2 + 0.35 * max(len(nodes), 2)),
        gridspec_kw={"height_ratios": [3, max(len(nodes), 2)]},
    )  # fmt: skip
    for i, g in enumerate(groups):
        _draw_round(ax_steps, ax_nodes, records, g, colours(i % 10), origin, lane)
    for event in events:
        x = event.t - origin
        for ax in (ax_steps, ax_nodes):
            ax.axvline(x, color="tab:red", linestyle="--", linewidth=1)
        ax_steps.annotate(event.label, (x, 1), xycoords=("data", "axes fraction"), rotation=90,
                          va="top", ha="right", fontsize=8, color="tab:red")  # fmt: skip
    ax_steps.set_ylabel("step (rank 0)")
    ax_steps.set_title(title or f"{len(groups)} round(s), {len(nodes)} node(s)")
    if groups:
        ax_steps.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize=8)  # off the events
    ax_nodes.set_yticks(range(len(nodes)), nodes)
    ax_nodes.set_ylim(-0.6, max(len(nodes), 1) - 0.4)
    ax_nodes.invert_yaxis()
    if t0 is not None:
        ax_nodes.set_xlim(left=min(0.0, min(times) - origin))
    ax_nodes.set_xlabel("seconds since the demo started" if t0 is not None else "seconds")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100, format="png")
    finally:
        plt.close(fig)
    return path


def _draw_round(
    ax_steps: Any, ax_nodes: Any, records: Sequence[Record], g: GroupSummary, colour: Any, origin: float,
    lane: dict[str, int],
) -> None:
    """One round ``g`` (a :func:`summarize` group): its span and rank 0's steps on ``ax_steps``,
    each member's bar on its ``lane`` of ``ax_nodes``."""
    ax_steps.axvspan(g.first_t - origin, g.last_t - origin, color=colour, alpha=0.12, linewidth=0)
    steps = sorted((r.t - origin, r.step) for r in records if r.group == g.group and r.kind == "step" and r.rank == 0)
    if steps:
        ax_steps.plot([s[0] for s in steps], [s[1] for s in steps], marker=".", color=colour,
                      label=f"round {g.round}  world {g.world_size}")  # fmt: skip
    for node in g.nodes:
        mine = [r.t - origin for r in records if r.group == g.group and r.node == node]
        ax_nodes.barh(lane[node], max(mine) - min(mine), left=min(mine), height=0.6, color=colour, alpha=0.8)
        ax_nodes.text(min(mine), lane[node], f" r{g.round} w{g.world_size}", va="center", fontsize=7)
