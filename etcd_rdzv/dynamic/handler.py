"""``EtcdRendezvousHandler``: torch's ``DynamicRendezvousHandler`` with a fresh agent store per round.

With agent-store sharing on (torch's default), torch's handler hosts one TCPStore in the rank-0
agent, hands its address to the workers as ``MASTER_ADDR``/``MASTER_PORT`` and caches it after the
first round: when membership changes, a former non-rank-0 node keeps an old (possibly departed)
address, and the store keeps earlier attempts' keys with no per-attempt prefix, so a restarted gloo
group can read a dead peer's address ("Connection refused" in connectFullMesh). This subclass
forgets both before every round (torch's ``_shared_tcp_store_server`` and
``_bootstrap_store_info``, present since torch 2.4): the new rank 0 starts a new TCPStore and every
node reads the round's address from the round's own etcd store. It also reports
:mod:`etcd_rdzv.metrics`.

It fixes torch's sealed-round defects (:mod:`etcd_rdzv.dynamic.state`; docs/operations.md): a
:class:`~etcd_rdzv.dynamic.state.SealedRoundStateHolder` never removes a member of a live completed
round on one reader's clock; a heartbeat that aged while the round sealed is refreshed when the
join ends; :meth:`EtcdRendezvousHandler.num_nodes_waiting` is positive when a member of our round is
dead or gone (heartbeat, or its presence key, :mod:`etcd_rdzv.dynamic.presence`) or our own entry
was removed; :class:`~etcd_rdzv.dynamic.state.SealedRoundExecutor` ends a completed round at the
first member's exit. ``shutdown()`` closes the rendezvous only on a normal end, else leaves
(:mod:`etcd_rdzv.ending`). Events are torch's, named in O(1)
(:func:`~etcd_rdzv.dynamic.state.record_event`). Everything else is torch's handler unchanged.
"""

from __future__ import annotations

import inspect
import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.events import NodeState
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as _dr
from torch.distributed.elastic.rendezvous.api import RendezvousInfo
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
)

from .. import metrics
from ..conf import DynamicSettings, parse_dynamic_settings
from ..ending import Ending, decide, exception_in_flight
from ..plugin_errors import torch_version
from .backend import EtcdRendezvousBackend, open_backend
from .presence import OBSERVERS, Presence
from .state import SealedRoundExecutor, SealedRoundStateHolder, check_torch_internals, record_event

if TYPE_CHECKING:
    from torch.distributed import Store
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        RendezvousSettings,
        _NodeDesc,
        _RendezvousState,
        _RendezvousStateHolder,
    )

log = logging.getLogger(__name__)

__all__ = ["EtcdRendezvousHandler", "create_handler", "create_handler_from_params"]


class EtcdRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous handler with a fresh agent store per round and sealed rounds that
    keep their members (module docstring)."""

    def __init__(
        self,
        node: _NodeDesc,
        settings: RendezvousSettings,
        backend_name: str,
        store: Store,
        state_holder: _RendezvousStateHolder,
    ) -> None:
        """See base class; torch's backend state holder is replaced by a :class:`SealedRoundStateHolder`
        on the same backend. Raises ``EtcdRdzvPluginError`` when torch lacks the private names used."""
        check_torch_internals()
        if type(state_holder) is _dr._BackendRendezvousStateHolder:
            state_holder = SealedRoundStateHolder.adopt(state_holder, node)
        super().__init__(node, settings, backend_name, store, state_holder)
        self._op_executor = SealedRoundExecutor(self._this_node, self._state_holder, self._settings)
        self._round_joined: int | None = None
        self._round_members: frozenset[_NodeDesc] = frozenset()
        self._restart_reported = ""
        self._left = False  # shutdown() left (a failed node): a later shutdown() does nothing
        self._presence: Presence | None = None  # create_handler's (presence_ttl > 0), else heartbeats only

    def keep_presence(self, presence: Presence) -> None:
        """Judge our rounds' members by ``presence`` too, and keep this node's key from its next join on.
        No RPC."""
        self._presence = presence
        if isinstance(self._state_holder, SealedRoundStateHolder):
            self._state_holder.presence = presence

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING, rank: int | None = None) -> None:
        """torch's event of this handler, named in O(1) (one is recorded per heartbeat, lock held)."""
        record_event(self, self._settings.run_id, message, node_state, self._this_node, rank)

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class. Blocks until this node is in a complete round (or raises).

        First drops the previous round's shared TCPStore server and bootstrap info, so the round's rank 0
        serves a fresh store. Reports the ``rendezvous.*`` metrics.
        """
        backend = self.get_backend()
        self._drop_shared_store()
        if self._presence is not None:
            self._presence.ensure(str(self._this_node))  # before the join: a member always has its key
        self._round_joined = None
        started = time.monotonic()
        metrics.put_rdzv(backend, metrics.JOINS)
        try:
            info = super().next_rendezvous()
        except Exception as e:
            metrics.rdzv_failed(backend, e)
            raise
        metrics.rdzv_completed(backend, started, info.world_size)
        return info

    def num_nodes_waiting(self) -> int:
        """See base class; at least 1 when this node's round must be re-formed. At most one Range.

        Positive when the run is closed (every agent then ends within one monitor interval), when our entry
        left the round, when a member sent no heartbeat for :attr:`SealedRoundStateHolder.member_expiry`
        (pytorch#111646), or, seen by a member of rank below :data:`~etcd_rdzv.dynamic.presence.OBSERVERS`,
        when a member's presence key is gone (one Range per :attr:`~etcd_rdzv.dynamic.presence.Presence.period`).
        """
        waiting = super().num_nodes_waiting()
        if self._presence is not None and self._round_joined is not None:
            # No RPC while its lease lives; a lost key is put anew at the first poll etcd answers,
            # before the old lease (extended by a new leader) expires: the others see no gap.
            self._presence.ensure(str(self._this_node))
        with self._heartbeat_lock:
            state = self._state_holder.state
            reason = self._restart_reason(state)
            observed = self._observed(state) if not reason else []
        if observed:
            reason = self._absent_reason(observed)
        if not reason:
            self._restart_reported = ""
            return waiting
        if reason != self._restart_reported:
            self._restart_reported = reason
            log.warning("node %s: reporting a waiting node to re-form the round: %s", self._this_node, reason)
        return max(waiting, 1)

    def _restart_reason(self, state: _RendezvousState) -> str:
        """Why this node's round must be re-formed ("" when it need not); call with the lock held."""
        if state.closed:
            return "the rendezvous is closed"
        joined = self._round_joined
        if joined is None:
            return ""
        if state.round != joined:
            return f"round {joined} ended (a member left it); this node joins round {state.round}"
        if self._this_node not in state.participants:
            return f"this node is no longer a participant of round {joined} (its entry was removed)"
        gone = sorted(self._round_members.difference(state.participants))
        if gone:  # a completed round admits no one: only a departure changes its participants
            return f"member(s) {', '.join(map(str, gone))} left round {joined}"
        holder = self._state_holder
        if not isinstance(holder, SealedRoundStateHolder):
            return ""
        dead = holder.dead_members()
        if dead:
            limit = holder.member_expiry.total_seconds()
            return f"member(s) {', '.join(map(str, dead))} of round {joined} sent no heartbeat for {limit:g} s"
        return ""

    def _observed(self, state: _RendezvousState) -> list[str]:
        """The other members whose presence we judge (we are a member of rank below
        :data:`~etcd_rdzv.dynamic.presence.OBSERVERS`); call with the lock held."""
        rank = state.participants.get(self._this_node)
        if self._presence is None or not state.complete or rank is None or rank >= OBSERVERS:
            return []
        return [str(n) for n in state.participants if n != self._this_node]

    def _absent_reason(self, observed: list[str]) -> str:
        """Why the round must re-form when a member's presence key is gone ("" if none); at most one Range."""
        presence = self._presence
        assert presence is not None
        gone = presence.departed(observed)
        if not gone:
            return ""
        return (f"member(s) {', '.join(gone)} of round {self._round_joined} lost their presence in etcd "
                f"(no renewal for {presence.ttl} s)")

    def _start_heartbeats(self) -> None:
        """See base class (a join succeeded); records the round joined and refreshes our heartbeat at once
        (one write if it aged while the round sealed).

        The refresh comes *before* torch's keep-alive timer starts: its first tick, one interval later,
        then finds a heartbeat at least one interval old and sends it. Refreshed after, the heartbeat
        would be just under an interval old at that tick, skipped, and reach two intervals.
        """
        state = self._state_holder.state
        self._round_joined = state.round
        self._round_members = frozenset(state.participants)
        self._keep_alive()
        super()._start_heartbeats()

    def shutdown(self) -> bool:
        """End this node: close the rendezvous on a normal end, else only leave it (:mod:`etcd_rdzv.ending`);
        also closes the shared TCPStore server this node hosted.

        With an exception in flight it does NOT close (torch does: pytorch/pytorch#67616): it stops the
        heartbeats and removes this node from the participants, wait and redundancy lists
        (:class:`_RendezvousLeaveOp`, within ``close_timeout``), so the others re-form without it and a
        restarted node can join. False if that failed (the heartbeat then ages out); True once left.
        """
        if self._left:
            return True
        try:
            in_flight = exception_in_flight()
            if decide(in_flight) is Ending.LEAVE:
                return self._leave(in_flight)
            return super().shutdown()
        finally:
            self._drop_shared_store()
            if self._presence is not None:
                self._presence.leave()

    def _leave(self, in_flight: BaseException | None) -> bool:
        """:meth:`shutdown` for a failed node: remove this node from the state, never close."""
        self._stop_heartbeats()
        self._left = True
        run_id = self._settings.run_id
        try:
            self._op_executor.run(_RendezvousLeaveOp(), self._get_deadline(self._settings.timeout.close))
        except Exception as e:  # never mask the failure in flight (torch's launcher re-raises it)
            log.warning("node %s ends on %s and could not leave the rendezvous %r (%s: %s): its heartbeat "
                        "will age out", self._this_node, type(in_flight).__name__, run_id, type(e).__name__, e)
            return False
        log.warning("node %s ends on %s: left the rendezvous %r without closing it", self._this_node,
                    type(in_flight).__name__, run_id)
        return True

    def _drop_shared_store(self) -> None:
        server = getattr(self, "_shared_tcp_store_server", None)
        self._shared_tcp_store_server = None
        self._bootstrap_store_info = None
        if server is not None:
            log.debug("closing the shared TCPStore server on port %s", getattr(server, "port", "?"))
        del server  # the last reference: the server stops


class _RendezvousLeaveOp:
    """torch's ``_RendezvousExitOp`` for a node leaving for good: also removes it from the wait and
    redundancy lists (torch's exit op precedes a re-join, which re-adds it there)."""

    def __call__(self, ctx: _dr._RendezvousContext, deadline: float) -> _dr._Action:
        state = ctx.state
        if ctx.node in state.participants:
            action = _dr._Action.REMOVE_FROM_PARTICIPANTS
        elif ctx.node in state.wait_list:
            action = _dr._Action.REMOVE_FROM_WAIT_LIST
        elif ctx.node in state.redundancy_list:
            action = _dr._Action.REMOVE_FROM_REDUNDANCY_LIST
        else:
            return _dr._Action.FINISH
        if time.monotonic() > deadline:
            return _dr._Action.ERROR_TIMEOUT
        return action


def create_handler_from_params(
    params: RendezvousParameters, *, legacy: bool = False
) -> EtcdRendezvousHandler:
    """Build backend, store and handler from torchrun's parameters
    (:func:`etcd_rdzv.conf.parse_dynamic_settings`; ``legacy``: torch's ``etcd`` keys too).

    Raises ``ValueError`` naming a bad key (before any RPC), ``RendezvousConnectionError`` when the
    run's store cannot be opened within ``read_timeout``.
    """
    from ..metrics import maybe_start

    settings = parse_dynamic_settings(params, legacy=legacy)
    maybe_start(params)  # the optional metrics endpoint (rdzv-conf metrics_port)
    return create_handler(settings)


def create_handler(settings: DynamicSettings) -> EtcdRendezvousHandler:
    """The handler of ``settings``: opens the backend and the run's store (one to three RPCs)."""
    backend, store = open_backend(settings.config, settings.run_id, name=settings.backend)
    metrics.watch_client(backend.client.stats)
    timeout = RendezvousTimeout(
        join=timedelta(seconds=settings.join_timeout),
        last_call=timedelta(seconds=settings.last_call_timeout),
        close=timedelta(seconds=settings.close_timeout),
        heartbeat=timedelta(seconds=settings.heartbeat_timeout),
    )
    handler = _from_backend(settings, store, backend, timeout)
    assert isinstance(handler, EtcdRendezvousHandler)
    if settings.presence_ttl > 0 and isinstance(backend, EtcdRendezvousBackend):
        handler.keep_presence(Presence(backend.client, backend.key, settings.presence_ttl))
        holder = handler._state_holder
        if isinstance(holder, SealedRoundStateHolder):
            holder.fast_recovery = settings.fast_recovery
    return handler


def _from_backend(
    settings: DynamicSettings, store: Store, backend: RendezvousBackend, timeout: RendezvousTimeout
) -> DynamicRendezvousHandler:
    """torch's ``from_backend`` with our keep-alive settings.

    Newer torch takes ``keep_alive_interval``/``keep_alive_max_attempt``; torch 2.6 (the floor) fixes
    5 s x 3 inside ``from_backend``, so there the handler is built as ``from_backend`` builds it, with
    our values in the shared ``RendezvousSettings``. ``cas_backoff_max_seconds`` goes to a torch that
    takes it (2.15+); elsewhere a non-zero value is logged and ignored.
    """
    args = (settings.run_id, store, backend, settings.min_nodes, settings.max_nodes, settings.local_addr, timeout)
    interval = timedelta(seconds=settings.keep_alive_interval)
    takes = inspect.signature(DynamicRendezvousHandler.from_backend).parameters
    extra: dict[str, Any] = {}
    if "cas_backoff_max_seconds" in takes:
        extra["cas_backoff_max_seconds"] = settings.cas_backoff_max_seconds
    elif settings.cas_backoff_max_seconds:
        log.warning("etcd-rdzv: torch %s's dynamic rendezvous has no cas_backoff_max_seconds (torch 2.15 and "
                    "later do): ignoring cas_backoff_max_seconds=%g", torch_version(),
                    settings.cas_backoff_max_seconds)
    if "keep_alive_interval" in takes:
        return EtcdRendezvousHandler.from_backend(
            *args,
            keep_alive_interval=settings.keep_alive_interval,  # type: ignore[arg-type]  # seconds
            keep_alive_max_attempt=settings.keep_alive_max_attempt,
            **extra,
        )
    rdzv_settings = RendezvousSettings(
        settings.run_id, settings.min_nodes, settings.max_nodes, timeout,
        keep_alive_interval=interval, keep_alive_max_attempt=settings.keep_alive_max_attempt,
    )  # fmt: skip
    node = EtcdRendezvousHandler._node_desc_generator.generate(settings.local_addr)
    holder = _BackendRendezvousStateHolder(backend, rdzv_settings)
    return EtcdRendezvousHandler(node, rdzv_settings, backend.name, store, holder)
