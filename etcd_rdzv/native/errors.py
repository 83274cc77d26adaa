"""The errors of an ``etcd-v3`` node, in its own terms.

The node (:mod:`etcd_rdzv.native.rounds`, :mod:`etcd_rdzv.native.node_leases` and
the modules they call) raises these, :class:`~etcd_rdzv.native.records.ProtocolStateError`
(records this protocol never writes) and the client's
:class:`~etcd_store.errors.EtcdError` subclasses (etcd failed or was out of reach).
Only the handler (:mod:`etcd_rdzv.native.handler`) turns them into torch's
rendezvous errors, in one place: :class:`RunClosed` and :class:`NodeShutDown` become
``RendezvousClosedError``, :class:`ClosedWhileKeptOut` ``RendezvousGracefulExitError``,
:class:`RoundTimeout` ``RendezvousTimeoutError``.
"""

from __future__ import annotations

from .records import ProtocolStateError

__all__ = ["ClosedWhileKeptOut", "NodeError", "NodeShutDown", "ProtocolStateError", "RoundTimeout",
           "RunClosed"]


class NodeError(Exception):
    """The base of the node's own errors (not raised itself)."""


class RunClosed(NodeError):
    """The run is closed: no round will form any more."""


class ClosedWhileKeptOut(RunClosed):
    """The run was closed while this node waited for room in a full, running group."""


class NodeShutDown(NodeError):
    """The node was stopped for good (its handler shut down or left)."""


class RoundTimeout(NodeError):
    """No round that includes this node was sealed within ``join_timeout``."""
