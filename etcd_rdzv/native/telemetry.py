"""torch rendezvous events and etcd-rdzv metrics of one ``etcd-v3`` node.

:class:`RoundObserver` is what :class:`~etcd_rdzv.native.rounds.Participant` reports about its
rounds (:class:`SilentObserver` ignores it); :class:`Telemetry`, the handler's, records each as a
torch rendezvous event (``construct_and_record_rdzv_event``, as torch's handlers do, so events
reach torch's ``dynamic_rendezvous`` destination) and as :mod:`etcd_rdzv.metrics`. Events are
named ``EtcdV3RendezvousHandler.<method>``; their list is in docs/operations.md ("Events and
metrics").

Recording never raises and costs one ``isinstance`` while torch's destination is its default null
handler. No event holds a secret: only the run, node, rounds, ranks and addresses.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from torch.distributed.elastic.events import NodeState, construct_and_record_rdzv_event

from .. import metrics
from .settings import V3Settings

log = logging.getLogger(__name__)

__all__ = ["HANDLER_NAME", "RoundObserver", "SilentObserver", "Telemetry"]

HANDLER_NAME = "EtcdV3RendezvousHandler"
BACKEND = "etcd-v3"


class RoundObserver(Protocol):
    """What a participant reports about its rounds (must not raise)."""

    def joined(self, round_: int, count: int) -> None:
        """The node's join key is in round ``round_`` (``count`` joined, ours included)."""

    def lease_lost(self) -> None:
        """The node's lease ended without a shutdown; a new one replaces it now."""


class SilentObserver:
    """A :class:`RoundObserver` that ignores everything (a participant without telemetry)."""

    def joined(self, round_: int, count: int) -> None:
        pass

    def lease_lost(self) -> None:
        pass


class Telemetry:
    """Events and metrics of one handler (see the module docstring). Thread-safe."""

    def __init__(self, settings: V3Settings, node_id: str, local_id: int) -> None:
        self._run_id = settings.run_id
        self._host = settings.node_addr
        self._node_id = node_id
        self._local_id = local_id
        self._lost_round: int | None = None  # the round whose member loss was reported

    def record(
        self,
        method: str,
        message: str,
        state: NodeState = NodeState.RUNNING,
        *,
        rank: int | None = None,
        master: str = "",
    ) -> None:
        """One torch rendezvous event; FAILED ones carry the trace of the exception being handled."""
        try:
            construct_and_record_rdzv_event(
                run_id=self._run_id, message=message, node_state=state,
                name=f"{HANDLER_NAME}.{method}", hostname=self._host,
                pid=None, master_endpoint=master, local_id=self._local_id, rank=rank,
            )
        except Exception as e:  # an event destination must never break the rendezvous
            log.debug("recording the rendezvous event %s failed: %s", method, e)

    # ------------------------------------------------------------------ RoundObserver

    def joined(self, round_: int, count: int) -> None:
        self.record("join", f"The node '{self._node_id}' joined round {round_} of the rendezvous "
                            f"'{self._run_id}' ({count} joined).")
        metrics.put_rdzv(BACKEND, metrics.JOINS)

    def lease_lost(self) -> None:
        self.record("lease", f"The node '{self._node_id}' lost its lease in the rendezvous "
                             f"'{self._run_id}' and joins with a new one.")
        metrics.put_rdzv(BACKEND, metrics.LEASE_LOST)

    # ------------------------------------------------------------------ the handler's

    def attempt(self) -> float:
        """The node starts ``next_rendezvous``; returns the start time for :meth:`completed`."""
        self.record("next_rendezvous", f"The node '{self._node_id}' attempts to join the next round "
                                       f"of the rendezvous '{self._run_id}'.")
        return time.monotonic()

    def completed(self, round_: int, rank: int, world_size: int, started: float,
                  master: tuple[str, int] | None) -> None:
        self.record(
            "next_rendezvous",
            f"The node '{self._node_id}' has joined round {round_} of the rendezvous "
            f"'{self._run_id}' as rank {rank} in a world of size {world_size}.",
            rank=rank, master="" if master is None else f"{master[0]}:{master[1]}",
        )
        metrics.rdzv_completed(BACKEND, started, world_size)

    def failed(self, method: str, error: BaseException) -> None:
        """``method`` raised ``error``; call from its ``except`` block (the event carries the trace)."""
        self.record(method, f"{type(error).__name__}: {error} (node '{self._node_id}')", NodeState.FAILED)
        if method == "next_rendezvous":
            metrics.rdzv_failed(BACKEND, error)

    def member_lost(self, round_: int, active: int, world_size: int) -> None:
        """A member of round ``round_`` went (``active`` of ``world_size`` left); once per round."""
        if self._lost_round == round_:
            return
        self._lost_round = round_
        self.record("num_nodes_waiting",
                    f"The node '{self._node_id}' sees {world_size - active} of {world_size} members "
                    f"of round {round_} of the rendezvous '{self._run_id}' gone.")
        metrics.put_rdzv(BACKEND, metrics.MEMBERS_LOST)
        log.info("node %s: %d of %d members of round %d of %r are gone", self._node_id,
                 world_size - active, world_size, round_, self._run_id)

    def closed(self) -> None:
        self.record("set_closed", f"The node '{self._node_id}' has closed the rendezvous "
                                  f"'{self._run_id}'.", NodeState.SUCCEEDED)

    def left(self, revoked: bool) -> None:
        how = "" if revoked else " (etcd did not confirm: its lease will expire)"
        self.record("leave", f"The node '{self._node_id}' has left the rendezvous '{self._run_id}'{how}.",
                    NodeState.SUCCEEDED)
