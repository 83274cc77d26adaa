"""``SealedRoundStateHolder``: torch's backend state holder without its sealed-round defects.

torch's ``_BackendRendezvousStateHolder._sanitize()`` runs after every read and
removes every node whose heartbeat looks older than ``keep_alive_interval x
keep_alive_max_attempt`` *to the reading node's clock*, members of a completed
round included, then lets the reader's next write store that copy:

* case A: a member whose heartbeat aged while the round sealed finishes its join
  with world N, a later reader drops it and finishes with world N-1; that reader's
  next heartbeat stores the round without the member, which stops heartbeating
  (its entry is gone) and is in no wait list, so nobody ever re-rendezvouses;
* case B: a member stalled between its read and ``_sanitize`` sees every heartbeat
  as old, removes everyone, the epilogue re-opens the round, and its write makes a
  new round global while the others train in the old one;
* case C (pytorch#111646): a dead member of a completed round never makes
  ``num_nodes_waiting()`` positive, so the survivors never re-rendezvous.

This holder keeps torch's state format and torch's pruning of a round that is
still forming, of the wait list and of the redundancy list. A *completed* round
keeps its members while one of them is alive: the reader itself when it is a
member (a member that can read is proof that the round is alive, whatever its
clock says about the others), else any member whose heartbeat is younger than
:attr:`SealedRoundStateHolder.member_expiry` (the heartbeat window plus one
read-cache period). Only a round whose members all look dead to a reader outside
it is pruned, by torch's rule, so that the round advances (the survivors of a
member that died have left it and wait for the next round). That a member is
dead is the handler's business: :meth:`SealedRoundStateHolder.dead_members`
tells it, and it reports a waiting node so that the survivors re-rendezvous.

The holder is also where the stored state is checked. torch's ``sync``
``pickle.loads`` what the backend returns, and the backend returns the stored bytes as torch's
``RendezvousBackend`` contract says (opaque). So torch's holder reads through
:class:`CheckedStates`: every state read (``get_state``, a lost ``set_state``) is read by
:func:`etcd_rdzv.v2state.load_state`, the restricted reader that runs nothing, and torch gets the
pickle of a fresh ``_RendezvousState`` built from the checked values (:func:`torch_state`), never
the stored bytes. A value that is not torch's state raises ``RendezvousStateError`` naming the key
before anything unpickles it. Only a write that succeeded hands torch back its own pickle unread.

torch private names this module relies on (checked by :func:`check_torch_internals`,
which raises :class:`~etcd_rdzv.plugin.EtcdRdzvPluginError` when one is missing):
``_BackendRendezvousStateHolder`` (``__init__(backend, settings, cache_duration)``,
``_backend``, ``_settings``, ``_cache_duration``, ``_state``, ``_dead_nodes``, and
``sync`` calling ``_sanitize``), the fields of ``_RendezvousState`` (exactly those
:mod:`etcd_rdzv.v2state` checks, so that a state built from them lacks none) and of ``_NodeDesc``, and,
in :mod:`etcd_rdzv.dynamic.handler`,
``DynamicRendezvousHandler.__init__``'s parameters, ``_state_holder``, ``_op_executor``,
``_this_node``, ``_heartbeat_lock``, ``_keep_alive`` and ``_start_heartbeats``, and
``_DistributedRendezvousOpExecutor`` (``__init__(node, state_holder, settings)``, ``_node``,
``_state``, ``_settings`` and ``_remove_from_participants``) for :class:`SealedRoundExecutor`.
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
    found: list[str] = []
    holder = getattr(_dr, "_BackendRendezvousStateHolder", None)
    if holder is None:
        found.append("no _BackendRendezvousStateHolder")
    else:
        if _params(holder.__init__) != _HOLDER_INIT:
            found.append(f"_BackendRendezvousStateHolder.__init__ takes {_params(holder.__init__)}")
        sync = getattr(holder, "sync", None)
        if not callable(getattr(holder, "_sanitize", None)) or "_sanitize" not in getattr(
            getattr(sync, "__code__", None), "co_names", ()
        ):
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
    if _params(handler.__init__) != _HANDLER_INIT:
        found.append(f"DynamicRendezvousHandler.__init__ takes {_params(handler.__init__)}")
    missing = [a for a in _HANDLER_ATTRS if not callable(getattr(handler, a, None))]
    if missing:
        found.append(f"DynamicRendezvousHandler lacks {', '.join(missing)}")
    action = getattr(_dr, "_Action", None)
    missing = [a for a in _ACTIONS if not hasattr(action, a)]
    if missing:
        found.append(f"_Action lacks {', '.join(missing)}")
    executor = getattr(_dr, "_DistributedRendezvousOpExecutor", None)
    if executor is None:
        found.append("no _DistributedRendezvousOpExecutor")
    else:
        if _params(executor.__init__) != _EXECUTOR_INIT:
            found.append(f"_DistributedRendezvousOpExecutor.__init__ takes {_params(executor.__init__)}")
        if not callable(getattr(executor, "_remove_from_participants", None)):
            found.append("_DistributedRendezvousOpExecutor lacks _remove_from_participants")
    return found


def _params(function: Any) -> list[str]:
    try:
        return [p for p in inspect.signature(function).parameters if p != "self"]
    except (TypeError, ValueError):
        return ["(unreadable)"]


def record_event(
    owner: object, run_id: str, message: str, node_state: NodeState, node: _NodeDesc | None = None,
    rank: int | None = None,
) -> None:
    """Record torch's rendezvous event of ``owner``'s ``_record`` (same name and fields as torch's),
    naming it in O(1): ``<owner's class>.<the function that called _record>``.

    That name is what torch's ``get_method_name()`` gives, without its two ``inspect.stack()``
    calls: those read the source file of every frame and, for frames of no module file
    (``<frozen runpy>``, under torchrun), scan ``sys.modules`` once more each; about 10 ms of CPU
    per event in a torchrun agent, seconds on a loaded host. torch records an event between the
    read and the write of every state change (each sync that wrote, each action), so that time is
    inside the compare-and-swap window: a node that must win a write against the members' 1 s
    heartbeats (joining the wait list of a sealed round) lost every race for tens of seconds, or
    until its join timed out, on a loaded host. Call it from ``_record`` only (it names the frame
    two above itself). ``node`` adds hostname, pid and local id; ``rank`` the rank."""
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
    """Return if torch has the private names this module and the etcd-v2 handler use.

    Raises :class:`EtcdRdzvPluginError` naming the torch version and each difference
    (no RPC, no side effect).
    """
    found = _problems()
    if found:
        raise EtcdRdzvPluginError(
            f"etcd-rdzv's etcd-v2 handler cannot run on torch {torch_version()}: its dynamic "
            f"rendezvous changed ({'; '.join(found)}); the handler subclasses torch's state holder "
            "as in torch 2.4 to 2.15. Install a supported torch, a newer etcd-rdzv, or use etcd-v3."
        )


def torch_state(checked: V2State) -> _RendezvousState:
    """torch's ``_RendezvousState`` holding the values of ``checked``, made of fresh torch objects.

    Unknown attributes of the stored state (``checked.unknown``) are left out; the wait and
    redundancy lists are torch's mutable sets (v2state admits only the set torch writes). No I/O.
    """
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
    """What :class:`SealedRoundStateHolder` hands torch's ``sync`` as its backend: ``backend``'s
    states, each read by the restricted reader and pickled anew from the checked values.

    ``get_state`` and a ``set_state`` that lost return the pickle of :func:`torch_state` of the
    stored value; a ``set_state`` that succeeded returns what torch wrote (the very object it
    passed, so not stored bytes: torch's own pickle of a state built from checked values). A
    stored value that is not torch's rendezvous state raises ``RendezvousStateError`` naming
    the key (``backend.key`` when it has one) before anything unpickles it. Tokens and the
    backend's errors pass unchanged; no RPC of its own.
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

    Args are torch's plus ``node``, the descriptor of the handler this holder serves.
    The state format, the CAS writes and the read cache are torch's; what ``_sanitize``
    removes differs, and torch's ``sync`` reads ``backend`` through :class:`CheckedStates`
    (module docstring): ``sync`` raises ``RendezvousStateError`` naming the key for a stored
    value that is not torch's rendezvous state, and never unpickles the stored bytes.
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
        """A completed round's member is dead once its heartbeat is older than this: torch's
        heartbeat window plus one read-cache period (our copy may be that much older).
        Defaults: 15 + 1 = 16 s. (A live node's stored heartbeat is at most one interval plus
        one keep-alive call old: the handler refreshes it before torch's timer starts, so no
        tick is skipped; the window leaves two more intervals for a slow call.)"""
        #: When this node's contact with etcd last resumed after a failed sync (never: the distant past).
        self._reachable_since = _NEVER
        self._unreachable = False
        self.presence: Presence | None = None
        """The run's presence keys (:mod:`etcd_rdzv.dynamic.presence`), set by the handler; None: off."""
        self.fast_recovery = False
        """rdzv-conf ``fast_recovery`` (needs :attr:`presence`): a forming round's last call ends once
        every live node it knows has joined (:meth:`_end_last_call`)."""

    def sync(self) -> bool | None:
        """See base class; also notes when this node's contact with etcd last resumed.

        Raises what torch's ``sync`` raises. A sync that failed, or that took longer than one
        keep-alive interval (the client rides out an etcd outage until its deadline, so an outage
        shows as a slow call), starts a new contact period when a later sync (or this one) ends: no
        member counts as dead until it lasted :attr:`member_expiry`, since nobody could write a
        heartbeat meanwhile (the problem was etcd, not them). One monotonic clock read more per sync.
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
        """Whether this node may call members dead: it has been in contact with etcd for
        :attr:`member_expiry` and its own stored heartbeat is fresh (a stalled observer, or one
        whose writes etcd delays, sees everyone old: then nobody is evicted)."""
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
        """Members of the local copy's completed round, other than this node, whose heartbeat
        is older than :attr:`member_expiry` now (or missing), sorted; ``[]`` while the round
        forms. No RPC."""
        state = self._state
        now = datetime.now(timezone.utc)
        if not state.complete or not self._may_judge(now):
            return []
        limit = now - self.member_expiry
        beats = state.last_heartbeats
        return sorted(n for n in state.participants if n != self._node and beats.get(n, limit) <= limit)

    def _sanitize(self) -> None:
        """Prune dead nodes from the local copy after a read or write (torch's hook).

        A forming round, or a completed round none of whose members is alive (the
        module docstring): torch's ``_sanitize``. Otherwise only the wait-list and
        redundancy-list nodes that are dead by torch's rule.
        """
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
        """``fast_recovery``: in the local copy, move the last-call deadline of a forming round that
        ``min_nodes`` joined, other than the first, into the past once no live node it knows is still out, so that torch's
        join op of a participant completes the round now (its next write stores that decision).

        A node it knows is one with a heartbeat in the state (the members of the round that ended,
        the wait list; not the redundancy list, which a round does not admit); live is a presence
        key in etcd (one keys-only Range per presence period, only while such a node is out). A
        node with no key (presence off, an older etcd-rdzv) is not waited for: it joins the next
        round. Without a fresh presence read nothing changes (torch's last call runs).
        """
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
        limit = now - self.member_expiry
        beats = state.last_heartbeats
        dead = all(beats.get(n, limit) <= limit for n in state.participants)
        if dead and state.participants:
            log.debug("round %s: every member looks dead, pruning it", state.round)
        return dead


class SealedRoundExecutor(_Executor):
    """torch's op executor whose exit from a completed round ends that round.

    torch's ``_remove_from_participants`` removes only the exiting node from a completed round
    and moves to the next round once the last member has left (``_remove_participant_epilogue``),
    so the survivors of a dead member wait in the wait list until its heartbeat is old enough to
    prune. Here the first member that leaves a completed round ends it in the same fenced write:
    ``participants={}``, ``complete=False``, ``round+1``, ``deadline=None`` (torch's epilogue,
    applied at the first exit instead of the last); the exiting node's heartbeat is removed as
    torch does; the other nodes' heartbeats, the wait list and the redundancy list are kept, so
    the next round admits them at once. A member still training in the ended round sees the round
    move on in its ``num_nodes_waiting()`` (:class:`~etcd_rdzv.dynamic.handler.EtcdRendezvousHandler`
    reports a waiting node) and joins the next one; one that had not yet read the sealed round
    never gets a world from it. A round that is still forming is left as torch leaves it. No RPC.

    Its events are torch's, named in O(1) (:func:`record_event`): torch records one between the
    read and the write of every state change, and its ``inspect.stack()`` made that window long
    enough on a loaded host for a joining node to lose every compare-and-swap to the heartbeats.
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
