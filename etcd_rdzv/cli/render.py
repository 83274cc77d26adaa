"""Text output of ``list`` and ``show`` (the JSON output is the documents of :mod:`.runs`).

Everything shown comes from etcd, which any writer of the prefix controls, so every value
passes :func:`esc` on its way to a terminal: control and other non-printable characters
(escape sequences, OSC 52 clipboard writes, newlines that would forge rows, bidi overrides)
are shown as ``\\xNN``/``\\uNNNN`` and a value is cut at :data:`CELL_LIMIT` characters. The
JSON output (``--json``) is exact: ``json.dumps`` escapes control characters itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from .runs import NodeInfo, RunInfo

__all__ = ["CELL_LIMIT", "esc", "format_seconds", "render_list", "render_show", "table"]

CELL_LIMIT = 200
"""The most characters of one value in text output (then ``...``)."""


def esc(value: object, limit: int = CELL_LIMIT) -> str:
    """``str(value)`` safe for a terminal: non-printable characters escaped, cut at ``limit``."""
    text = str(value)
    cut = len(text) > limit
    out = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[:limit])
    return out + "..." if cut else out


def format_seconds(value: float | None) -> str:
    """``-`` for unknown, ``gone`` for an expired lease, else ``1h02m``, ``5m03s``, ``12s``."""
    if value is None:
        return "-"
    if value < 0:
        return "gone"
    s = int(value)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, header))] + [[esc(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def render_list(runs: Sequence[RunInfo], errors: Sequence[tuple[str, str, str]] = ()) -> str:
    rows: list[tuple[object, ...]] = [
        (r.run_id, r.backend, r.round, r.world_size, len(r.members), len(r.waiting),
         "yes" if r.closed else "no", format_seconds(r.age_s), format_seconds(r.expiry_s))
        for r in runs
    ]
    rows += [(run_id, backend, "?", "?", "?", "?", "?", "-", f"unreadable: {why}")
             for run_id, backend, why in errors]
    if not rows:
        return "no rendezvous runs"
    return table(("RUN_ID", "BACKEND", "ROUND", "WORLD", "MEMBERS", "WAITING", "CLOSED", "AGE", "EXPIRY"), rows)


def _nodes(nodes: Sequence[NodeInfo], v3: bool) -> str:
    if v3:
        return table(("RANK", "NODE", "HOST", "PORT", "LEASE"), [
            ("-" if n.rank is None else n.rank, n.node_id, n.host or "-", n.port or "-",
             format_seconds(n.lease_ttl_s) if n.present else "left")
            for n in nodes
        ])
    return table(("RANK", "NODE", "HOST", "PID", "HEARTBEAT"), [
        ("-" if n.rank is None else n.rank, n.node_id, n.host or "-", n.pid or "-",
         "-" if n.heartbeat_age_s is None else f"{format_seconds(n.heartbeat_age_s)} ago")
        for n in nodes
    ])


def render_show(run: RunInfo) -> str:
    v3 = run.backend == "etcd-v3"
    state = "closed" if run.closed else "open"
    if run.complete is False:
        state += ", round filling"
    head = [
        f"run {esc(run.run_id)} ({run.backend}): round {run.round}, world_size {run.world_size}, {state}",
        f"  expiry {format_seconds(run.expiry_s)}"
        + ("" if run.age_s is None else f", last heartbeat {format_seconds(run.age_s)} ago")
        + ("" if run.store_keys is None else f", store keys {run.store_keys}"),
    ]
    parts = ["\n".join(head)]
    parts.append("members:\n" + (_indent(_nodes(run.members, v3)) if run.members else "  (none)"))
    parts.append("waiting:\n" + (_indent(_nodes(run.waiting, v3)) if run.waiting else "  (none)"))
    return "\n".join(parts)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())
