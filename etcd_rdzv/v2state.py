"""torch's pickled ``etcd-v2`` rendezvous state, read without running what a key holds.

torch's ``DynamicRendezvousHandler`` keeps its ``_RendezvousState`` as a pickle, which our
``etcd-v2``/``etcd`` backend stores (opaque bytes) as base64 under ``<key_prefix>/<run_id>``,
and torch's state holder ``pickle.loads`` whatever the backend returns. Anyone who can write
that key could run code on every agent, so our state holder
(:class:`etcd_rdzv.dynamic.state.CheckedStates`: :func:`load_state`, then torch gets a state
built from the checked values, never the stored bytes) and the ``etcd-rdzv`` CLI
(:func:`decode_state`) pass a value through this module, which

1. bounds it: at most :data:`MAX_STATE_BYTES` of pickle (a state of 10,000 nodes is 1.1 MB);
2. scans its opcodes without building objects (:func:`etcd_rdzv.v2opcodes.scan`: only what torch's
   pickles hold, tuples not nested, no more objects than a state of :data:`MAX_NODES` nodes holds);
3. unpickles with :class:`_StateUnpickler`, whose ``find_class`` admits only
   ``_RendezvousState`` and ``_NodeDesc`` of torch's ``dynamic_rendezvous`` (as inert
   stand-ins that record the attributes the pickle sets; torch is not imported),
   ``datetime.datetime``/``timezone``/``timedelta`` (the heartbeat times and the deadline)
   and ``builtins.set``/``frozenset``, and refuses every other global;
4. checks the stand-ins field by field (:func:`_check_state`; a stand-in built by no BUILD or
   by two is refused, times must carry a time zone) and returns plain data (:class:`V2State`).

With these globals a pickle can call only those constructors, so even a ``pickle.loads`` of a
value that passed could run no other code; still, a pickle acts on torch's real classes (a
``__setstate__`` in the instance dict) unlike on the stand-ins, so the state holder does not
unpickle the value itself. Every refusal raises :class:`StateDecodeError` naming the key, with
a short message (at most :data:`MAX_MESSAGE` characters of escaped text, never the ``repr`` of
what the pickle built). No I/O, no torch import.
"""

from __future__ import annotations

import binascii
import io
import logging
import pickle
import time
from base64 import b64decode
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from .v2opcodes import CHECK_EVERY, MAX_MESSAGE, MAX_NODES, scan

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

    ``fields`` is ``None`` until a BUILD ran (unpickling skips ``__init__``; the checks refuse a
    stand-in left ``None``). A second BUILD of it is refused: torch's pickles build each object
    once, while torch's classes would run, at the second, a ``__setstate__`` the first put in the
    instance dict, keeping the first BUILD's fields where this stand-in would record the second's.
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


MAX_STATE_BYTES = 16 * 1024 * 1024  # the largest pickle accepted (etcd's default request limit allows ~1.1 MB)

MAX_PID = 2**32
"""pids lie in ``[0, MAX_PID)`` (Linux's pid_max is at most 2**22, Windows' are 32-bit): ints below
2**61 - 1 hash to themselves, so distinct nodes of one host cannot be made to collide in a dict."""

MAX_LOCAL_ID = 2**31  # local ids lie in [0, MAX_LOCAL_ID) (torch counts the handlers of a process from 0)
MAX_RANK = 2**31  # ranks lie in [0, MAX_RANK)

MAX_FIELDS = 64
"""The most attributes one BUILD may set (torch's state has 8, its node 3): each BUILD's dict is copied."""

MAX_ELEMENTS = 8 * MAX_NODES
"""The most set items and BUILD attributes a pickle may make the unpickler copy (torch's: 3 per node
and at most 2 per node in its two sets)."""

MAX_ADDR = 1024
"""The longest node address (a host name is at most 253 characters): the address is copied into
every message and node id that names the node."""


DECODE_CPU_S = 0.5
"""CPU seconds (of the decoding thread) one decode may take, plus :data:`DECODE_CPU_S_PER_MIB` per MiB of
pickle: a backstop should a pickle escape the bounds above, which keep any state of 1 MB within ~0.3 s
on one core (docs/security.md)."""

DECODE_CPU_S_PER_MIB = 0.5


class _Budget:
    """The time one decode may take: thread CPU seconds, and a wall-clock end (the CLI's deadline)."""

    __slots__ = ("cpu_end", "wall_end", "key", "elements", "next_check")

    def __init__(self, size: int, key: str, time_left: float | None) -> None:
        self.cpu_end = time.thread_time() + DECODE_CPU_S + DECODE_CPU_S_PER_MIB * size / 2**20
        self.wall_end = None if time_left is None else time.monotonic() + time_left
        self.key = key
        self.elements = 0  # what set() and the stand-ins' BUILDs copied so far
        self.next_check = CHECK_EVERY

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
            self.next_check = self.elements + CHECK_EVERY




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


def _unbase64(value: bytes, key: str) -> bytes:
    if len(value) > (MAX_STATE_BYTES // 3 + 1) * 4:
        raise StateDecodeError(
            f"{key} holds {len(value)} bytes, more than a rendezvous state may ({MAX_STATE_BYTES} bytes of pickle)"
        )
    try:
        return b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise StateDecodeError(f"{key} does not hold base64 (not an etcd-v2 rendezvous state)") from None


def state_bytes(value: bytes, key: str = "the state key", *, time_left: float | None = None) -> bytes:
    """The pickle of torch's state that ``value`` (its stored base64) holds, unchanged once
    :func:`load_state` accepted it; :class:`StateDecodeError` naming ``key`` when the value is not
    base64, too large, or not torch's rendezvous state.
    """
    raw = _unbase64(value, key)
    load_state(raw, key, time_left=time_left)
    return raw


def decode_state(value: bytes, key: str = "the state key", *, time_left: float | None = None) -> V2State:
    """The state stored (base64 of torch's pickle) in ``value``; errors name ``key``.

    ``time_left``: wall-clock seconds the decode may take (the CLI's deadline), besides its CPU budget.
    Raises :class:`StateDecodeError` as :func:`state_bytes`.
    """
    return load_state(_unbase64(value, key), key, time_left=time_left)


def load_state(raw: bytes, key: str = "the state key", *, time_left: float | None = None) -> V2State:
    """torch's pickled ``_RendezvousState`` in ``raw`` as plain data, checked as the module says.

    The decode takes at most :data:`DECODE_CPU_S` (+ :data:`DECODE_CPU_S_PER_MIB` per MiB) of the
    calling thread's CPU time, and ``time_left`` wall-clock seconds if given.
    Raises :class:`StateDecodeError` naming ``key`` (never executing anything the pickle names).
    """
    if len(raw) > MAX_STATE_BYTES:
        raise StateDecodeError(f"{key} holds a {len(raw)}-byte pickle, more than {MAX_STATE_BYTES} bytes")
    budget = _Budget(len(raw), key, time_left)
    scan(raw, lambda what: StateDecodeError(f"{key} does not hold torch's rendezvous state: {what}"), budget.check)
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
    node = _Nodes(bad)
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


class _Nodes:
    """The check of a state's node stand-ins: each checked once (stand-ins hash by identity), as a :class:`NodeDesc`."""

    __slots__ = ("bad", "made")

    def __init__(self, bad: Any) -> None:
        self.bad = bad
        self.made: dict[_NodeStandIn, NodeDesc] = {}

    def __call__(self, obj: Any) -> NodeDesc:
        bad = self.bad
        done = self.made.get(obj) if isinstance(obj, _NodeStandIn) else None
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
        self.made[obj] = done = NodeDesc(addr, pid, local_id)
        return done
