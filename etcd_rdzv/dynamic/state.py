"""``SealedRoundStateHolder``: torch's backend state holder without its sealed-round defects.

torch's ``_BackendRendezvousStateHolder._sanitize()`` runs after every read and removes every node
whose heartbeat looks older than ``keep_alive_interval x keep_alive_max_attempt`` *to the reader's
clock*, members of a completed round included, and the reader's next write stores that copy: a late
reader strands a member (A), a stalled member re-opens the round while the others train (B), and a
dead member never makes ``num_nodes_waiting()`` positive (C, pytorch#111646). docs/operations.md
("etcd-v2's sealed rounds") has the cases and the safety argument.

This holder keeps torch's state format and its pruning of a forming round and of the wait and
redundancy lists. A *completed* round keeps its members while one is alive: the reader itself if it
is a member (a member that can read proves the round alive, whatever its clock says), else any
member younger than :attr:`SealedRoundStateHolder.member_expiry`. Only a round whose members all
look dead to a reader outside it is pruned, by torch's rule. Which members are dead is the
handler's business (:meth:`SealedRoundStateHolder.dead_members`).

torch's ``sync`` ``pickle.loads`` what the backend returns, so it reads through
:class:`CheckedStates`: every stored state is decoded by :func:`etcd_rdzv.v2state.load_state` (a
restricted reader that runs nothing) and torch gets the pickle of a fresh ``_RendezvousState``.

torch private names relied on (checked by :func:`check_torch_internals`):
``_BackendRendezvousStateHolder`` (``__init__(backend, settings, cache_duration)``, ``_backend``,
``_settings``, ``_cache_duration``, ``_state``, ``_dead_nodes``, ``sync`` calling ``_sanitize``),
the fields of ``_RendezvousState`` (those :mod:`etcd_rdzv.v2state` checks) and ``_NodeDesc``; in
:mod:`etcd_rdzv.dynamic.handler`, ``DynamicRendezvousHandler.__init__``'s parameters,
``_state_holder``, ``_op_executor``, ``_this_node``, ``_heartbeat_lock``, ``_keep_alive`` and
``_start_heartbeats``; and ``_DistributedRendezvousOpExecutor`` (``__init__(node, state_holder,
settings)``, ``_node``, ``_state``, ``_settings``, ``_remove_from_participants``).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import pickle
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.events import NodeState, construct_and_record_rdzv_event
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as _dr
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from ..plugin_errors import EtcdRdzvPluginError, torch_version
from ..v2state import STATE_FIELDS, NodeDesc, StateDecodeError, V2State, load_state
from .presence import Presence

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        RendezvousSettings,
        _NodeDesc,
        _RendezvousState,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _BackendRendezvousStateHolder as _Holder,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _DistributedRendezvousOpExecutor as _Executor,
    )
else:  # a torch without them gets check_torch_internals' clear error, not an ImportError
    _Holder = getattr(_dr, "_BackendRendezvousStateHolder", object)
    _Executor = getattr(_dr, "_DistributedRendezvousOpExecutor", object)

log = logging.getLogger(__name__)

__all__ = [
    "CheckedStates", "SealedRoundExecutor", "SealedRoundStateHolder", "check_torch_internals", "record_event",
    "torch_state",
]  # fmt: skip

_NODE_FIELDS = ["addr", "pid", "local_id"]
_HANDLER_ATTRS = ("_keep_alive", "_start_heartbeats", "_stop_heartbeats", "_get_deadline")
_ACTIONS = ("REMOVE_FROM_PARTICIPANTS", "REMOVE_FROM_WAIT_LIST", "REMOVE_FROM_REDUNDANCY_LIST", "FINISH",
            "ERROR_TIMEOUT")  # the leave op of the etcd-v2 handler's shutdown()
_HANDLER_INIT = ["node", "settings", "backend_name", "store", "state_holder"]
_HOLDER_INIT = ["backend", "settings", "cache_duration"]
_EXECUTOR_INIT = ["node", "state_holder", "settings"]


def _problems() -> list[str]:
    """What differs from the torch internals this module relies on (empty when nothing)."""
    holder = getattr(_dr, "_BackendRendezvousStateHolder", None)
    found = _init_differs("_BackendRendezvousStateHolder", holder, _HOLDER_INIT)
    sync_names = getattr(getattr(getattr(holder, "sync", None), "__code__", None), "co_names", ())
    if holder is not None and ("_sanitize" not in sync_names or not callable(getattr(holder, "_sanitize", None))):
        found.append("_BackendRendezvousStateHolder.sync no longer calls _sanitize")
    state = getattr(_dr, "_RendezvousState", None)
    fields = set(getattr(state(), "__dict__", ())) if state is not None else set()
    missing, extra = sorted(STATE_FIELDS - fields), sorted(fields - STATE_FIELDS)
    if missing:
        found.append(f"_RendezvousState lacks {', '.join(missing)}")
    if extra:
        found.append(f"_RendezvousState has new fields {', '.join(extra)}")
    node = getattr(_dr, "_NodeDesc", None)
    if not dataclasses.is_dataclass(node) or [f.name for f in dataclasses.fields(node)] != _NODE_FIELDS:
        found.append("_NodeDesc is no longer a dataclass of addr, pid, local_id")
    handler = _dr.DynamicRendezvousHandler
    found += _init_differs("DynamicRendezvousHandler", handler, _HANDLER_INIT)
    missing = [a for a in _HANDLER_ATTRS if not callable(getattr(handler, a, None))]
    if missing:
        found.append(f"DynamicRendezvousHandler lacks {', '.join(missing)}")
    action = getattr(_dr, "_Action", None)
    missing = [a for a in _ACTIONS if not hasattr(action, a)]
    if missing:
        found.append(f"_Action lacks {', '.join(missing)}")
    executor = getattr(_dr, "_DistributedRendezvousOpExecutor", None)
    found += _init_differs("_DistributedRendezvousOpExecutor", executor, _EXECUTOR_INIT)
    if executor is not None and not callable(getattr(executor, "_remove_from_participants", None)):
        found.append("_DistributedRendezvousOpExecutor lacks _remove_from_participants")
    return found


def _init_differs(name: str, cls: Any, expected: list[str]) -> list[str]:
    """What differs in torch's class ``name`` (``cls``, None if absent): its absence, or the parameters of
    its ``__init__`` (one signature read); ``[]`` when nothing."""
    if cls is None:
        return [f"no {name}"]
    try:
        params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    except (TypeError, ValueError):
        params = ["(unreadable)"]
    return [] if params == expected else [f"{name}.__init__ takes {params}"]


def record_event(
    owner: object, run_id: str, message: str, node_state: NodeState, node: _NodeDesc | None = None,
    rank: int | None = None,
) -> None:
    """Record torch's rendezvous event of ``owner``'s ``_record`` (torch's fields), named in O(1) as
    ``<owner's class>.<caller of _record>``; call it from ``_record`` only. ``node`` adds hostname, pid
    and local id. Not torch's ``get_method_name()``: its ``inspect.stack()`` costs ~10 ms of CPU per
    event (seconds on a loaded host) inside the CAS window of every state change, where a node joining
    a sealed round's wait list then lost every race to the members' heartbeats."""
    construct_and_record_rdzv_event(
        name=f"{type(owner).__name__}.{sys._getframe(2).f_code.co_name}",
        run_id=run_id,
        message=message,
        node_state=node_state,
        hostname=node.addr if node is not None else "",  # torch's defaults without a node
        pid=node.pid if node is not None else None,
        local_id=node.local_id if node is not None else None,
        rank=rank,
    )


def check_torch_internals() -> None:
    """Return if torch has the private names this module and the etcd-v2 handler use; else raise
    :class:`EtcdRdzvPluginError` naming the torch version and each difference. No side effect."""
    found = _problems()
    if found:
        raise EtcdRdzvPluginError(
            f"etcd-rdzv's etcd-v2 handler cannot run on torch {torch_version()}: its dynamic "
            f"rendezvous changed ({'; '.join(found)}); the handler subclasses torch's state holder "
            "as in torch 2.4 to 2.15. Install a supported torch, a newer etcd-rdzv, or use etcd-v3."
        )


def torch_state(checked: V2State) -> _RendezvousState:
    """torch's ``_RendezvousState`` holding ``checked``'s values, made of fresh torch objects (unknown
    attributes left out; the lists are torch's mutable sets). No I/O."""
    nodes: dict[NodeDesc, _NodeDesc] = {}

    def node(n: NodeDesc) -> _NodeDesc:
        made = nodes.get(n)
        if made is None:
            made = nodes[n] = _dr._NodeDesc(n.addr, n.pid, n.local_id)
        return made

    state = _dr._RendezvousState()
    state.round = checked.round
    state.complete = checked.complete
    state.deadline = checked.deadline
    state.closed = checked.closed
    state.participants = {node(n): rank for n, rank in checked.participants.items()}
    state.wait_list = {node(n) for n in checked.wait_list}
    state.redundancy_list = {node(n) for n in checked.redundancy_list}
    state.last_heartbeats = {node(n): when for n, when in checked.last_heartbeats.items()}
    return state


class CheckedStates(RendezvousBackend):
    """The backend :class:`SealedRoundStateHolder` hands torch's ``sync``: ``backend``'s states, checked
    and pickled anew.

    ``get_state`` and a losing ``set_state`` return the pickle of :func:`torch_state` of the stored
    value; a winning ``set_state`` returns the object torch passed (its own pickle of a checked state).
    A stored value that is not torch's state raises ``RendezvousStateError`` naming the key before
    anything unpickles it. Tokens and the backend's errors pass unchanged; no RPC of its own.
    """

    def __init__(self, backend: RendezvousBackend) -> None:
        self.backend = backend
        key = getattr(backend, "key", None)
        self._where = repr(key) if isinstance(key, str) else f"the {backend.name} backend's state"

    @property
    def name(self) -> str:
        """See base class."""
        return self.backend.name

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        got = self.backend.get_state()
        return None if got is None else (self._checked(got[0]), got[1])

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """See base class."""
        got = self.backend.set_state(state, token)
        if got is None:
            return None
        bits, token, has_set = got
        return (state if has_set and bits is state else self._checked(bits)), token, has_set

    def _checked(self, bits: bytes) -> bytes:
        """The pickle of torch's state built from ``bits`` once checked; ``RendezvousStateError`` else."""
        try:
            checked = load_state(bits, self._where)
        except StateDecodeError as e:
            raise RendezvousStateError(
                f"The rendezvous state stored in etcd is corrupt or not torch's, refusing it: {e}"
            ) from None
        return pickle.dumps(torch_state(checked), protocol=pickle.HIGHEST_PROTOCOL)


#: The distant past: a node that never failed a sync has been in contact with etcd forever.
_NEVER = datetime.min.replace(tzinfo=timezone.utc)


class SealedRoundStateHolder(_Holder):
    """torch's backend state holder whose ``_sanitize`` leaves a live completed round alone.

    Args are torch's plus ``node``, the handler's own descriptor. State format, CAS writes and read
    cache are torch's; ``sync`` reads through :class:`CheckedStates` (raises ``RendezvousStateError``
    for a stored value that is not torch's state).
    """

    def __init__(
        self, backend: RendezvousBackend, settings: RendezvousSettings, node: _NodeDesc, cache_duration: int = 1
    ) -> None:
        if isinstance(backend, CheckedStates):
            backend = backend.backend
        super().__init__(CheckedStates(backend), settings, cache_duration)
        self.backend = backend
        """The backend the states are read from (torch's ``_backend`` is its :class:`CheckedStates`)."""
        self._node = node
        window = settings.keep_alive_interval * settings.keep_alive_max_attempt
        self.member_expiry: timedelta = window + timedelta(seconds=max(cache_duration, 0))
        """A completed round's member is dead once its heartbeat is older than this: torch's window
        plus one read-cache period (our copy may be that old); 16 s by default. A live node's stored
        heartbeat is at most one interval plus one keep-alive call old."""
        #: When this node's contact with etcd last resumed after a failed sync (never: the distant past).
        self._reachable_since = _NEVER
        self._unreachable = False
        self.presence: Presence | None = None
        """The run's presence keys (:mod:`etcd_rdzv.dynamic.presence`), set by the handler; None: off."""
        self.fast_recovery = False
        """rdzv-conf ``fast_recovery`` (needs :attr:`presence`): :meth:`_end_last_call`."""

    def sync(self) -> bool | None:
        """See base class; also notes when this node's contact with etcd last resumed.

        A sync that failed, or took longer than one keep-alive interval (the client rides out an outage
        until its deadline), starts a new contact period: no member counts as dead until it lasted
        :attr:`member_expiry`, since nobody could write a heartbeat meanwhile.
        """
        started = time.monotonic()
        try:
            has_set = super().sync()
        except Exception:
            self._unreachable = True
            raise
        slow = time.monotonic() - started > self._settings.keep_alive_interval.total_seconds()
        if self._unreachable or slow:
            self._unreachable = False
            self._reachable_since = datetime.now(timezone.utc)
        return has_set

    def _may_judge(self, now: datetime) -> bool:
        """Whether this node may call members dead: in contact with etcd for :attr:`member_expiry` and its
        own stored heartbeat fresh (a stalled observer, or one whose writes etcd delays, sees everyone old).
        """
        if now - self._reachable_since < self.member_expiry:
            return False
        own = self._state.last_heartbeats.get(self._node)
        window = self._settings.keep_alive_interval * (self._settings.keep_alive_max_attempt + 1)
        return own is None or now - own <= window

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING) -> None:
        """torch's event of this holder (same fields), named in O(1) (:func:`record_event`)."""
        record_event(self, self._settings.run_id, message, node_state)

    @classmethod
    def adopt(cls, holder: _Holder, node: _NodeDesc) -> SealedRoundStateHolder:
        """A holder with the backend, settings and cache duration of torch's ``holder``."""
        return cls(holder._backend, holder._settings, node, holder._cache_duration)

    def dead_members(self) -> list[_NodeDesc]:
        """Members of the local copy's completed round, other than this node, whose heartbeat is older
        than :attr:`member_expiry` (or missing), sorted; ``[]`` while the round forms. No RPC."""
        state = self._state
        now = datetime.now(timezone.utc)
        if not state.complete or not self._may_judge(now):
            return []
        return sorted(n for n in self._silent(state, now) if n != self._node)

    def _silent(self, state: Any, now: datetime) -> list[_NodeDesc]:
        """The members of ``state``'s round whose heartbeat is older than :attr:`member_expiry` at ``now``
        (or missing): the one rule by which a member looks dead."""
        limit = now - self.member_expiry
        return [n for n in state.participants if state.last_heartbeats.get(n, limit) <= limit]

    def _sanitize(self) -> None:
        """Prune dead nodes from the local copy (torch's hook): torch's rule for a forming round or a
        completed one whose members all look dead; else only dead wait-list and redundancy-list nodes."""
        state = self._state
        if not state.complete or self._round_is_dead(state):
            super()._sanitize()
            if self.fast_recovery:
                self._end_last_call(state)
            return
        limit = datetime.now(timezone.utc) - self._settings.keep_alive_interval * self._settings.keep_alive_max_attempt
        pruned = [n for n, beat in state.last_heartbeats.items() if beat < limit and n not in state.participants]
        for node in pruned:
            del state.last_heartbeats[node]
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)
        self._dead_nodes = pruned
        if pruned:
            log.debug("round %s: removed dead waiting node(s) %s", state.round, pruned)

    def _end_last_call(self, state: Any) -> None:
        """``fast_recovery``: end the last call of a forming round (not the first) in the local copy once
        no live node it knows is still out, so torch's join op completes the round now. Known: a heartbeat
        in the state, outside the redundancy list; live: a presence key (one keys-only Range per presence
        period, only while such a node is out). Nodes without a key are not waited for; without a fresh
        presence read nothing changes."""
        if state.complete or state.deadline is None or self.presence is None or state.round == 0:
            return  # (round 0, the job's first: no group re-forms, torch's last call gathers it)
        out = [n for n in state.last_heartbeats if n not in state.participants and n not in state.redundancy_list]
        if out:
            present = self.presence.present()
            if present is None or any(str(n) in present for n in out):
                return
        if state.deadline.year > 2000:
            log.info("round %s: every live node joined (%d); fast_recovery ends the last call",
                     state.round, len(state.participants))
            state.deadline = state.deadline.replace(year=2000)  # past, with the same tzinfo as torch's

    def _round_is_dead(self, state: Any) -> bool:
        """Whether this node is outside the completed round of ``state`` and every member looks dead."""
        now = datetime.now(timezone.utc)
        if self._node in state.participants or now - self._reachable_since < self.member_expiry:
            return False
        dead = len(self._silent(state, now)) == len(state.participants)
        if dead and state.participants:
            log.debug("round %s: every member looks dead, pruning it", state.round)
        return dead


