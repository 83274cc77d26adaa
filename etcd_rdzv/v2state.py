"""torch's pickled ``etcd-v2`` rendezvous state, read without running what a key holds.

torch's ``DynamicRendezvousHandler`` keeps its ``_RendezvousState`` as a pickle, which our
``etcd-v2``/``etcd`` backend stores (opaque bytes) as base64 under ``<key_prefix>/<run_id>``,
and torch's state holder ``pickle.loads`` whatever the backend returns. Anyone who can write
that key could run code on every agent, so both our state holder
(:class:`etcd_rdzv.dynamic.state.CheckedStates`: :func:`load_state`, then torch gets a state
built from the checked values, never the stored bytes) and the ``etcd-rdzv`` CLI
(:func:`decode_state`) pass a value through this module, which

1. bounds it: at most :data:`MAX_STATE_BYTES` of pickle (a state of 10,000 nodes is 1.1 MB);
2. scans its opcodes without building objects (:func:`_scan`): no persistent ids,
   extension codes or out-of-band buffers, memo indexes within the pickle, and tuples
   nested at most :data:`MAX_TUPLE_DEPTH` deep (hashing a deeply nested tuple, as
   unpickling a dict key or set item does, overflows the C stack of any unpickler:
   a 1 MB pickle crashes the process);
3. unpickles with :class:`_StateUnpickler`, whose ``find_class`` admits only
   ``_RendezvousState`` and ``_NodeDesc`` of torch's ``dynamic_rendezvous`` (replaced by
   inert stand-ins that merely record the attributes the pickle sets; torch is not
   imported), ``datetime.datetime``/``timezone``/``timedelta`` (the heartbeat times and the
   deadline) and ``builtins.set``/``frozenset``, and refuses every other global;
4. checks the stand-ins field by field (:func:`_check_state`; a stand-in built by no BUILD or
   by two is refused, times must carry a time zone) and returns plain data (:class:`V2State`).

With these globals the only callables a pickle can reach are those constructors, so even a
``pickle.loads`` of a value that passed could run no other code; still, what a pickle can do
to torch's real classes (a ``__setstate__`` in the instance dict) differs from what it does
to the stand-ins, so the state holder does not unpickle the value itself. Every refusal raises
:class:`StateDecodeError` naming the key; its message is short (at most
:data:`MAX_MESSAGE` characters of escaped text, never the ``repr`` of what the pickle built).
Nothing here does I/O or imports torch.
"""

from __future__ import annotations

import binascii
import io
import logging
import pickle
import pickletools
from base64 import b64decode
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "MAX_STATE_BYTES", "NodeDesc", "STATE_FIELDS", "StateDecodeError", "V2State", "TORCH_MODULE", "decode_state",
    "load_state", "state_bytes",
]

TORCH_MODULE = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
STATE_FIELDS = frozenset(
    {"round", "complete", "deadline", "closed", "participants", "wait_list", "redundancy_list",
     "last_heartbeats"}
)
"""The attributes of torch's ``_RendezvousState`` (torch 2.4 to 2.15), each checked and carried by :class:`V2State`."""


class StateDecodeError(ValueError):
    """A state key holds something that is not torch's rendezvous state."""


class _StandIn:
    """An inert object that records what the pickle's BUILD sets, and nothing else.

    ``fields`` is ``None`` until a BUILD ran (unpickling creates the object without calling
    ``__init__``; a pickle without BUILD leaves it ``None``, which the checks refuse). A second
    BUILD of the same object is refused: torch's pickles build each object once, while torch's
    classes would run, at the second, a ``__setstate__`` that the first put in the instance dict,
    keeping the first BUILD's fields where this stand-in would record the second's.
    """

    what = "object"
    fields: dict[str, Any] | None = None

    def __setstate__(self, state: Any) -> None:
        if self.fields is not None:
            raise pickle.UnpicklingError(f"a {self.what} built twice (torch's pickles build each object once)")
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
            state = state[1]  # (None, slots) of a class with __slots__ only
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise pickle.UnpicklingError(f"unexpected object state {type(state).__name__}")
        self.fields = dict(state)


