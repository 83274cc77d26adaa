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
2.4). Everything else is torch's handler unchanged.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.rendezvous.api import RendezvousInfo
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from ..conf import get_positive_int, get_seconds, translate_legacy_params
from .backend import create_backend

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

log = logging.getLogger(__name__)

__all__ = ["EtcdRendezvousHandler", "create_handler_from_params"]


class EtcdRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous handler whose shared agent store is new every round."""

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class. Blocks until this node is in a complete round (or raises).

        Before joining, drops the previous round's shared TCPStore server and
        bootstrap info, so the round's rank 0 serves a fresh store and every node
        learns its address from this round.
        """
        self._drop_shared_store()
        return super().next_rendezvous()

    def num_nodes_waiting(self) -> int:
        """See base class; at least 1 once the rendezvous is closed. One Range.

        torch's agent polls only this method while its workers are healthy. When
        the run is closed from outside (``set_closed`` on any node), reporting a
        waiting node makes the agent stop its workers and call
        :meth:`next_rendezvous`, which raises ``RendezvousClosedError``: every
        agent ends within one monitor interval instead of training on. The state
        was synced by the base class in this same call, so this costs no RPC.
        """
        waiting = super().num_nodes_waiting()
        with self._heartbeat_lock:
            closed = self._state_holder.state.closed
        return max(waiting, 1) if closed else waiting

    def shutdown(self) -> bool:
        """See base class; also closes the shared TCPStore server this node hosted."""
        try:
            return super().shutdown()
        finally:
            self._drop_shared_store()

    def _drop_shared_store(self) -> None:
        server = getattr(self, "_shared_tcp_store_server", None)
        self._shared_tcp_store_server = None
        self._bootstrap_store_info = None
        if server is not None:
            log.debug("closing the shared TCPStore server on port %s", getattr(server, "port", "?"))
        del server  # the last reference: the server stops


def _timeout(params: Any, name: str) -> timedelta | None:
    seconds = get_seconds(params, f"{name}_timeout")
    return None if seconds is None else timedelta(seconds=seconds)


def create_handler_from_params(
    params: RendezvousParameters, *, legacy: bool = False
) -> EtcdRendezvousHandler:
    """Build backend, store and handler from torchrun's parameters.

    ``legacy``: read torch's legacy ``etcd`` conf keys too (see
    :func:`etcd_rdzv.conf.translate_legacy_params`). Handler keys as torch's
    ``create_handler``: ``join_timeout`` (600), ``last_call_timeout`` (30),
    ``close_timeout`` (30), ``heartbeat_timeout`` (5), ``keep_alive_interval`` (5),
    ``keep_alive_max_attempt`` (3). Raises ``ValueError`` naming a bad key (before
    any RPC), ``RendezvousConnectionError`` when the run's store cannot be opened
    within ``read_timeout``.
    """
    if legacy:
        params = translate_legacy_params(params)
    timeout = RendezvousTimeout(
        join=_timeout(params, "join"),
        last_call=_timeout(params, "last_call"),
        close=_timeout(params, "close"),
        heartbeat=_timeout(params, "heartbeat"),
    )
    keep_alive_interval = get_seconds(params, "keep_alive_interval")
    max_attempt = get_positive_int(params, "keep_alive_max_attempt", 3)
    backend, store = create_backend(params)
    handler = EtcdRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=keep_alive_interval or 5,  # type: ignore[arg-type]
        keep_alive_max_attempt=max_attempt,
    )
    assert isinstance(handler, EtcdRendezvousHandler)
    return handler
