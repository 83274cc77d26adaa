"""Malformed and hostile pickles of torch's etcd-v2 ``_RendezvousState``, made with torch's classes.

Each function returns the bytes torch's handler would ``pickle.loads``; none of them runs anything when
loaded by the restricted reader (``etcd_rdzv.v2state``). Used by tests/unit/test_v2state.py and
tests/integration/test_state_security.py.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import pickletools
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

__all__ = ["colliding_nodes", "fat_node_fields", "no_build", "same_key_dict", "set_copy_bomb", "torch_state",
           "tuple_hash_bomb", "two_builds"]

_PROTO = 3  # no frames, so that pickles can be spliced


def torch_state(nodes: int = 2, *, round_: int = 1) -> _RendezvousState:
    """A completed round of ``nodes`` members, as torch's handler keeps it."""
    state = _RendezvousState()
    members = [_NodeDesc(f"host-{i}.example", 1000 + i, 0) for i in range(nodes)]
    now = datetime.now(timezone.utc)
    state.round = round_
    state.complete = True
    state.deadline = now + timedelta(seconds=30)
    state.participants = {n: i for i, n in enumerate(members)}
    state.last_heartbeats = {n: now for n in members}
    return state


def no_build(of: type = _RendezvousState) -> bytes:
    """A state whose ``of`` objects (``_RendezvousState`` or ``_NodeDesc``) are pickled without their
    fields: ``NEWOBJ`` and no ``BUILD`` (unpickling never calls ``__init__``)."""

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if type(obj) is of:
                return copyreg.__newobj__, (of,)  # type: ignore[attr-defined]
            return NotImplemented

    out = io.BytesIO()
    Pickler(out, protocol=_PROTO).dump(torch_state())
    return out.getvalue()


def two_builds(first: dict[str, Any], second: _RendezvousState) -> bytes:
    """A ``_RendezvousState`` built twice: ``BUILD first`` then ``BUILD vars(second)``.

    With ``first`` holding ``"__setstate__": frozenset``, torch's class takes that entry of the
    instance dict as its ``__setstate__`` at the second BUILD (``frozenset(fields)``, discarded):
    torch keeps ``first``'s fields while a reader recording the last BUILD sees ``second``'s.
    """

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if type(obj) is _RendezvousState:
                return copyreg.__newobj__, (_RendezvousState,), first  # type: ignore[attr-defined]
            return NotImplemented

    out = io.BytesIO()
    pickler = Pickler(out, protocol=_PROTO)
    pickler.dump(_RendezvousState())  # PROTO ... NEWOBJ BINPUT <first> BUILD STOP
    head = out.getvalue()
    assert head.endswith(pickle.BUILD + pickle.STOP)
    start = len(head)
    pickler.dump(dict(vars(second)))  # the same memo: its entries follow the first part's
    tail = out.getvalue()[start:]
    assert tail.startswith(pickle.PROTO) and tail.endswith(pickle.STOP)
    return head[:-1] + tail[2:-1] + pickle.BUILD + pickle.STOP


# --------------------------------------------------------------------------- cost bombs (issue 32)
# Small values whose decoding would cost seconds or hundreds of MiB in a reader that builds what the
# pickle says: each is a real pickle of a torch state carrying the bomb in a field.


class _Call:
    """Pickles as ``func(*args)`` (a REDUCE): ``func`` must be a global the reader may admit."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> Any:
        return self.func, self.args


def _with_field(value: Any, protocol: int = 4) -> bytes:
    state = torch_state()
    state.redundancy_list = value  # type: ignore[assignment]
    return pickle.dumps(state, protocol=protocol)


def tuple_hash_bomb(calls: int = 10, refs: int = 10_000, width: int = 10_000) -> bytes:
    """``calls`` ``set()`` calls over one list of ``refs`` references to one ``width``-int tuple
    (~94 KB): every call hashes the tuple ``refs`` times (a tuple's hash is not cached)."""
    big = tuple(range(width))
    refs_list = [big] * refs
    return _with_field([_Call(set, refs_list) for _ in range(calls)])


def set_copy_bomb(copies: int = 200, width: int = 100_000) -> bytes:
    """``copies`` ``set()`` copies of one ``width``-int set (~668 KB; ~4 MiB per copy)."""
    big = set(range(width))
    return _with_field([_Call(set, big) for _ in range(copies)])


def colliding_nodes(count: int = 8000) -> bytes:
    """A round of ``count`` nodes of one host whose pids differ by multiples of 2**61 - 1: they all
    hash alike, so every dict or set of them costs count**2 comparisons (~586 KB)."""
    state = torch_state(0)
    members = [_NodeDesc("h", k, 0) for k in range(1, count + 1)]
    now = datetime.now(timezone.utc)
    state.participants = dict.fromkeys(members, 0)
    state.last_heartbeats = dict.fromkeys(members, now)
    for k, n in enumerate(members, 1):  # after hashing them into the dicts: pickled by identity
        object.__setattr__(n, "pid", k * (2**61 - 1))
    return pickle.dumps(state, protocol=4)


def same_key_dict(width: int = 10_000, refs: int = 100_000) -> bytes:
    """A field holding a dict whose ``refs`` SETITEMS entries all use one ``width``-int tuple as the
    key (memo references, 6 bytes each; each entry hashes the tuple again): a bomb that calls no
    constructor at all (~700 KB)."""
    head = pickle.dumps(torch_state(), protocol=_PROTO)
    assert head.endswith(pickle.SETITEMS + pickle.BUILD + pickle.STOP)
    index = _memo_size(head)  # the next memo slot
    tup = pickle.MARK + b"".join(b"J" + i.to_bytes(4, "little") for i in range(width)) + pickle.TUPLE
    get = b"j" + index.to_bytes(4, "little")
    bomb = (b"X\x04\x00\x00\x00bomb" + pickle.EMPTY_DICT + pickle.MARK + tup + b"r" + index.to_bytes(4, "little")
            + pickle.NONE + (get + pickle.NONE) * refs + pickle.SETITEMS)
    return head[:-3] + bomb + head[-3:]


def _memo_size(raw: bytes) -> int:
    return sum(1 for op, _, _ in pickletools.genops(raw) if "PUT" in op.name or op.name == "MEMOIZE")


def fat_node_fields(nodes: int = 5000, width: int = 20_000) -> bytes:
    """``nodes`` nodes all built from one fields dict of ``width`` entries (a memo reference each):
    a reader copying each BUILD's dict copies ``width`` entries per node (~100 MB of copies)."""
    fields: dict[str, Any] = {f"f{i}": i for i in range(width)}
    fields.update(addr="h", pid=1, local_id=0)

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if type(obj) is _NodeDesc:
                return copyreg.__newobj__, (_NodeDesc,), fields  # type: ignore[attr-defined]
            return NotImplemented

    state = torch_state(0)
    state.participants = {_NodeDesc("h", i, 0): 0 for i in range(nodes)}
    out = io.BytesIO()
    Pickler(out, protocol=4).dump(state)
    return out.getvalue()


def full_state(nodes: int, *, addr: str = "h") -> bytes:
    """A valid state as costly per byte as a state can be: ``nodes`` nodes of one short address in
    all four collections (an adversary's largest state of a given size)."""
    state = torch_state(0)
    members = [_NodeDesc(addr, i, 0) for i in range(nodes)]
    now = datetime.now(timezone.utc)
    state.participants = dict.fromkeys(members, 0)
    state.last_heartbeats = dict.fromkeys(members, now)
    state.wait_list = set(members)
    state.redundancy_list = set(members)
    return pickle.dumps(state, protocol=4)
