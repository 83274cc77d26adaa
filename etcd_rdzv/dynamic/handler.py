"""``EtcdRendezvousHandler``: torch's ``DynamicRendezvousHandler`` with a fresh agent store per round.

With agent-store sharing on (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` unset, torch's
default), torch's handler hosts one TCPStore in the rank-0 agent, hands its
address to the workers as ``MASTER_ADDR``/``MASTER_PORT``, and caches that
address after the first round. Two things then go wrong when membership
changes: a node that was not rank 0 keeps the old address (possibly of a node
that left), and the store keeps the keys of earlier attempts while workers in
that mode use no per-attempt prefix, so a restarted gloo group can read a dead
peer's address ("Connection refused" in connectFullMesh).

This subclass forgets both before every round: the rank-0 node of the new round
starts a new TCPStore server (the previous one, if this node hosted it, is
closed first; the agent has already stopped the workers that used it) and every
node reads the round's ``MASTER_ADDR``/``MASTER_PORT`` from the round's own
(per-round prefixed) etcd store. It relies on two attributes of torch's handler,
``_shared_tcp_store_server`` and ``_bootstrap_store_info`` (present since torch
2.4). It also reports the metrics of :mod:`etcd_rdzv.metrics` (torch's handler
records the rendezvous events itself).

It also fixes torch's sealed-round defects (:mod:`etcd_rdzv.dynamic.state`):
the state holder is a :class:`~etcd_rdzv.dynamic.state.SealedRoundStateHolder`, which
never removes a member of a live completed round on one reader's clock; a heartbeat that
aged while the round sealed is refreshed as soon as the join ends; and
:meth:`EtcdRendezvousHandler.num_nodes_waiting` reports a waiting node when a member
of this node's round is dead or this node's own entry was removed, so the agents
re-rendezvous (and admit a replacement) instead of training on without it; a member
that left the round counts the same. A member is also dead once its presence key, on a lease of
``presence_ttl`` (3 s) that etcd's leader expires, is gone (:mod:`etcd_rdzv.dynamic.presence`):
a hung node is dropped seconds after it stopped, not after its heartbeat window. Its op executor
(:class:`~etcd_rdzv.dynamic.state.SealedRoundExecutor`) ends a completed round at the first
member's exit, in the same fenced write, so the survivors of a dead member re-form
at once instead of waiting for its heartbeat to expire. And ``shutdown()`` closes the
rendezvous only on a normal end: called while an exception propagates (torchrun's agent
failed) it removes this node instead (:mod:`etcd_rdzv.ending`).
Its rendezvous events (and those of its holder and executor) are torch's, named without torch's
``inspect.stack()``, whose cost sat inside every compare-and-swap window
(:func:`~etcd_rdzv.dynamic.state.record_event`).
Everything else is torch's handler unchanged.
"""

from __future__ import annotations

