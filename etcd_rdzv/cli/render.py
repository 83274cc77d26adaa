"""Text output of ``list`` and ``show`` (the JSON output is the documents of :mod:`.runs`), and the
one escaping rule of everything the command writes to a terminal.

Run ids, node ids, hosts, keys, role names and error texts come from etcd, which any writer of
the prefix controls. :func:`esc` makes them safe: non-printable characters (escape sequences,
OSC 52 clipboard writes, BEL, CR, newlines that would forge rows or log lines, C1 controls,
bidi overrides) are shown as ``\\xNN``/``\\uNNNN`` and a value is cut at :data:`CELL_LIMIT`
characters. It is applied twice:

* to each value put in a table cell, a ``watch`` line or a message (so a newline cannot
  start a row, and cells line up);
* at :mod:`.main`'s three ways out, whatever the code path: every stdout line (``_out``,
  :func:`esc_lines`), every stderr line it prints (``_err``; an error line escaped whole),
  and every log record of its handler (:class:`EscapingFormatter`: warnings, ``-v``/``-vv``,
  tracebacks, from any logger).

The JSON output (``--json``) is exact: ``json.dumps`` escapes control and non-ASCII characters
itself, so the last pass changes nothing in it.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence
from typing import Any

from .runs import NodeInfo, RunInfo

__all__ = [
    "CELL_LIMIT",
    "LINE_LIMIT",
    "EscapingFormatter",
    "esc",
    "esc_lines",
    "format_seconds",
    "render_list",
    "render_show",
    "table",
]

CELL_LIMIT = 200
"""The most characters of one value in text output (then ``...``)."""

LINE_LIMIT = 2000
"""The most characters of an error line or a log message (values in it are escaped)."""


def esc(value: object, limit: int | None = CELL_LIMIT) -> str:
    """``str(value)`` safe for a terminal: non-printable characters escaped (a newline too), cut at
    ``limit`` characters (None: never)."""
    text = str(value)
    cut = limit is not None and len(text) > limit
    if cut:
        text = text[:limit]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return text + "..." if cut else text


def esc_lines(text: str) -> str:
    """``text`` safe for a terminal, line by line: each line as :func:`esc` shows it (uncut), the
    newlines between lines kept. Printable text (tables, JSON) comes back unchanged."""
    if text.isprintable():
        return text
    return "\n".join(esc(line, None) for line in text.split("\n"))


class EscapingFormatter(logging.Formatter):
    """A formatter escaping every line (:func:`esc`): the message is one line cut at :data:`LINE_LIMIT`
    (its arguments may hold anything etcd holds), and so is each exception's message in a traceback
    (its frames are code). The record itself is left as it is for other handlers.
    """

    def format(self, record: logging.LogRecord) -> str:
        copy = logging.makeLogRecord(record.__dict__)
        copy.msg, copy.args, copy.exc_text = esc(record.getMessage(), LINE_LIMIT), None, None
        return esc_lines(super().format(copy))

    def formatException(self, ei: Any) -> str:
        """The traceback as Python prints it (chained exceptions too), each exception's
        ``Type: message`` line escaped whole."""
        chain: list[BaseException] = []
        exc = ei[1]
        while exc is not None and not any(exc is c for c in chain) and len(chain) < 16:
            chain.append(exc)
            exc = exc.__cause__ if exc.__cause__ is not None else None if exc.__suppress_context__ else exc.__context__
        lines: list[str] = []
        oldest_first = chain[::-1]
        for older, e in zip([None, *oldest_first[:-1]], oldest_first, strict=True):
            if older is not None:
                lines += ["", "The above exception was the direct cause of the following exception:"
                          if e.__cause__ is older else
                          "During handling of the above exception, another exception occurred:", ""]
            lines.append("Traceback (most recent call last):")
            lines += [frame.rstrip("\n") for frame in traceback.format_tb(e.__traceback__)]
            kind = type(e).__qualname__
            if type(e).__module__ not in ("builtins", "__main__"):
                kind = f"{type(e).__module__}.{kind}"
            try:
                text = str(e)
            except Exception:  # an exception's __str__ may fail; Python prints this then
                text = "<exception str() failed>"
            lines.append(f"{kind}: {esc(text, LINE_LIMIT)}" if text else kind)
        return esc_lines("\n".join(lines))


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