class _StateStandIn(_StandIn):
    what = "_RendezvousState"


class _NodeStandIn(_StandIn):
    what = "_NodeDesc"


_ALLOWED: dict[tuple[str, str], Any] = {
    (TORCH_MODULE, "_RendezvousState"): _StateStandIn,
    (TORCH_MODULE, "_NodeDesc"): _NodeStandIn,
    ("datetime", "datetime"): datetime,
    ("datetime", "timezone"): timezone,
    ("datetime", "timedelta"): timedelta,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


class _StateUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals of :data:`_ALLOWED` (see the module doc)."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load {clip(f'{module}.{name}')}") from None


@dataclass(frozen=True, order=True)
class NodeDesc:
    """A node of torch's state: its ``repr`` in torch is ``<addr>_<pid>_<local_id>``."""

    addr: str
    pid: int
    local_id: int

    @property
    def node_id(self) -> str:
        return f"{self.addr}_{self.pid}_{self.local_id}"


@dataclass(frozen=True)
class V2State:
    """torch's ``_RendezvousState`` as plain data."""

    round: int
    complete: bool
    closed: bool
    deadline: datetime | None
    participants: dict[NodeDesc, int] = field(default_factory=dict)
    wait_list: frozenset[NodeDesc] = frozenset()
    redundancy_list: frozenset[NodeDesc] = frozenset()
    last_heartbeats: dict[NodeDesc, datetime] = field(default_factory=dict)
    unknown: tuple[str, ...] = ()  # attributes of the pickle that torch's state of today lacks

    def newest_heartbeat(self) -> datetime | None:
        return max(self.last_heartbeats.values(), default=None)

    def members(self) -> list[tuple[NodeDesc, int]]:
        """The participants of a complete round in rank order (none while the round fills)."""
        if not self.complete:
            return []
        return sorted(self.participants.items(), key=lambda item: (item[1], item[0]))

    def waiting(self) -> list[NodeDesc]:
        """Nodes waiting for a round: the joiners of an incomplete round, then the wait list."""
        joining = [] if self.complete else sorted(self.participants)
        return joining + sorted(self.wait_list - set(joining))


MAX_STATE_BYTES = 16 * 1024 * 1024
"""The largest state pickle accepted (etcd's default request limit allows ~1.1 MB; 10,000 nodes)."""

MAX_TUPLE_DEPTH = 16
"""How deep tuples may nest in a state (torch's never nest a tuple in a tuple)."""

MAX_MESSAGE = 200
"""The most characters of text taken from a value that an error message carries."""

_REFUSED_OPS = frozenset({"PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER"})
_MARK = -1


def _op_table() -> dict[Any, tuple[str, int, int]]:
    """For each opcode: what :func:`_scan` does (its kind), its operands (those below the
    mark for an opcode that takes one), the number of results it pushes."""
    table: dict[Any, tuple[str, int, int]] = {}
    for op in pickletools.opcodes:
        before = op.stack_before
        marked = pickletools.markobject in before
        below = before.index(pickletools.markobject) if marked else len(before)
        kind = ("refuse" if op.name in _REFUSED_OPS else "mark" if op.name == "MARK"
                else "put" if op.name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE")
                else "get" if op.name in ("GET", "BINGET", "LONG_BINGET")
                else "mtuple" if op.name == "TUPLE" else "tuple" if "TUPLE" in op.name
                else "dup" if op.name == "DUP"
                else "marked" if marked else "plain")
        table[op] = (kind, below, len(op.stack_after))
    return table


_OPS = _op_table()


