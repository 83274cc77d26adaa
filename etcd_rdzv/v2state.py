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
import time
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
    budget: _Budget | None = None  # set on the subclasses each decode makes (_StateUnpickler)

    def __setstate__(self, state: Any) -> None:
        if self.fields is not None:
            raise pickle.UnpicklingError(f"a {self.what} built twice (torch's pickles build each object once)")
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
            state = state[1]  # (None, slots) of a class with __slots__ only
        if not isinstance(state, dict) or len(state) > MAX_FIELDS or not all(isinstance(k, str) for k in state):
            raise pickle.UnpicklingError(f"unexpected {self.what} state (a {type(state).__name__}, "
                                         f"at most {MAX_FIELDS} attributes)")
        if self.budget is not None:
            self.budget.copied(len(state))
        self.fields = dict(state)


class _StateStandIn(_StandIn):
    what = "_RendezvousState"


class _NodeStandIn(_StandIn):
    what = "_NodeDesc"


class _Call:
    """A constructor the unpickler may call (REDUCE), checking its arguments and the decode's budget.

    Not a class, so NEWOBJ refuses it; a BUILD of it is refused (it has no instance dict to fill).
    """

    __slots__ = ("budget", "make")

    def __init__(self, budget: _Budget, make: Any) -> None:
        self.budget, self.make = budget, make

    def __call__(self, *args: Any) -> Any:
        self.budget.check()
        return self.make(self.budget, *args)

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError("a BUILD of a constructor")


def _small_int(v: Any, limit: int) -> bool:
    return type(v) is int and -limit <= v <= limit


def _make_set(budget: _Budget, *args: Any) -> set[Any]:
    """``set(list)``, as protocol 3 pickles a set (protocols 4 and 5 write EMPTY_SET, ADDITEMS)."""
    if len(args) != 1 or type(args[0]) is not list:
        raise pickle.UnpicklingError("set() of anything but a list of nodes")
    items = args[0]
    budget.copied(len(items))
    if not all(isinstance(n, _NodeStandIn) for n in items):
        raise pickle.UnpicklingError("set() of anything but nodes")
    return set(items)


def _make_datetime(budget: _Budget, *args: Any) -> datetime:
    """``datetime(bytes, tz)`` as a datetime pickles: 10 bytes of fields, a time zone or none."""
    if not 1 <= len(args) <= 2 or type(args[0]) is not bytes or len(args[0]) != 10 or (
            len(args) == 2 and type(args[1]) is not timezone):
        raise pickle.UnpicklingError("datetime() of anything but its pickled fields")
    return datetime(*args)


def _make_timezone(budget: _Budget, *args: Any) -> timezone:
    """``timezone(offset[, name])`` as a time zone pickles."""
    if not 1 <= len(args) <= 2 or type(args[0]) is not timedelta or (
            len(args) == 2 and (type(args[1]) is not str or len(args[1]) > MAX_MESSAGE)):
        raise pickle.UnpicklingError("timezone() of anything but an offset and a short name")
    return timezone(*args)


def _make_timedelta(budget: _Budget, *args: Any) -> timedelta:
    """``timedelta(days, seconds, microseconds)`` as a timedelta pickles."""
    if len(args) > 3 or not all(_small_int(v, 10**9) for v in args):
        raise pickle.UnpicklingError("timedelta() of anything but three small ints")
    return timedelta(*args)


_ALLOWED: dict[tuple[str, str], Any] = {
    (TORCH_MODULE, "_RendezvousState"): _StateStandIn,
    (TORCH_MODULE, "_NodeDesc"): _NodeStandIn,
    ("datetime", "datetime"): _make_datetime,
    ("datetime", "timezone"): _make_timezone,
    ("datetime", "timedelta"): _make_timedelta,
    ("builtins", "set"): _make_set,
}
"""The globals a state may name: torch's two classes (as inert stand-ins), and the constructors of
the values torch's state holds (checking their arguments). No ``frozenset`` (torch's state has none)."""


