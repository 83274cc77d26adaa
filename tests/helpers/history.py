"""One way to record what clients did, for the project's two checkers (the etcd-v3 interleaving checker
and the store's linearizability checker).

A :class:`History` is a thread-safe, append-only list of :class:`Op` (an operation a client invoked and,
maybe, saw complete) and :class:`Note` (something the test run did to the world: a member killed, a
compaction, a reply dropped). Times are ``time.monotonic_ns()`` of this process, so an operation ``a``
*happened before* ``b`` exactly when ``a.completed < b.invoked``.

An operation ends in one of three outcomes, as in etcd's robustness tests:

* ``ok``: it returned ``result``;
* ``fail``: it raised an error that proves it had no effect (``error`` holds ``repr(exc)``);
* ``unknown``: it raised an error after which it may or may not have taken effect (a timeout, a lost
  reply; ``raised`` holds when), or it never returned. A checker must allow both, at any time after
  ``invoked``.

Usage::

    history = History()
    with history.op("c1", "set", "k", b"v") as op:
        store.set("k", b"v")
        op.ok(None)

An exception escaping the block is recorded as ``unknown`` (and re-raised) unless ``op.fail(exc)`` or
``op.ok(...)`` was called first; ``classify`` passed to :meth:`History.op` may turn an exception into a
``fail`` instead (it returns True for errors that prove no effect).
"""

from __future__ import annotations

import ast
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

OK, FAIL, UNKNOWN = "ok", "fail", "unknown"


@dataclass
class Op:
    id: int
    client: str
    kind: str
    args: tuple[Any, ...]
    invoked: int
    completed: int | None = None
    outcome: str = UNKNOWN
    result: Any = None
    error: str | None = None
    #: when an exception escaped (an unknown outcome that did return, by raising)
    raised: int | None = None

    def ok(self, result: Any = None) -> None:
        self.result, self.outcome, self.completed = result, OK, time.monotonic_ns()

    def fail(self, exc: BaseException | str) -> None:
        self.error, self.outcome, self.completed = repr(exc), FAIL, time.monotonic_ns()

    def __str__(self) -> str:
        end = "..." if self.completed is None else f"{self.completed / 1e6:.3f}"
        what = {OK: f"-> {_short(self.result)}", FAIL: f"!! {self.error}", UNKNOWN: f"?? {self.error or ''}"}
        args = ", ".join(_short(a) for a in self.args)
        return (f"#{self.id} [{self.invoked / 1e6:.3f}, {end}] {self.client}: "
                f"{self.kind}({args}) {what[self.outcome]}")


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, a long one cut in the middle (a chunked value prints its start and size)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit // 2]}...<{len(text)} chars>...{text[-limit // 4:]}"


@dataclass
class Note:
    at: int
    what: str
    detail: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"   [{self.at / 1e6:.3f}] ** {self.what} {self.detail or ''}"


class History:
    """A thread-safe record of operations and notes (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._ops: list[Op] = []
        self._notes: list[Note] = []

    @contextmanager
    def op(self, client: str, kind: str, *args: Any,
           classify: Callable[[BaseException], bool] | None = None) -> Iterator[Op]:
        op = Op(next(self._ids), client, kind, args, time.monotonic_ns())
        with self._lock:
            self._ops.append(op)
        try:
            yield op
        except BaseException as exc:
            if op.completed is None:
                if classify is not None and classify(exc):
                    op.fail(exc)
                else:
                    op.error, op.raised = repr(exc), time.monotonic_ns()
            raise

    def note(self, what: str, **detail: Any) -> None:
        with self._lock:
            self._notes.append(Note(time.monotonic_ns(), what, detail))

    def ops(self) -> list[Op]:
        with self._lock:
            return list(self._ops)

    def notes(self) -> list[Note]:
        with self._lock:
            return list(self._notes)

    def render(self, ops: list[Op] | None = None, notes: bool = True) -> str:
        """The given operations (default: all) and the notes within their span, in time order."""
        chosen = self.ops() if ops is None else ops
        if not chosen:
            return "(no operations)"
        lo = min(o.invoked for o in chosen)
        hi = max(o.completed or o.invoked for o in chosen)
        rows: list[tuple[int, str]] = [(o.invoked, str(o)) for o in chosen]
        if notes:
            rows += [(n.at, str(n)) for n in self.notes() if lo <= n.at <= hi]
        return "\n".join(text for _, text in sorted(rows, key=lambda r: r[0]))

    def dump(self, path: str) -> None:
        """Write the history as JSON (operations and notes), for a failing seed's record.

        Values JSON cannot hold are written as their ``repr`` (bytes as ``"b'...'"``); :meth:`load` reads
        bytes back."""
        data = {"ops": [asdict(o) for o in self.ops()], "notes": [asdict(n) for n in self.notes()]}
        with open(path, "w") as f:
            json.dump(data, f, default=repr, indent=1)

    @classmethod
    def load(cls, path: str) -> History:
        """A history written by :meth:`dump` (to check it again); ``args`` come back as tuples."""
        with open(path) as f:
            data = json.load(f)
        history = cls()
        for o in data["ops"]:
            o["args"] = tuple(_undump(a) for a in o["args"])
            o["result"] = _undump(o["result"])
            history._ops.append(Op(**o))
        history._notes = [Note(**n) for n in data["notes"]]
        return history


def _undump(value: Any) -> Any:
    if isinstance(value, list):
        return [_undump(v) for v in value]
    if isinstance(value, str) and value[:2] in ("b'", 'b"'):
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value
    return value
