"""``V3Settings``: the frozen settings of one ``etcd-v3`` rendezvous.

Parsed by :func:`etcd_rdzv.conf.parse_v3_settings` (the configuration pass shared with ``etcd-v2``).
Construction checks interdependent values and raises ``ValueError`` naming them; no etcd contact.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass

from ..conf_keys import (
    DEFAULT_CLOSE_TIMEOUT,
    DEFAULT_EVICT_MISSES,
    DEFAULT_JOIN_TIMEOUT,
    DEFAULT_KEY_PREFIX,
    DEFAULT_LAST_CALL_TIMEOUT,
    DEFAULT_LEASE_TTL,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_RENEW_INTERVAL,
    DEFAULT_STATE_TTL,
)

__all__ = ["SEAL_DELTA_BYTES", "V3Settings", "node_id_bytes", "run_root", "seal_request_bytes"]

_WORST_ADDR_BYTES = 253  # the longest host name

SEAL_DELTA_BYTES = 12
"""Bytes per member in a ``"created"`` membership: a delta of up to 11 digits and a comma (the
first revision, absolute, is in the fixed part)."""


def run_root(key_prefix: str, run_id: str) -> str:
    """``<key_prefix>/<run_id>/v3`` (``<run_id>/v3`` without a prefix): the root of every key of a run
    (:class:`~etcd_rdzv.native.records.RunKeys`)."""
    base = f"{key_prefix.rstrip('/')}/{run_id}" if key_prefix else run_id
    return f"{base}/v3"


def node_id_bytes(node_addr: str) -> int:
    """The most bytes a node id advertising ``node_addr`` takes: the address, ``_pid`` (7 digits),
    ``_`` + counter (3), ``_`` + 6 hex digits (``EtcdV3RendezvousHandler.node_id``)."""
    return len(node_addr.replace("/", "_").encode()) + 19


def seal_request_bytes(root: str, members: int, node_id_size: int) -> int:
    """An upper estimate of the seal Txn's size (:func:`~etcd_rdzv.native.protocol.seal`), which etcd's
    ``--max-request-bytes`` (1.5 MiB by default) bounds. The seal names every member twice (node ids
    in ``rounds/T/members``, create revisions in ``ctl/sealed`` when somebody left): about 64 bytes a
    node for a 45-byte id; the rest is under 2 KiB."""
    per_member = node_id_size + 4 + SEAL_DELTA_BYTES + 2  # '"id", ' in the members list, the delta
    return 2048 + 8 * len(root.encode()) + members * per_member


@dataclass(frozen=True)
class V3Settings:
    """Everything the ``etcd-v3`` handler needs besides the etcd client (seconds).

    Each field is the rdzv-conf key of its name (meanings and defaults: :data:`etcd_rdzv.conf_keys.KEYS`),
    but ``lease_ttl``: each node's lease TTL (``heartbeat``, else ``keep_alive_interval`` x
    ``keep_alive_max_attempt``), after which a silent node counts as dead. Construction also checks
    that the seal of ``max_nodes`` members fits ``max_request_bytes``.
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
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    renew_interval: float = DEFAULT_RENEW_INTERVAL
    evict_misses: int = DEFAULT_EVICT_MISSES

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
        if not (math.isfinite(self.renew_interval) and self.renew_interval > 0):
            raise ValueError(f"renew_interval must be a positive number of seconds, got {self.renew_interval!r}.")
        if self.evict_misses < 0:
            raise ValueError(f"evict_misses must be 0 (no eviction) or more, got {self.evict_misses}.")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be a positive number of bytes, got {self.max_request_bytes}.")
        self._check_seal_fits()

    def _check_seal_fits(self) -> None:
        """``ValueError`` when a round of ``max_nodes`` could not be sealed within etcd's request limit
        (node ids estimated from this node's address, resolved only if a long address would not fit)."""
        root = run_root(self.key_prefix, self.run_id)
        worst = node_id_bytes("x" * _WORST_ADDR_BYTES)
        if seal_request_bytes(root, self.max_nodes, worst) <= self.max_request_bytes:
            return
        id_bytes = node_id_bytes(self.node_addr)
        need = seal_request_bytes(root, self.max_nodes, id_bytes)
        if need <= self.max_request_bytes:
            return
        fixed = seal_request_bytes(root, 0, id_bytes)
        per_node = seal_request_bytes(root, 1, id_bytes) - fixed
        fit = max((self.max_request_bytes - fixed) // per_node, 0)
        raise ValueError(
            f"max_nodes={self.max_nodes} is too large for etcd-v3: sealing a round is one etcd "
            f"request naming every member, {per_node} bytes a node with ids like this node's "
            f"({id_bytes} bytes, address {self.node_addr!r}): about {need} bytes for "
            f"{self.max_nodes} nodes, above etcd's request limit of {self.max_request_bytes} bytes "
            f"(--max-request-bytes, 1.5 MiB by default); at most {fit} nodes fit. Lower max_nodes "
            "(--nnodes), or run etcd with a larger --max-request-bytes and set max_request_bytes "
            "to it in --rdzv-conf."
        )

    @property
    def renew_every(self) -> float:
        """Seconds between keep-alives: ``renew_interval``, at most a third of ``lease_ttl`` (a live node
        always has two renewals within its TTL)."""
        return min(self.renew_interval, self.lease_ttl / 3.0)

    @property
    def node_addr(self) -> str:
        """The address this node advertises (``local_addr`` or the FQDN, as torch does)."""
        return self.local_addr or socket.getfqdn()
