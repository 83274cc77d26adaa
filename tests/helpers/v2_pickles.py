"""Malformed and hostile pickles of torch's etcd-v2 ``_RendezvousState``, made with torch's classes.

Each function returns the bytes torch's handler would ``pickle.loads``; none of them runs anything when
loaded by the restricted reader (``etcd_rdzv.v2state``). Used by tests/unit/test_v2state.py and
tests/integration/test_state_security.py.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

__all__ = ["no_build", "torch_state", "two_builds"]

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
