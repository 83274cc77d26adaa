"""``close`` of an ``etcd-v2`` run: torch's state rewritten with ``closed = True``.

Reading the state is :mod:`etcd_rdzv.v2state` (the restricted unpickler the backend uses
too); :func:`encode_closed` goes the other way: it builds torch's real state objects from
the checked plain data (importing torch), sets ``closed = True`` and pickles them as torch does.
"""

from __future__ import annotations

import pickle
from base64 import b64encode
from typing import Any

from ..v2state import NodeDesc, StateDecodeError, V2State

__all__ = ["encode_closed"]


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
