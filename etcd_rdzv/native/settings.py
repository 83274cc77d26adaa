"""The settings of one ``etcd-v3`` rendezvous, read from ``RendezvousParameters``.

Client options (endpoints, TLS, auth, ``read_timeout``), ``key_prefix`` and
``state_ttl`` are parsed by :mod:`etcd_rdzv.conf`, shared with ``etcd-v2``, so
both backends accept the same ``--rdzv-conf`` keys. The rendezvous timeouts
keep the names and defaults of torch's ``DynamicRendezvousHandler`` (seconds):

* ``join_timeout`` (600): how long ``next_rendezvous`` may take; not counted
  down while a full, running group keeps the node out (torch's redundancy list).
* ``last_call_timeout`` (30): extra wait for more nodes once ``min_nodes`` joined.
* ``fast_recovery`` (true): a round that re-forms a group without growing it
  (this node was a member of the previous round, and the new round has no more
  joiners than that group had) is sealed as soon as the previous group has left,
  without the last call: every surviving member is back by then (leaving the old
  round and joining the new one is one transaction), so waiting longer only
  delays training. A round that grows still waits ``last_call_timeout``.
* ``close_timeout`` (30): deadline of ``set_closed`` / ``shutdown``.
* ``heartbeat``: the TTL of each node's lease, i.e. how long after its last
  keep-alive a node counts as dead. Default ``keep_alive_interval`` (5) x
  ``keep_alive_max_attempt`` (3) = 15 s, the time torch's handlers take to
  declare a node dead. torch's ``heartbeat_timeout`` (the deadline of one
  heartbeat write) is accepted and ignored: keep-alives are streamed.
* ``state_ttl`` (7200): how long the run's records outlive its last live node.

Every invalid value raises ``ValueError`` naming the key. Nothing here contacts etcd.
"""

from __future__ import annotations

import logging
import math
import socket
from dataclasses import dataclass
from typing import Protocol

from ..conf import (
    DEFAULT_KEY_PREFIX,
    DEFAULT_STATE_TTL,
    EtcdClientOptions,
    RdzvParams,
    get_positive_int,
    get_seconds_or,
    parse_rdzv_config,
)

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_LEASE_TTL", "V3Settings", "parse_settings"]

DEFAULT_JOIN_TIMEOUT = 600.0
DEFAULT_LAST_CALL_TIMEOUT = 30.0
DEFAULT_CLOSE_TIMEOUT = 30.0
DEFAULT_KEEP_ALIVE_INTERVAL = 5
DEFAULT_KEEP_ALIVE_MAX_ATTEMPT = 3
DEFAULT_LEASE_TTL = DEFAULT_KEEP_ALIVE_INTERVAL * DEFAULT_KEEP_ALIVE_MAX_ATTEMPT


class _Params(RdzvParams, Protocol):
    """The part of torch's ``RendezvousParameters`` read here."""

    run_id: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None: ...


@dataclass(frozen=True)
class V3Settings:
    """Everything the ``etcd-v3`` handler needs besides the etcd client.

    Durations are seconds. ``lease_ttl`` is the TTL of each node's lease (a node
    that stops refreshing it is gone after at most that long); ``state_ttl`` is
    the TTL of the run lease that holds the round records.
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


def parse_settings(params: _Params) -> tuple[V3Settings, EtcdClientOptions]:
    """Read the settings and the client options of an ``etcd-v3`` rendezvous.

    Raises ``ValueError`` naming the rdzv-conf key whose value is invalid. The
    lease TTL is ``heartbeat`` (rounded up to whole seconds) when given, else
    ``keep_alive_interval * keep_alive_max_attempt``.
    """
    config = parse_rdzv_config(params)
    if "heartbeat" in params.config and params.get("heartbeat") is not None:
        lease_ttl = math.ceil(get_seconds_or(params, "heartbeat", DEFAULT_LEASE_TTL))
    else:
        interval = get_positive_int(params, "keep_alive_interval", DEFAULT_KEEP_ALIVE_INTERVAL)
        attempts = get_positive_int(params, "keep_alive_max_attempt", DEFAULT_KEEP_ALIVE_MAX_ATTEMPT)
        lease_ttl = interval * attempts
    settings = V3Settings(
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        join_timeout=get_seconds_or(params, "join_timeout", DEFAULT_JOIN_TIMEOUT),
        last_call_timeout=get_seconds_or(params, "last_call_timeout", DEFAULT_LAST_CALL_TIMEOUT),
        close_timeout=get_seconds_or(params, "close_timeout", DEFAULT_CLOSE_TIMEOUT),
        lease_ttl=lease_ttl,
        state_ttl=config.state_ttl,
        key_prefix=config.key_prefix,
        fast_recovery=bool(params.get_as_bool("fast_recovery", True)),
    )
    return settings, config.client
