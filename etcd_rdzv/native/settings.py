"""``V3Settings``: the frozen settings of one ``etcd-v3`` rendezvous.

Read from torchrun's parameters by :func:`etcd_rdzv.conf.parse_v3_settings`
(the one configuration pass, shared with ``etcd-v2``, so both backends accept
the same connection keys). Constructing one checks the values that depend on
each other and raises ``ValueError`` naming them. Nothing here contacts etcd.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass

from ..defaults import (
    DEFAULT_CLOSE_TIMEOUT,
    DEFAULT_JOIN_TIMEOUT,
    DEFAULT_KEY_PREFIX,
    DEFAULT_LAST_CALL_TIMEOUT,
    DEFAULT_LEASE_TTL,
    DEFAULT_STATE_TTL,
)

__all__ = ["DEFAULT_LEASE_TTL", "V3Settings"]


@dataclass(frozen=True)
class V3Settings:
    """Everything the ``etcd-v3`` handler needs besides the etcd client (seconds).

    The rendezvous timeouts keep the names and defaults of torch's handler:

    * ``join_timeout`` (600): how long ``next_rendezvous`` may take; not counted
      down while a full, running group keeps the node out (torch's redundancy list).
    * ``last_call_timeout`` (30): extra wait for more nodes once ``min_nodes`` joined.
    * ``fast_recovery`` (true): a round that only re-forms this node's previous group
      (no more joiners than that group had) is sealed once the previous round is
      empty, without the last call: leaving a round and joining the next is one
      transaction, so every survivor is back by then. A growing round still waits.
    * ``close_timeout`` (30): deadline of ``set_closed`` / ``shutdown``.
    * ``lease_ttl`` (rdzv-conf ``heartbeat``): the TTL of each node's lease, i.e.
      how long after its last keep-alive a node counts as dead. Default
      ``keep_alive_interval`` (5) x ``keep_alive_max_attempt`` (3) = 15 s, the time
      torch's handlers take to declare a node dead. torch's ``heartbeat_timeout``
      (the deadline of one heartbeat write) is accepted and ignored: keep-alives
      are streamed.
    * ``state_ttl`` (7200): the TTL of the run lease that holds the round records,
      i.e. how long they outlive the run's last live node.
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None = None
    join_timeout: float = DEFAULT_JOIN_TIMEOUT
    last_call_timeout: float = DEFAULT_LAST_CALL_TIMEOUT
    close_timeout: float = DEFAULT_CLOSE_TIMEOUT
    lease_ttl: int = DEFAULT_LEASE_TTL
    state_ttl: int = DEFAULT_STATE_TTL
    key_prefix: str = DEFAULT_KEY_PREFIX
    fast_recovery: bool = True

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ValueError("The rendezvous run id (--rdzv-id) must be a non-empty string.")
        if self.min_nodes < 1:
            raise ValueError(f"min_nodes must be at least 1, got {self.min_nodes}.")
        if self.max_nodes < self.min_nodes:
            raise ValueError(
                f"max_nodes ({self.max_nodes}) must be at least min_nodes ({self.min_nodes})."
            )
        for name in ("join_timeout", "last_call_timeout", "close_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}.")
        if self.lease_ttl < 1:
            raise ValueError(f"The lease TTL (heartbeat) must be at least 1 s, got {self.lease_ttl}.")
        if self.state_ttl < self.lease_ttl:
            raise ValueError(
                f"state_ttl ({self.state_ttl} s) must be at least the lease TTL "
                f"({self.lease_ttl} s, option 'heartbeat')."
            )

    @property
    def node_addr(self) -> str:
        """The address this node advertises (``local_addr`` or the FQDN, as torch does)."""
        return self.local_addr or socket.getfqdn()
