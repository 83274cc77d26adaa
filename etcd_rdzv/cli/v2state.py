"""Read (and close) the ``etcd-v2`` rendezvous state without unpickling arbitrary objects.

torch's ``DynamicRendezvousHandler`` stores its ``_RendezvousState`` as a pickle, and
our backend keeps the base64 of those bytes under ``<key_prefix>/<run_id>``. An
operator's tool must not run whatever a key holds, so :func:`decode_state` unpickles
with :class:`_StateUnpickler`, whose ``find_class`` admits only

* ``_RendezvousState`` and ``_NodeDesc`` of ``torch.distributed.elastic.rendezvous.
  dynamic_rendezvous``, replaced by inert stand-ins that merely record the attributes
  the pickle sets (torch is not imported);
* ``datetime.datetime``, ``datetime.timezone`` and ``datetime.timedelta`` (the
  heartbeat times and the last-call deadline), and ``builtins.set``/``frozenset``;

and refuses every other global with :class:`StateDecodeError`. The stand-ins are then
checked field by field and turned into plain data (:class:`V2State`). Nothing here
does I/O; every malformed input raises :class:`StateDecodeError` naming the key.

:func:`encode_closed` goes the other way for ``close``: it builds torch's real state
objects from the checked plain data (importing torch), sets ``closed = True`` and
pickles them as torch does.
"""

from __future__ import annotations

import binascii
import io
import logging
import pickle
from base64 import b64decode, b64encode
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["NodeDesc", "StateDecodeError", "V2State", "decode_state", "encode_closed"]

TORCH_MODULE = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_STATE_FIELDS = frozenset(
    {"round", "complete", "deadline", "closed", "participants", "wait_list", "redundancy_list",
     "last_heartbeats"}
)


class StateDecodeError(ValueError):
    """A state key holds something that is not torch's rendezvous state."""


class _StandIn:
    """An inert object that records what the pickle's BUILD sets, and nothing else."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
            state = state[1]  # (None, slots) of a class with __slots__ only
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise pickle.UnpicklingError(f"unexpected object state {type(state).__name__}")
        self.fields = dict(state)


class _StateStandIn(_StandIn):
    pass


class _NodeStandIn(_StandIn):
    pass


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
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}") from None


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


def decode_state(value: bytes, key: str = "the state key") -> V2State:
    """The state stored (base64 of torch's pickle) in ``value``; errors name ``key``."""
    try:
        raw = b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise StateDecodeError(f"{key} does not hold base64 (not an etcd-v2 rendezvous state)") from None
    try:
        obj = _StateUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, IndexError,
            KeyError, MemoryError, RecursionError) as e:
        raise StateDecodeError(f"{key} does not hold torch's rendezvous state: {e}") from None
    if not isinstance(obj, _StateStandIn):
        raise StateDecodeError(f"{key} holds a pickled {type(obj).__name__}, not a _RendezvousState")
    return _check_state(obj.fields, key)


def _check_state(f: dict[str, Any], key: str) -> V2State:
    def bad(what: str) -> StateDecodeError:
        return StateDecodeError(f"{key} holds a rendezvous state with {what}")

    missing = sorted(_STATE_FIELDS - set(f))
    if missing:
        raise bad(f"no {', '.join(missing)}")
    round_, complete, closed, deadline = f["round"], f["complete"], f["closed"], f["deadline"]
    if isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0:
        raise bad(f"round {round_!r}")
    if not isinstance(complete, bool) or not isinstance(closed, bool):
        raise bad("a non-boolean 'complete' or 'closed'")
    if deadline is not None and not isinstance(deadline, datetime):
        raise bad(f"deadline {type(deadline).__name__}")

    def node(obj: Any) -> NodeDesc:
        if not isinstance(obj, _NodeStandIn):
            raise bad(f"a node of type {type(obj).__name__}")
        addr, pid, local_id = (obj.fields.get(n) for n in ("addr", "pid", "local_id"))
        if not isinstance(addr, str) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in (pid, local_id)
        ):
            raise bad(f"a malformed node {obj.fields!r:.80}")
        assert isinstance(pid, int) and isinstance(local_id, int)
        return NodeDesc(addr, pid, local_id)

    participants, heartbeats = f["participants"], f["last_heartbeats"]
    if not isinstance(participants, dict) or not isinstance(heartbeats, dict):
        raise bad("participants or last_heartbeats that are not dicts")
    ranks: dict[NodeDesc, int] = {}
    for n, rank in participants.items():
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise bad(f"rank {rank!r}")
        ranks[node(n)] = rank
    times: dict[NodeDesc, datetime] = {}
    for n, when in heartbeats.items():
        if not isinstance(when, datetime):
            raise bad(f"a heartbeat time of type {type(when).__name__}")
        times[node(n)] = when
    lists = []
    for name in ("wait_list", "redundancy_list"):
        items = f[name]
        if not isinstance(items, (set, frozenset)):
            raise bad(f"{name} of type {type(items).__name__}")
        lists.append(frozenset(node(n) for n in items))
    extra = tuple(sorted(set(f) - _STATE_FIELDS))
    if extra:
        log.debug("%s: unknown state attributes %s", key, extra)
    return V2State(round_, complete, closed, deadline, ranks, lists[0], lists[1], times, extra)


def encode_closed(state: V2State) -> bytes:
    """The base64 of torch's pickled state equal to ``state`` but with ``closed = True``.

    Builds torch's own ``_RendezvousState``/``_NodeDesc`` from the checked plain data
    (imports torch), as torch's handler writes it. Raises :class:`StateDecodeError`
    if the stored state had attributes :class:`V2State` does not carry (a newer torch):
    rewriting it would drop them.
    """
    if state.unknown:
        raise StateDecodeError(
            f"the state has attributes this tool does not know ({', '.join(state.unknown)}); "
            "close the run from an agent (set_closed) instead"
        )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    def real(n: NodeDesc) -> Any:
        return _NodeDesc(n.addr, n.pid, n.local_id)

    out = _RendezvousState()
    out.round = state.round
    out.complete = state.complete
    out.deadline = state.deadline
    out.closed = True
    out.participants = {real(n): r for n, r in state.participants.items()}
    out.wait_list = {real(n) for n in state.wait_list}
    out.redundancy_list = {real(n) for n in state.redundancy_list}
    out.last_heartbeats = {real(n): t for n, t in state.last_heartbeats.items()}
    return b64encode(pickle.dumps(out))