class SealedRoundExecutor(_Executor):
    """torch's op executor whose exit from a completed round ends that round.

    torch moves to the next round only once the last member left, so the survivors of a dead member
    wait until its heartbeat ages out. Here the first member to leave ends the round in the same fenced
    write (torch's epilogue: ``participants={}``, ``complete=False``, ``round+1``, ``deadline=None``),
    keeping the others' heartbeats and the wait and redundancy lists, so the next round admits them at
    once; a member still training sees it in ``num_nodes_waiting()``. A forming round is left as torch
    leaves it. No RPC.
    """

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING) -> None:
        """torch's event of this executor (same fields), named in O(1) (:func:`record_event`)."""
        record_event(self, self._settings.run_id, message, node_state, self._node)

    def _remove_from_participants(self) -> None:
        state = self._state
        if not state.complete:
            super()._remove_from_participants()
            return
        ended = state.round
        others = sorted(n for n in state.participants if n != self._node)
        state.participants = {}
        state.last_heartbeats.pop(self._node, None)
        state.complete = False
        state.deadline = None
        state.round = ended + 1
        log.info(
            "node %s leaves completed round %d and ends it (members %s re-join round %d)",
            self._node, ended, ", ".join(map(str, others)) or "none", ended + 1,
        )  # fmt: skip
