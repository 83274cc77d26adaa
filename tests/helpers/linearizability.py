"""A linearizability checker for histories recorded with :mod:`helpers.history`.

The search is Wing & Gong's, with Lowe's just-in-time linearization and memoization (the approach
of etcd's robustness tests and of porcupine; written here from the papers' description):

* every completed operation is a *call* entry at ``invoked`` and a *return* entry at ``completed``,
  in one time-ordered list; an operation whose outcome is unknown has no return entry (it may take
  effect at any point after its invocation, or never);
* the search walks the list: at a call it tries to linearize that operation now (the model accepts
  its result in the current state), lifts it out of the list and starts again from the head; at a
  return whose operation is not yet linearized it backtracks;
* a (linearized set, model state) pair already explored is not explored again.

A history is linearizable when every operation that returned can be linearized. The model may be
non-deterministic (``step`` returns the list of possible next states), which lets a fragment start
from an unknown state (:data:`ANY`) when a failure is minimized.

Histories are partitioned per key (P-compositionality): operations that touch the same keys form
one partition (multi-key operations join theirs), each checked alone. :func:`check` returns a
:class:`Verdict`; a failing one names the smallest failing partition, shrunk to a minimal
fragment (:func:`minimal_fragment`).

The model (:class:`StoreModel`) is TCPStore's sequential semantics; see its docstring for how the
recorded results encode timeouts and empty queues.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from helpers.history import FAIL, OK, UNKNOWN, Op

log = logging.getLogger(__name__)

__all__ = ["ANY", "Partition", "SearchBudgetExceeded", "StoreModel", "Verdict", "check", "patch",
           "linearizable", "minimal_fragment", "partitions"]


class _Any:
    """An unknown state (a fragment's start): it becomes whatever the first observation shows."""

    _instance: _Any | None = None

    def __new__(cls) -> _Any:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ANY"


ANY: Any = _Any()

Key = Hashable
State = tuple[Any, ...]


class SearchBudgetExceeded(Exception):
    """The search explored more than its budget of steps without a verdict."""


class StoreModel:
    """TCPStore's sequential semantics, per key.

    Keys are ``("reg", name)`` (plain keys) and ``("queue", name)``; a plain key holds ``bytes`` or
    ``None`` (missing), a queue a tuple of items. Operations and the results the recorder stores
    (``op.ok(result)``):

    ==============================  ==================================================
    ``set(k, v)``                    ``None``
    ``get(k)``                       the value; ``None`` when it timed out (missing)
    ``add(k, d)``                    the new integer
    ``append(k, v)``                 ``None``
    ``compare_set(k, e, d)``         the value after the op (torch: ``d`` if it was set,
                                     ``e`` if ``k`` was missing and ``e`` non-empty,
                                     else the current value; a missing ``k`` with ``e == b""``
                                     is created)
    ``delete_key(k)``                whether ``k`` existed
    ``check([k...])``                whether every key exists
    ``wait([k...])``                 True when it returned, False when it timed out
                                     (then some key was missing)
    ``multi_get([k...])``            the values; ``None`` when it timed out
    ``multi_set([k...], [v...])``    ``None`` (one atomic write)
    ``queue_push(q, v)``             ``None``
    ``queue_pop(q)``                 the oldest item; ``None`` when the queue was empty
    ==============================  ==================================================

    A state may hold :data:`ANY` (a plain key whose value is unknown; a queue ``(ANY, *items)``
    whose front is unknown): the model then allows every result that some concrete state allows,
    and narrows the state where the result tells.
    """

    READ_ONLY = frozenset({"get", "check", "wait", "multi_get"})

    def keys(self, op: Op) -> list[Key]:
        a = op.args
        if op.kind in ("queue_push", "queue_pop"):
            return [("queue", a[0])]
        if op.kind in ("check", "wait", "multi_get", "multi_set"):
            return [("reg", k) for k in a[0]]
        return [("reg", a[0])]

    def read_only(self, op: Op) -> bool:
        return op.kind in self.READ_ONLY

    def writes(self, op: Op) -> list[tuple[Key, Any]]:
        """(key, value) pairs ``op`` writes if it takes effect."""
        a = op.args
        if op.kind in ("set", "queue_push"):
            return [(self.keys(op)[0], a[1])]
        if op.kind == "compare_set":
            return [(("reg", a[0]), a[2])]
        if op.kind == "multi_set":
            return [(("reg", k), v) for k, v in zip(a[0], a[1], strict=True)]
        return []

    def observes(self, op: Op) -> list[tuple[Key, Any]]:
        """(key, value) pairs a returned ``op`` saw written by some other op."""
        r, a = op.result, op.args
        if op.outcome != OK or r is None:
            return []
        if op.kind in ("get", "queue_pop"):
            return [(self.keys(op)[0], r)]
        if op.kind == "compare_set" and r not in (a[1], a[2]):
            return [(("reg", a[0]), r)]
        if op.kind == "multi_get":
            return [(("reg", k), v) for k, v in zip(a[0], r, strict=True)]
        return []

    def init(self, keys: Sequence[Key], unknown: bool = False) -> State:
        if unknown:
            return tuple((ANY,) if k[0] == "queue" else ANY for k in keys)  # type: ignore[index]
        return tuple(() if k[0] == "queue" else None for k in keys)  # type: ignore[index]

    def step(self, keys: Sequence[Key], state: State, op: Op) -> list[State]:
        """The states after ``op`` in ``state`` that agree with its result (none: not allowed here)."""
        index = {k: i for i, k in enumerate(keys)}
        slots = [index[k] for k in self.keys(op)]
        known = op.outcome == OK
        kind, a = op.kind, op.args
        if kind in ("check", "wait", "multi_get", "multi_set"):
            return self._multi(state, slots, op, known)
        cur = state[slots[0]]
        if kind == "queue_push":
            nexts = [(*cur, a[1])]
        elif kind == "queue_pop":
            nexts = _pop(cur, op.result, known)
        else:
            nexts = _register(kind, a, cur, op.result, known)
        return [_put(state, slots[0], v) for v in nexts]

    def _multi(self, state: State, slots: list[int], op: Op, known: bool) -> list[State]:
        vals = [state[i] for i in slots]
        if op.kind == "multi_set":
            out = list(state)
            for i, v in zip(slots, op.args[1], strict=True):
                out[i] = v
            return [tuple(out)]
        if op.kind == "multi_get" and op.result is not None:
            if all(v is ANY or v == r for v, r in zip(vals, op.result, strict=True)):
                out = list(state)
                for i, r in zip(slots, op.result, strict=True):
                    out[i] = r
                return [tuple(out)]
            return []
        want = bool(op.result) if op.kind != "multi_get" else False
        if all(v is not None and v is not ANY for v in vals):
            return [state] if want else []
        if any(v is None for v in vals):
            return [] if want else [state]
        if want:  # the unknown ones exist, values still unknown
            return [state]
        # some unknown key was missing: each ANY alone may be the missing one
        return [_put(state, i, None) for i in slots if state[i] is ANY]


def _put(state: State, i: int, v: Any) -> State:
    return (*state[:i], v, *state[i + 1:])


def _register(kind: str, a: tuple[Any, ...], cur: Any, result: Any, known: bool) -> list[Any]:
    if kind == "set":
        return [a[1]]
    if kind == "get":
        if cur is ANY:
            return [result]
        return [cur] if cur == result else []
    if kind == "append":
        return [ANY] if cur is ANY else [(cur or b"") + a[1]]
    if kind == "delete_key":
        if known and cur is not ANY and (cur is not None) != result:
            return []
        return [None]
    if kind == "add":
        if cur is ANY:
            return [str(result).encode()] if known else [ANY]
        try:
            new = (0 if cur is None else int(cur)) + a[1]
        except ValueError:
            return [] if known else [cur]  # add on a non-integer fails: no effect
        return [str(new).encode()] if not known or new == result else []
    if kind == "compare_set":
        expected, desired = a[1], a[2]
        if cur is ANY:
            if not known:
                return [ANY]
            if result == desired:
                return [desired]
            return [None] if result == expected else [result]
        if cur is None:
            new, ret = (desired, desired) if expected == b"" else (None, expected)
        elif cur == expected:
            new, ret = desired, desired
        else:
            new, ret = cur, cur
        return [new] if not known or ret == result else []
    raise ValueError(f"the store model does not know {kind!r}")


def _pop(cur: tuple[Any, ...], result: Any, known: bool) -> list[tuple[Any, ...]]:
    front_unknown = bool(cur) and cur[0] is ANY
    items = cur[1:] if front_unknown else cur
    if not known:  # it may have removed the front item
        if front_unknown:
            return [cur, items[1:]] if items else [cur, ()]
        return [items[1:]]
    if result is None:
        return [()] if not items else []
    nexts = [cur] if front_unknown else []  # the item came from the unknown front
    if items and items[0] == result:
        nexts.append(items[1:])
    return nexts


# ------------------------------------------------------------------ the search


@dataclass
class Partition:
    """The operations of one group of keys (read-only ops of unknown outcome and failed ops left out)."""

    keys: list[Key]
    ops: list[Op]


def patch(ops: Sequence[Op], model: StoreModel) -> list[Op]:
    """``ops`` without what cannot matter, and unknown outcomes bounded where a unique value shows them.

    Failed ops and reads of unknown outcome are left out. A write of unknown outcome whose value
    (written by no other op) a returned op saw took effect before that op returned: it gets that
    completion time (its result stays unknown). A ``queue_push`` of unknown outcome whose item
    nobody popped is left out (were it in the queue, no op could tell but by being refused).
    """
    kept = [o for o in ops if o.outcome != FAIL and not (o.outcome == UNKNOWN and model.read_only(o))]
    writers: dict[tuple[Key, Any], int] = {}
    for o in kept:
        for kv in model.writes(o):
            writers[kv] = writers.get(kv, 0) + 1
    seen_by: dict[tuple[Key, Any], int] = {}
    for o in kept:
        for kv in model.observes(o):
            if o.completed is not None and writers.get(kv) == 1:
                seen_by[kv] = min(seen_by.get(kv, o.completed), o.completed)
    out = []
    for o in kept:
        if o.outcome == UNKNOWN and o.completed is None:
            shown = [seen_by[kv] for kv in model.writes(o) if kv in seen_by and seen_by[kv] > o.invoked]
            if shown:
                o = dataclasses.replace(o, completed=min(shown))
            elif o.kind == "queue_push":
                continue
        out.append(o)
    return out


def partitions(ops: Sequence[Op], model: StoreModel) -> list[Partition]:
    """Split ``ops`` into groups of keys that no operation crosses (union-find over keys)."""
    parent: dict[Key, Key] = {}

    def find(k: Key) -> Key:
        while parent.setdefault(k, k) != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    kept = patch(ops, model)
    for o in kept:
        ks = model.keys(o)
        for k in ks[1:]:
            parent[find(k)] = find(ks[0])
    groups: dict[Key, Partition] = {}
    for o in kept:
        root = find(model.keys(o)[0])
        groups.setdefault(root, Partition([], [])).ops.append(o)
    for k in parent:
        groups[find(k)].keys.append(k)
    for p in groups.values():
        p.keys.sort(key=repr)
    return sorted(groups.values(), key=lambda p: repr(p.keys))


def linearizable(
    ops: Sequence[Op], model: StoreModel, keys: Sequence[Key], *, unknown_start: bool = False,
    budget: int = 5_000_000,
) -> bool:
    """Whether ``ops`` (all on ``keys``) are linearizable; ``unknown_start``: from :data:`ANY` states.

    Raises :class:`SearchBudgetExceeded` after ``budget`` steps."""
    ops = [o for o in ops if o.outcome != FAIL and not (o.outcome == UNKNOWN and model.read_only(o))]
    n = len(ops)  # the ops are patched already (see :func:`patch`) when they come from a partition
    # entries: (time, 0 call / 1 return, op index); a call sorts before a return at the same time
    events = [(o.invoked, 0, i) for i, o in enumerate(ops)]
    events += [(o.completed, 1, i) for i, o in enumerate(ops) if o.completed is not None]
    events.sort()
    m = len(events)
    # a doubly linked list over entries 1..m, 0 the head
    nxt = list(range(1, m + 3))
    prv = list(range(-1, m + 1))
    call_at = [0] * n
    ret_at = [-1] * n
    for pos, (_, is_ret, i) in enumerate(events, start=1):
        (ret_at if is_ret else call_at)[i] = pos
    end = m + 1

    def lift(i: int) -> None:
        for pos in (call_at[i], ret_at[i]):
            if pos >= 0:
                nxt[prv[pos]] = nxt[pos]
                prv[nxt[pos]] = prv[pos]

    def unlift(i: int) -> None:
        for pos in (ret_at[i], call_at[i]):
            if pos >= 0:
                prv[nxt[pos]] = pos
                nxt[prv[pos]] = pos

    known_left = sum(o.completed is not None for o in ops)
    if not known_left:
        return True

    def candidates(state: State, linearized: int) -> Iterator[tuple[int, State]]:
        """The ops that may come next (called before the first pending return), those that returned
        first, each with the states it may leave."""
        order: list[int] = []
        later: list[int] = []
        pos = nxt[0]
        while pos != end and not events[pos - 1][1]:
            i = events[pos - 1][2]
            (order if ops[i].completed is not None else later).append(i)
            pos = nxt[pos]
        for i in order + later:
            for after in model.step(keys, state, ops[i]):
                yield i, after

    state = model.init(keys, unknown_start)
    linearized = 0
    seen: set[tuple[int, State]] = set()
    # frames: (the op that led here, the state before it, what to try next from here)
    stack: list[tuple[int, State, Iterator[tuple[int, State]]]] = [(-1, state, candidates(state, 0))]
    steps = 0
    while stack:
        led_by, before, tries = stack[-1]
        for i, after in tries:
            steps += 1
            if steps > budget:
                raise SearchBudgetExceeded(f"{steps} steps over {n} operations")
            bit = linearized | (1 << i)
            if (bit, after) in seen:
                continue
            seen.add((bit, after))
            lift(i)
            stack.append((i, state, candidates(after, bit)))
            state, linearized = after, bit
            known_left -= ops[i].completed is not None
            if not known_left:
                return True
            break
        else:
            stack.pop()
            if led_by >= 0:
                unlift(led_by)
                state, linearized = before, linearized & ~(1 << led_by)
                known_left += ops[led_by].completed is not None
    return False


# ------------------------------------------------------------------ minimal fragments


def _prefix(ops: list[Op], count: int, model: StoreModel) -> list[Op]:
    """The first ``count`` ops by invocation, as seen just before the next one is invoked: later
    completions become unknown outcomes (linearizable whenever the whole history is)."""
    cut = ops[count].invoked if count < len(ops) else None
    out = []
    for o in ops[:count]:
        if cut is not None and o.completed is not None and o.completed >= cut:
            if model.read_only(o):
                continue
            o = dataclasses.replace(o, outcome=UNKNOWN, completed=None)
        out.append(o)
    return out


def minimal_fragment(part: Partition, model: StoreModel, budget: int = 2_000_000) -> tuple[list[Op], bool]:
    """A short non-linearizable fragment of a non-linearizable partition: (ops, from an unknown start).

    The shortest failing prefix (binary search; later completions as unknown outcomes), then the
    latest cut after which it still fails from :data:`ANY` states (a cut where every earlier op
    that returned did so before any later op was invoked; earlier unknown-outcome writes are kept).
    """
    ops = sorted(part.ops, key=lambda o: o.invoked)

    def fails(fragment: list[Op], unknown: bool) -> bool:
        try:
            return not linearizable(fragment, model, part.keys, unknown_start=unknown, budget=budget)
        except SearchBudgetExceeded:
            return False

    lo, hi = 1, len(ops)
    while lo < hi:
        mid = (lo + hi) // 2
        if fails(_prefix(ops, mid, model), False):
            hi = mid
        else:
            lo = mid + 1
    prefix = _prefix(ops, hi, model)
    if not fails(prefix, False):
        return ops, False
    done_by = -1
    cuts = []
    for i, o in enumerate(prefix):
        if i and done_by < o.invoked:
            cuts.append(i)
        if o.completed is not None:
            done_by = max(done_by, o.completed)
    for i in reversed(cuts):
        tail = [o for o in prefix[:i] if o.completed is None] + prefix[i:]
        if fails(tail, True):
            return tail, True
    return prefix, False


# ------------------------------------------------------------------ the whole check


@dataclass
class Verdict:
    """The result of :func:`check`: ``ok``, the failing partitions' keys, a minimal fragment."""

    ok: bool
    operations: int
    partitions: int
    failing: list[list[Key]] = field(default_factory=list)
    undecided: list[list[Key]] = field(default_factory=list)
    fragment: list[Op] = field(default_factory=list)
    from_unknown: bool = False

    def explain(self, render: Callable[[list[Op]], str]) -> str:
        if self.ok:
            return f"linearizable: {self.operations} operations in {self.partitions} partitions"
        lines = [f"NOT linearizable: {len(self.failing)} of {self.partitions} partitions fail "
                 f"({self.failing}); undecided (search budget): {self.undecided}"]
        if self.fragment:
            start = "an unknown state" if self.from_unknown else "the empty store"
            lines.append(f"minimal failing fragment ({len(self.fragment)} ops, from {start}):")
            lines.append(render(self.fragment))
        return "\n".join(lines)


def check(ops: Sequence[Op], model: StoreModel | None = None, budget: int = 5_000_000) -> Verdict:
    """Check a whole history partition by partition; minimize the smallest failing partition.

    A partition whose search exceeds ``budget`` steps counts as failing (undecided)."""
    model = model or StoreModel()
    parts = partitions(ops, model)
    verdict = Verdict(True, len(ops), len(parts))
    bad: list[Partition] = []
    for part in parts:
        try:
            good = linearizable(part.ops, model, part.keys, budget=budget)
        except SearchBudgetExceeded:
            verdict.undecided.append(part.keys)
            verdict.ok = False
            continue
        if not good:
            verdict.failing.append(part.keys)
            bad.append(part)
            verdict.ok = False
    if bad:
        smallest = min(bad, key=lambda p: len(p.ops))
        verdict.fragment, verdict.from_unknown = minimal_fragment(smallest, model)
    return verdict
