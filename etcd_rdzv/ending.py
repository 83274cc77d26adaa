"""How a node's ``shutdown()`` ends its part in a run: close the run, or only leave it.

torch's launcher (``torch.distributed.launcher.api.launch_agent``) calls
``rdzv_handler.shutdown()`` in a ``finally`` after ``agent.run()``: after success, but
also while an exception propagates (``ChildFailedError`` when restarts are exhausted; a
rendezvous or store-barrier error such as ``_assign_worker_ranks``'s ``DistStoreError``;
any other agent error). Only ``SignalException`` (SIGTERM/SIGINT) skips it. torch's own
handlers close the run in ``shutdown()`` in every case, so one node's failure closes the
run for every node (pytorch/pytorch#67616, #67742, #91943, #116974, #123678, #147064;
kubeflow/trainer#1638; dlrover#450): the other agents, and a restarted pod of the same
node, get ``RendezvousClosedError`` until the run's state expires.

Ours close the run only on a normal end. In that ``finally``, ``sys.exc_info()`` is the
propagating exception (also in functions called from there): :func:`exception_in_flight`
reads it, :func:`decide` (pure) decides.
"""

from __future__ import annotations

import enum
import sys

__all__ = ["Ending", "decide", "exception_in_flight"]


class Ending(enum.Enum):
    """What ``shutdown()`` does."""

    CLOSE = "close"
    """Close the run (no new round; members that run keep running), then release the node."""
    LEAVE = "leave"
    """Leave the run without closing it: withdraw this node (its membership, its lease) so the
    others re-form without it while ``min_nodes`` remain, and a restarted node can join."""


def decide(in_flight: BaseException | None, *, etcd_lost: bool = False) -> Ending:
    """The ending of a ``shutdown()`` called while ``in_flight`` propagates (None: nothing does). Pure.

    * Nothing in flight: the job ended normally (the launcher returns the workers' results
      from that ``try``): :attr:`Ending.CLOSE`, as torch's handlers.
    * Any exception in flight (``ChildFailedError``, a store barrier timeout, a rendezvous
      error, ``KeyboardInterrupt``...): this node failed, not the job: :attr:`Ending.LEAVE`.
      The run closes when a node ends normally, or with ``etcd-rdzv close``.
    * ``etcd_lost`` (etcd-v3: the node's last etcd call failed for want of etcd): leave too,
      whatever is in flight (a close would end the job of nodes that may still reach etcd).
    """
    if etcd_lost or in_flight is not None:
        return Ending.LEAVE
    return Ending.CLOSE


def exception_in_flight() -> BaseException | None:
    """The exception handled or propagating through a ``finally`` in this thread's callers
    (``sys.exc_info()``), or None.

    That includes one a caller handles in an ``except`` around the call (or a ``with``
    block's ``__exit__`` runs for): ``shutdown()`` called there counts as a failed node's, and leaves.
    """
    return sys.exc_info()[1]