def clip(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` with control and non-ASCII characters escaped, cut to about ``limit`` characters."""
    out = text[: limit + 1].encode("ascii", "backslashreplace").decode("ascii")
    out = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in out)
    return out if len(out) <= limit and len(text) <= limit else out[:limit] + "..."


def _brief(obj: Any) -> str:
    """A bounded description of a value a pickle built: small scalars by value, else the type."""
    if obj is None or isinstance(obj, bool) or (isinstance(obj, int) and abs(obj) < 10**18):
        return repr(obj)
    if isinstance(obj, str):
        return repr(clip(obj, 60))
    return f"a {type(obj).__name__}"


def state_bytes(value: bytes, key: str = "the state key") -> bytes:
    """The pickle of torch's state that ``value`` (its base64, as stored) holds, once checked.

    Returns the decoded bytes unchanged, after :func:`load_state` accepted them. Raises :class:`StateDecodeError` naming ``key`` when the
    value is not base64, too large, or not torch's rendezvous state.
    """
    if len(value) > (MAX_STATE_BYTES // 3 + 1) * 4:
        raise StateDecodeError(
            f"{key} holds {len(value)} bytes, more than a rendezvous state may "
            f"({MAX_STATE_BYTES} bytes of pickle)"
        )
    try:
        raw = b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise StateDecodeError(f"{key} does not hold base64 (not an etcd-v2 rendezvous state)") from None
    load_state(raw, key)
    return raw


def decode_state(value: bytes, key: str = "the state key") -> V2State:
    """The state stored (base64 of torch's pickle) in ``value``; errors name ``key``.

    Raises :class:`StateDecodeError` as :func:`state_bytes`.
    """
    return load_state(state_bytes(value, key), key)


def load_state(raw: bytes, key: str = "the state key") -> V2State:
    """torch's pickled ``_RendezvousState`` in ``raw`` as plain data, checked as the module says.

    Raises :class:`StateDecodeError` naming ``key`` (never executing anything the pickle names).
    """
    if len(raw) > MAX_STATE_BYTES:
        raise StateDecodeError(f"{key} holds a {len(raw)}-byte pickle, more than {MAX_STATE_BYTES} bytes")
    _scan(raw, key)
    try:
        obj = _StateUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, IndexError,
            KeyError, MemoryError, RecursionError, OverflowError) as e:
        raise StateDecodeError(
            f"{key} does not hold torch's rendezvous state: {type(e).__name__}: {clip(str(e))}"
        ) from None
    if not isinstance(obj, _StateStandIn):
        raise StateDecodeError(f"{key} holds a pickled {type(obj).__name__}, not a _RendezvousState")
    if obj.fields is None:
        raise StateDecodeError(f"{key} holds a _RendezvousState pickled without its fields (no BUILD)")
    return _check_state(obj.fields, key)


def _scan(raw: bytes, key: str) -> None:
    """Walk the opcodes of ``raw`` (no object is built) and refuse what :func:`load_state` must not load.

    Tracks, for each stack item, how deep it nests tuples (all a dict key or set item's hash
    recurses through); memo entries keep that depth. Raises :class:`StateDecodeError`.
    """
    stack: list[int] = []  # tuple depth of each item (0: not a tuple), or _MARK
    memo: dict[Any, int] = {}

    def bad(what: str) -> StateDecodeError:
        return StateDecodeError(f"{key} does not hold torch's rendezvous state: {what}")

    try:
        for op, arg, pos in pickletools.genops(raw):
            kind, below, pushed = _OPS[op]
            if kind == "plain":
                if below:
                    if below > len(stack) or _MARK in stack[-below:]:
                        raise bad(f"a malformed pickle (stack underflow at byte {pos})")
                    del stack[-below:]
                stack.extend([0] * pushed)
            elif kind == "put":
                index = len(memo) if arg is None else arg
                if not stack or stack[-1] == _MARK or index > len(raw):
                    raise bad(f"a malformed memo entry at byte {pos}")
                memo[index] = stack[-1]
            elif kind == "get":
                if arg not in memo:
                    raise bad(f"a missing memo entry at byte {pos}")
                stack.append(memo[arg])
            elif kind == "mark":
                stack.append(_MARK)
            elif kind == "refuse":
                raise bad(f"opcode {op.name} at byte {pos}")
            else:
                _apply(kind, below, pushed, stack, bad, pos)
    except ValueError as e:  # genops: truncated data, an unknown opcode, a bad argument
        if isinstance(e, StateDecodeError):
            raise
        raise bad(f"a malformed pickle ({clip(str(e))})") from None


def _apply(kind: str, below: int, pushed: int, stack: list[int], bad: Any, pos: int | None) -> None:
    """:func:`_scan`'s step for the opcodes that take a mark, build tuples or duplicate."""
    if kind in ("marked", "mtuple"):
        if _MARK not in stack:
            raise bad(f"a malformed pickle (no mark for the opcode at byte {pos})")
        mark = len(stack) - 1 - stack[::-1].index(_MARK)
        items = stack[mark + 1:]
        del stack[mark:]
    else:
        items = []  # the operands are popped below
    if below:
        if below > len(stack) or _MARK in stack[-below:]:
            raise bad(f"a malformed pickle (stack underflow at byte {pos})")
        if kind not in ("marked", "mtuple"):
            items = stack[-below:]
        del stack[-below:]
    if kind in ("tuple", "mtuple"):
        depth = 1 + max(items, default=0)
        if depth > MAX_TUPLE_DEPTH:
            raise bad(f"tuples nested more than {MAX_TUPLE_DEPTH} deep")
        stack.append(depth)
    else:
        stack.extend(items * 2 if kind == "dup" else [0] * pushed)


def _aware(when: Any) -> bool:
    """Whether ``when`` is a datetime with a UTC offset (torch compares its times with
    ``datetime.now(timezone.utc)``: a naive one raises ``TypeError`` there)."""
    return isinstance(when, datetime) and when.utcoffset() is not None


def _brief_time(when: Any) -> str:
    return "without a time zone" if isinstance(when, datetime) else f"of type {type(when).__name__}"


def _check_state(f: dict[str, Any], key: str) -> V2State:
    def bad(what: str) -> StateDecodeError:
        return StateDecodeError(f"{key} holds a rendezvous state with {what}")

    missing = sorted(STATE_FIELDS - set(f))
    if missing:
        raise bad(f"no {', '.join(missing)}")
    round_, complete, closed, deadline = f["round"], f["complete"], f["closed"], f["deadline"]
    if isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0:
        raise bad(f"round {_brief(round_)}")
    if not isinstance(complete, bool) or not isinstance(closed, bool):
        raise bad("a non-boolean 'complete' or 'closed'")
    if deadline is not None and not _aware(deadline):
        raise bad(f"deadline {_brief_time(deadline)}")

    def node(obj: Any) -> NodeDesc:
        if not isinstance(obj, _NodeStandIn):
            raise bad(f"a node of type {type(obj).__name__}")
        if obj.fields is None:
            raise bad("a _NodeDesc pickled without its fields (no BUILD)")
        addr, pid, local_id = (obj.fields.get(n) for n in ("addr", "pid", "local_id"))
        if not isinstance(addr, str) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in (pid, local_id)
        ):
            raise bad(f"a malformed node (addr {_brief(addr)}, pid {_brief(pid)}, local_id {_brief(local_id)})")
        assert isinstance(pid, int) and isinstance(local_id, int)
        return NodeDesc(addr, pid, local_id)

    participants, heartbeats = f["participants"], f["last_heartbeats"]
    if not isinstance(participants, dict) or not isinstance(heartbeats, dict):
        raise bad("participants or last_heartbeats that are not dicts")
    ranks: dict[NodeDesc, int] = {}
    for n, rank in participants.items():
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise bad(f"rank {_brief(rank)}")
        ranks[node(n)] = rank
    times: dict[NodeDesc, datetime] = {}
    for n, when in heartbeats.items():
        if not _aware(when):
            raise bad(f"a heartbeat time {_brief_time(when)}")
        times[node(n)] = when
    lists = []
    for name in ("wait_list", "redundancy_list"):
        items = f[name]
        if not isinstance(items, (set, frozenset)):
            raise bad(f"{name} of type {type(items).__name__}")
        lists.append(frozenset(node(n) for n in items))
    extra = tuple(sorted(set(f) - STATE_FIELDS))
    if extra:
        log.debug("%s: unknown state attributes %s", key, extra)
    return V2State(round_, complete, closed, deadline, ranks, lists[0], lists[1], times, extra)