class _StateUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals of :data:`_ALLOWED` (see the module doc)."""

    def __init__(self, raw: bytes, budget: _Budget) -> None:
        super().__init__(io.BytesIO(raw))
        self.budget = budget
        # The stand-ins of this decode: each BUILD's copy counts against its budget.
        self.classes: dict[Any, type] = {
            cls: type(cls.__name__, (cls,), {"budget": budget}) for cls in (_StateStandIn, _NodeStandIn)
        }

    def find_class(self, module: str, name: str) -> Any:
        self.budget.check()
        try:
            found = _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load {clip(f'{module}.{name}')}") from None
        return self.classes[found] if isinstance(found, type) else _Call(self.budget, found)


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

MAX_NODES = 16_384
"""The most nodes a state may name in each of its collections and build: etcd's default request limit
(1.5 MiB of base64) holds ~10,000 nodes of real host names; 16,384 of one-letter names fit in ~750 KB
and decode within the 0.5 s of docs/security.md."""

MAX_PID = 2**32
"""pids lie in ``[0, MAX_PID)`` (Linux's pid_max is at most 2**22, Windows' are 32-bit): ints below
2**61 - 1 hash to themselves, so distinct nodes of one host cannot be made to collide in a dict."""

MAX_LOCAL_ID = 2**31
"""local ids lie in ``[0, MAX_LOCAL_ID)`` (torch counts the handlers of a process from 0)."""

MAX_RANK = 2**31
"""ranks lie in ``[0, MAX_RANK)``."""

MAX_FIELDS = 64
"""The most attributes one BUILD may set (torch's state has 8, its node 3): each BUILD's dict is copied."""

MAX_ELEMENTS = 8 * MAX_NODES
"""The most set items and BUILD attributes a pickle may make the unpickler copy (torch's: 3 per node
and at most 2 per node in its two sets)."""

MAX_ADDR = 1024
"""The longest node address (a host name is at most 253 characters): the address is copied into
every message and node id that names the node."""

MAX_MEMO = 8 * MAX_NODES + 1024
"""The most memo entries (torch writes at most ~7 per node; the C unpickler sizes its memo table by it)."""

DECODE_CPU_S = 0.5
"""CPU seconds (of the decoding thread) one decode may take, plus :data:`DECODE_CPU_S_PER_MIB` per MiB of
pickle: a backstop should a pickle escape the bounds above, which keep any state of 1 MB within ~0.3 s
on one core (docs/security.md)."""

DECODE_CPU_S_PER_MIB = 0.5

MAX_TUPLE_DEPTH = 1
"""How deep tuples may nest in a state (torch's never nest a tuple in a tuple)."""

MAX_MESSAGE = 200
"""The most characters of text taken from a value that an error message carries."""


class _Budget:
    """The time one decode may take: thread CPU seconds, and a wall-clock end (the CLI's deadline)."""

    __slots__ = ("cpu_end", "wall_end", "key", "elements", "next_check")

    def __init__(self, size: int, key: str, time_left: float | None) -> None:
        self.cpu_end = time.thread_time() + DECODE_CPU_S + DECODE_CPU_S_PER_MIB * size / 2**20
        self.wall_end = None if time_left is None else time.monotonic() + time_left
        self.key = key
        self.elements = 0  # what set() and the stand-ins' BUILDs copied so far
        self.next_check = _CHECK_EVERY

    def check(self) -> None:
        if time.thread_time() > self.cpu_end or (self.wall_end is not None and time.monotonic() > self.wall_end):
            raise StateDecodeError(f"{self.key} took longer to decode than a rendezvous state may (refused)")

    def copied(self, n: int) -> None:
        """Count ``n`` elements a constructor copies (refused past :data:`MAX_ELEMENTS`)."""
        self.elements += n
        if self.elements > MAX_ELEMENTS:
            raise pickle.UnpicklingError(f"more than {MAX_ELEMENTS} set items and attributes in all")
        if self.elements >= self.next_check:
            self.check()
            self.next_check = self.elements + _CHECK_EVERY


# The opcodes torch's states use, as the C and Python picklers write them with protocols 3 to 5, and
# what _scan does with each. Every other opcode is refused.
_K_OTHER, _K_STR, _K_TUPLE, _K_OBJ = range(4)  # what a stack item is (what a dict key or set item may be)
_HASHABLE = (_K_STR, _K_OBJ)  # str hashes are cached; the stand-ins hash by identity
_A_PUSH, _A_GET, _A_PUT, _A_MARK, _A_FIXED, _A_MARKED, _A_FRAME, _A_PROTO, _A_STOP, _A_REFUSE = range(10)
_ARG_LINES, _ARG_LEN1, _ARG_LEN4 = -1, -2, -3
_C_SETS, _C_LISTS, _C_DICTS, _C_OBJECTS, _C_CALLS, _C_TUPLES = range(6)
_LIMITS = (16, 16, MAX_NODES + 64, MAX_NODES + 64, MAX_NODES + 64, MAX_NODES + 64)
"""How many of each the pickle may make: sets and lists (torch's state has two sets: empty or set()
of a list), dicts (one per node), objects (NEWOBJ: one per node), calls (REDUCE: one datetime per
heartbeat) and tuples (one per REDUCE)."""
_LIMIT_NAMES = ("sets", "lists", "dicts", "objects", "calls", "tuples")
_FIXED = [  # (operands popped, operands left in place, the _K_* pushed or -1, the _C_* counted or -1)
    (0, 0, _K_OTHER, _C_SETS), (0, 0, _K_OTHER, _C_LISTS), (0, 0, _K_OTHER, _C_DICTS),  # EMPTY_*
    (1, 0, _K_TUPLE, _C_TUPLES), (2, 0, _K_TUPLE, _C_TUPLES), (3, 0, _K_TUPLE, _C_TUPLES),  # TUPLE1-3
    (2, 0, _K_OTHER, -1), (2, 0, _K_OTHER, _C_CALLS), (2, 0, _K_OBJ, _C_OBJECTS),  # STACK_GLOBAL, REDUCE, NEWOBJ
    (1, 1, -1, -1), (2, 1, -1, -1), (0, 0, _K_OTHER, -1),  # BUILD and APPEND, SETITEM, GLOBAL
]
_M_TUPLE, _M_SETITEMS, _M_APPENDS, _M_ADDITEMS = range(4)
_WHITELIST: dict[str, tuple[int, int, int]] = {  # name: (action, argument bytes or _ARG_*, detail)
    "PROTO": (_A_PROTO, 1, 0), "FRAME": (_A_FRAME, 8, 0), "STOP": (_A_STOP, 0, 0),
    "NONE": (_A_PUSH, 0, _K_OTHER), "NEWTRUE": (_A_PUSH, 0, _K_OTHER), "NEWFALSE": (_A_PUSH, 0, _K_OTHER),
    "BININT": (_A_PUSH, 4, _K_OTHER), "BININT1": (_A_PUSH, 1, _K_OTHER), "BININT2": (_A_PUSH, 2, _K_OTHER),
    "LONG1": (_A_PUSH, _ARG_LEN1, _K_OTHER),
    "SHORT_BINBYTES": (_A_PUSH, _ARG_LEN1, _K_OTHER), "BINBYTES": (_A_PUSH, _ARG_LEN4, _K_OTHER),
    "SHORT_BINUNICODE": (_A_PUSH, _ARG_LEN1, _K_STR), "BINUNICODE": (_A_PUSH, _ARG_LEN4, _K_STR),
    "EMPTY_TUPLE": (_A_PUSH, 0, _K_TUPLE),
    "EMPTY_SET": (_A_FIXED, 0, 0), "EMPTY_LIST": (_A_FIXED, 0, 1), "EMPTY_DICT": (_A_FIXED, 0, 2),
    "TUPLE1": (_A_FIXED, 0, 3), "TUPLE2": (_A_FIXED, 0, 4), "TUPLE3": (_A_FIXED, 0, 5),
    "STACK_GLOBAL": (_A_FIXED, 0, 6), "REDUCE": (_A_FIXED, 0, 7), "NEWOBJ": (_A_FIXED, 0, 8),
    "BUILD": (_A_FIXED, 0, 9), "APPEND": (_A_FIXED, 0, 9), "SETITEM": (_A_FIXED, 0, 10),
    "GLOBAL": (_A_FIXED, _ARG_LINES, 11),
    "TUPLE": (_A_MARKED, 0, _M_TUPLE), "SETITEMS": (_A_MARKED, 0, _M_SETITEMS),
    "APPENDS": (_A_MARKED, 0, _M_APPENDS), "ADDITEMS": (_A_MARKED, 0, _M_ADDITEMS),
    "MARK": (_A_MARK, 0, 0),
    "BINPUT": (_A_PUT, 1, 0), "LONG_BINPUT": (_A_PUT, 4, 0), "MEMOIZE": (_A_PUT, 0, 0),
    "BINGET": (_A_GET, 1, 0), "LONG_BINGET": (_A_GET, 4, 0),
}
_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}
_TABLE = tuple(_WHITELIST.get(_NAMES.get(code, ""), (_A_REFUSE, 0, 0)) for code in range(256))
_CHECK_EVERY = 1 << 14  # opcodes between two looks at the clock


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


def state_bytes(value: bytes, key: str = "the state key", *, time_left: float | None = None) -> bytes:
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
    load_state(raw, key, time_left=time_left)
    return raw


def decode_state(value: bytes, key: str = "the state key", *, time_left: float | None = None) -> V2State:
    """The state stored (base64 of torch's pickle) in ``value``; errors name ``key``.

    ``time_left``: wall-clock seconds the decode may take (the CLI's deadline), besides its CPU budget.
    Raises :class:`StateDecodeError` as :func:`state_bytes`.
    """
    if len(value) > (MAX_STATE_BYTES // 3 + 1) * 4:
        state_bytes(value, key)  # raises
    try:
        raw = b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise StateDecodeError(f"{key} does not hold base64 (not an etcd-v2 rendezvous state)") from None
    return load_state(raw, key, time_left=time_left)


def load_state(raw: bytes, key: str = "the state key", *, time_left: float | None = None) -> V2State:
    """torch's pickled ``_RendezvousState`` in ``raw`` as plain data, checked as the module says.

    The decode takes at most :data:`DECODE_CPU_S` (+ :data:`DECODE_CPU_S_PER_MIB` per MiB) of the
    calling thread's CPU time, and ``time_left`` wall-clock seconds if given.
    Raises :class:`StateDecodeError` naming ``key`` (never executing anything the pickle names).
    """
    if len(raw) > MAX_STATE_BYTES:
        raise StateDecodeError(f"{key} holds a {len(raw)}-byte pickle, more than {MAX_STATE_BYTES} bytes")
    budget = _Budget(len(raw), key, time_left)
    _scan(raw, key, budget)
    try:
        obj = _StateUnpickler(raw, budget).load()
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, IndexError,
            KeyError, MemoryError, RecursionError, OverflowError) as e:
        if isinstance(e, StateDecodeError):
            raise
        raise StateDecodeError(
            f"{key} does not hold torch's rendezvous state: {type(e).__name__}: {clip(str(e))}"
        ) from None
    if not isinstance(obj, _StateStandIn):
        raise StateDecodeError(f"{key} holds a pickled {type(obj).__name__}, not a _RendezvousState")
    if obj.fields is None:
        raise StateDecodeError(f"{key} holds a _RendezvousState pickled without its fields (no BUILD)")
    return _check_state(obj.fields, key, budget)


def _scan(raw: bytes, key: str, budget: _Budget) -> None:
    """Walk the opcodes of ``raw`` (no object is built) and refuse what :func:`load_state` must not load.

    Admits only the opcodes torch's states use (:data:`_WHITELIST`), each used as a pickler uses it:
    every pop within the current mark, memo entries numbered in order (at most :data:`MAX_MEMO`), no
    tuple inside a tuple, one object left at STOP and nothing after it, and no more containers,
    tuples, calls and objects than a state of :data:`MAX_NODES` nodes holds (:data:`_LIMITS`: what
    bounds the memory a pickle makes the unpickler allocate, ~20 bytes per byte of pickle at most).
    Tracks what each stack item is, so that every dict key and set item (what the unpickler hashes)
    is a string (its hash is cached) or an object of NEWOBJ (a stand-in, hashed by identity): no
    tuple, number or other value whose hash costs its size or can be made to collide.
    Raises :class:`StateDecodeError`.
    """
    stack: list[int] = []  # the _K_* of each item
    marks: list[int] = []  # len(stack) at each open MARK
    memo: list[int] = []  # the _K_* of each entry (picklers number them from 0, in order)
    left = list(_LIMITS)  # how many more of each counted kind the pickle may make
    size = len(raw)
    table = _TABLE
    pos = 0
    floor = 0  # len(stack) at the innermost mark: no pop may go below it
    tick = _CHECK_EVERY

    def bad(what: str) -> StateDecodeError:
        return StateDecodeError(f"{key} does not hold torch's rendezvous state: {what}")

    if size < 3 or raw[0] != 0x80 or not 3 <= raw[1] <= 5:
        raise bad("a pickle not of protocol 3 to 5 (torch writes 4 or 5)")
    at = 0
    try:
        while True:
            at = pos
            action, arg, n = table[raw[pos]]
            pos += 1
            tick -= 1
            if not tick:
                budget.check()
                tick = _CHECK_EVERY
            if arg:  # the argument
                if arg > 0:
                    value = raw[pos] if arg == 1 else int.from_bytes(raw[pos:pos + arg], "little")
                    pos += arg
                elif arg == _ARG_LEN1:
                    pos += 1 + raw[pos]
                elif arg == _ARG_LEN4:
                    pos += 4 + int.from_bytes(raw[pos:pos + 4], "little")
                else:  # _ARG_LINES
                    for _ in (0, 1):
                        nl = raw.find(b"\n", pos, pos + 2 * MAX_MESSAGE)
                        if nl < 0:
                            raise bad(f"a malformed pickle (a global name too long or unterminated at byte {at})")
                        pos = nl + 1
                if pos > size:
                    raise IndexError
            if action == _A_PUSH:
                stack.append(n)
            elif action == _A_GET:
                if value >= len(memo):
                    raise bad(f"a missing memo entry at byte {at}")
                stack.append(memo[value])
            elif action == _A_PUT:
                index = len(memo) if arg == 0 else value  # MEMOIZE numbers its entries
                if len(stack) <= floor or index > len(memo) or index >= MAX_MEMO:
                    raise bad(f"a malformed memo entry at byte {at}")
                if index == len(memo):
                    memo.append(stack[-1])
                else:
                    memo[index] = stack[-1]
            elif action == _A_MARK:
                floor = len(stack)
                marks.append(floor)
            elif action == _A_FIXED:  # a fixed number of operands
                pops, keep, result, counted = _FIXED[n]
                if len(stack) - pops - keep < floor:
                    raise bad(f"a malformed pickle (stack underflow at byte {at})")
                if counted >= 0:
                    left[counted] -= 1
                    if left[counted] < 0:
                        raise bad(f"more {_LIMIT_NAMES[counted]} than a state of {MAX_NODES} nodes holds")
                if result == _K_TUPLE and _K_TUPLE in stack[len(stack) - pops:]:
                    raise bad(f"tuples nested more than {MAX_TUPLE_DEPTH} deep")
                if keep and pops == 2 and stack[-2] not in _HASHABLE:  # SETITEM
                    raise _unhashable(bad, stack[-2], at)
                if pops:
                    del stack[len(stack) - pops:]
                if result >= 0:
                    stack.append(result)
            elif action == _A_MARKED:  # up to the mark: TUPLE, SETITEMS, APPENDS, ADDITEMS
                if not marks:
                    raise bad(f"a malformed pickle (no mark for the opcode at byte {at})")
                mark = marks.pop()
                items = stack[mark:]
                del stack[mark:]
                floor = marks[-1] if marks else 0
                if n == _M_TUPLE:
                    if _K_TUPLE in items:
                        raise bad(f"tuples nested more than {MAX_TUPLE_DEPTH} deep")
                    left[_C_TUPLES] -= 1
                    if left[_C_TUPLES] < 0:
                        raise bad(f"more {_LIMIT_NAMES[_C_TUPLES]} than a state of {MAX_NODES} nodes holds")
                    stack.append(_K_TUPLE)
                    continue
                if len(stack) <= floor:
                    raise bad(f"a malformed pickle (stack underflow at byte {at})")
                if n == _M_SETITEMS:
                    if len(items) % 2:
                        raise bad(f"a malformed pickle (a key without a value at byte {at})")
                    items = items[::2]
                if n != _M_APPENDS:
                    for kind in items:
                        if kind not in _HASHABLE:
                            raise _unhashable(bad, kind, at)
            elif action == _A_FRAME:
                pass
            elif action == _A_PROTO:
                if at:
                    raise bad(f"a malformed pickle (PROTO at byte {at})")
            elif action == _A_STOP:
                if len(stack) != 1 or marks:
                    raise bad(f"a malformed pickle ({len(stack)} objects left at STOP)")
                if pos != size:
                    raise bad(f"a malformed pickle (data after STOP at byte {at})")
                return
            else:  # _A_REFUSE
                name = _NAMES.get(raw[at])
                raise bad(f"opcode {name} at byte {at}" if name else f"a malformed pickle (unknown opcode at byte {at})")
    except IndexError:
        raise bad(f"a malformed pickle (truncated at byte {at})") from None


def _unhashable(bad: Any, kind: int, at: int) -> StateDecodeError:
    what = "a tuple" if kind == _K_TUPLE else "a value other than a string or an object"
    return bad(f"{what} as a dict key or set item at byte {at} (torch's are strings and nodes)")  # type: ignore[no-any-return]


def _aware(when: Any) -> bool:
    """Whether ``when`` is a datetime with a UTC offset (torch compares its times with
    ``datetime.now(timezone.utc)``: a naive one raises ``TypeError`` there)."""
    return isinstance(when, datetime) and when.utcoffset() is not None


def _brief_time(when: Any) -> str:
    return "without a time zone" if isinstance(when, datetime) else f"of type {type(when).__name__}"


def _check_state(f: dict[str, Any], key: str, budget: _Budget) -> V2State:
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

    made: dict[_NodeStandIn, NodeDesc] = {}  # each stand-in checked once (stand-ins hash by identity)

    def node(obj: Any) -> NodeDesc:
        done = made.get(obj) if isinstance(obj, _NodeStandIn) else None
        if done is not None:
            return done
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
        if len(addr) > MAX_ADDR:
            raise bad(f"a node address of {len(addr)} characters (at most {MAX_ADDR})")
        if not (0 <= pid < MAX_PID and 0 <= local_id < MAX_LOCAL_ID):
            raise bad(f"a node's pid {_brief(pid)} or local_id {_brief(local_id)} out of range "
                      f"(0 <= pid < {MAX_PID}, 0 <= local_id < {MAX_LOCAL_ID})")
        made[obj] = done = NodeDesc(addr, pid, local_id)
        return done

    participants, heartbeats = f["participants"], f["last_heartbeats"]
    if not isinstance(participants, dict) or not isinstance(heartbeats, dict):
        raise bad("participants or last_heartbeats that are not dicts")
    lists = [f["wait_list"], f["redundancy_list"]]
    for name, items in zip(("wait_list", "redundancy_list"), lists, strict=True):
        if not isinstance(items, set):
            raise bad(f"{name} of type {type(items).__name__}")
    for name, items in zip(("participants", "last_heartbeats", "wait_list", "redundancy_list"),
                           (participants, heartbeats, *lists), strict=True):
        if len(items) > MAX_NODES:
            raise bad(f"{len(items)} nodes in {name} (at most {MAX_NODES})")
    budget.check()
    ranks: dict[NodeDesc, int] = {}
    for n, rank in participants.items():
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < MAX_RANK:
            raise bad(f"rank {_brief(rank)}")
        ranks[node(n)] = rank
    budget.check()
    times: dict[NodeDesc, datetime] = {}
    for n, when in heartbeats.items():
        if not _aware(when):
            raise bad(f"a heartbeat time {_brief_time(when)}")
        times[node(n)] = when
    budget.check()
    sets = [frozenset(node(n) for n in items) for items in lists]
    budget.check()
    extra = tuple(sorted(set(f) - STATE_FIELDS))
    if extra:
        log.debug("%s: unknown state attributes %s", key, extra)
    return V2State(round_, complete, closed, deadline, ranks, sets[0], sets[1], times, extra)