import inspect
import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.events import NodeState
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as _dr
from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousTimeoutError
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
    """torch's dynamic rendezvous handler whose shared agent store is new every round
    and whose completed rounds keep their members (module docstring)."""

    def __init__(
        self,
        node: _NodeDesc,
        settings: RendezvousSettings,
        backend_name: str,
        store: Store,
        state_holder: _RendezvousStateHolder,
    ) -> None:
        """See base class; torch's backend state holder (``from_backend``'s) is replaced by a
        :class:`SealedRoundStateHolder` on the same backend. Raises ``EtcdRdzvPluginError``
        when torch lacks the private torch names this relies on."""
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
        """Judge the members of this node's rounds by ``presence`` too, and keep this node's key
        there from its next join on (:mod:`etcd_rdzv.dynamic.presence`). No RPC."""
        self._presence = presence
        if isinstance(self._state_holder, SealedRoundStateHolder):
            self._state_holder.presence = presence

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING, rank: int | None = None) -> None:
        """torch's event of this handler (same fields), named in O(1) (:func:`~etcd_rdzv.dynamic.state.record_event`:
        torch's ``inspect.stack()`` costs milliseconds per event, and one is recorded per heartbeat, with the
        heartbeat lock held)."""
        record_event(self, self._settings.run_id, message, node_state, self._this_node, rank)

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class. Blocks until this node is in a complete round (or raises).

        Before joining, drops the previous round's shared TCPStore server and
        bootstrap info, so the round's rank 0 serves a fresh store and every node
        learns its address from this round. Reports the ``rendezvous.*`` metrics.
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
            timed_out = isinstance(e, RendezvousTimeoutError)
            metrics.put_rdzv(backend, metrics.TIMEOUTS if timed_out else metrics.FAILURES)
            raise
        metrics.put_rdzv(backend, metrics.COMPLETED)
        metrics.put_rdzv(backend, metrics.DURATION_MS, int((time.monotonic() - started) * 1000))
        metrics.put_rdzv(backend, metrics.WORLD_SIZE, info.world_size)
        return info

    def num_nodes_waiting(self) -> int:
        """See base class; at least 1 when this node's round must be re-formed. At most one Range.

        torch's agent polls only this method while its workers are healthy;
        reporting a waiting node makes it stop its workers and call
        :meth:`next_rendezvous`. That happens when the run is closed from outside
        (``next_rendezvous`` then raises ``RendezvousClosedError``: every agent ends
        within one monitor interval instead of training on), when this node's entry
        is no longer in its round (another node removed it), and when a member of
        the completed round has sent no heartbeat for
        :attr:`SealedRoundStateHolder.member_expiry` (pytorch#111646: the survivors
        re-form the round, admitting a waiting replacement) or, seen by a member of rank below
        :data:`~etcd_rdzv.dynamic.presence.OBSERVERS`, whose presence key is gone. The state was
        synced by the base class in this same call; the presence keys cost an observer one Range
        per :attr:`~etcd_rdzv.dynamic.presence.Presence.period` (0.5 s by default).
        """
        waiting = super().num_nodes_waiting()
        if self._presence is not None and self._round_joined is not None:
            # No RPC while its lease lives; after it was lost (cut off from etcd for a TTL, a quorum
            # loss the client sat out) the key is put anew at the first poll etcd answers, before the
            # old lease, which etcd's new leader extended by a TTL, expires: the others see no gap.
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
        """The other members whose presence this node judges (it is a member of the completed round
        of rank below :data:`~etcd_rdzv.dynamic.presence.OBSERVERS`), by name; call with the lock held."""
        rank = state.participants.get(self._this_node)
        if self._presence is None or not state.complete or rank is None or rank >= OBSERVERS:
            return []
        return [str(n) for n in state.participants if n != self._this_node]

    def _absent_reason(self, observed: list[str]) -> str:
        """Why the round must re-form when a member's presence key is gone ("" if none); at most one
        Range (:meth:`~etcd_rdzv.dynamic.presence.Presence.departed`)."""
        presence = self._presence
        assert presence is not None
        gone = presence.departed(observed)
        if not gone:
            return ""
        return (f"member(s) {', '.join(gone)} of round {self._round_joined} lost their presence in etcd "
                f"(no renewal for {presence.ttl} s)")

    def _start_heartbeats(self) -> None:
        """See base class (called when a join succeeded); also records the round joined and
        refreshes this node's heartbeat at once if it aged while the round sealed
        (one write then; none when it is fresh).

        The refresh comes *before* torch's keep-alive timer starts: the timer waits one
        interval from its start, so its first tick finds a heartbeat at least one interval
        old and sends it. (Refreshing after the start left a heartbeat a little younger than
        the interval at the first tick, which torch's keep-alive then skipped: a live node's
        stored heartbeat reached two intervals.)"""
        state = self._state_holder.state
        self._round_joined = state.round
        self._round_members = frozenset(state.participants)
        self._keep_alive()
        super()._start_heartbeats()

    def shutdown(self) -> bool:
        """End this node: close the rendezvous on a normal end, else only leave it
        (:mod:`etcd_rdzv.ending`); also closes the shared TCPStore server this node hosted.

        torchrun's launcher calls it in a ``finally`` after its agent ran, also when the agent
        failed. With no exception in flight (the workers all succeeded) it closes the
        rendezvous, as torch's handler does. While an exception propagates (the restarts ran
        out, a store barrier timed out, any error of the agent) it does NOT close it (torch's
        handler does: pytorch/pytorch#67616): it stops the heartbeats and removes this node
        from the state (participants, wait list, redundancy list: :class:`_RendezvousLeaveOp`,
        compare-and-swap writes of the state, within ``close_timeout``), so the other members re-form without
        it (:meth:`num_nodes_waiting` reports the departure) and a restarted node can join.
        Returns False if that removal failed (then the node's heartbeat ages out). A no-op
        (True) after it left.
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
        """:meth:`shutdown`'s ending for a failed node: remove this node from the state, never close."""
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
    """torch's ``_RendezvousExitOp`` for a node that leaves for good: removes it from the
    participants, and also from the wait list and the redundancy list (torch's exit op runs
    before a re-join, which puts the node on those lists again, so it leaves them alone)."""

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
    """Build backend, store and handler from torchrun's parameters.

    The settings come from :func:`etcd_rdzv.conf.parse_dynamic_settings` (``legacy``:
    read torch's legacy ``etcd`` keys too); handler keys as torch's ``create_handler``.
    Raises ``ValueError`` naming a bad key (before any RPC),
    ``RendezvousConnectionError`` when the run's store cannot be opened within
    ``read_timeout``.
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

    Newer torch takes ``keep_alive_interval`` (seconds)/``keep_alive_max_attempt``; torch 2.6 (the floor) fixes them
    at 5 s x 3 inside ``from_backend``, so there the handler is built the way its ``from_backend`` builds
    it, with our values in the frozen ``RendezvousSettings`` (its public fields) that the state holder and
    the handler share. ``cas_backoff_max_seconds`` goes to a torch whose ``from_backend`` takes it
    (2.15 and later); an older torch has no such setting: a non-zero value is logged and ignored there.
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
