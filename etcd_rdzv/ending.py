"""How a node's ``shutdown()`` ends its part in a run: close the run, or only leave it.

torch's launcher (``torch.distributed.launcher.api.launch_agent``) calls
``rdzv_handler.shutdown()`` in a ``finally`` after ``agent.run()``, whatever happened:
after the workers all succeeded, but also while an exception propagates (restarts
exhausted: ``ChildFailedError``; a rendezvous or store-barrier error such as the
``DistStoreError`` of ``_assign_worker_ranks``; any other error of the agent). Only on
``SignalException`` (SIGTERM/SIGINT) does it skip ``shutdown()``. torch's own handlers
close the run in ``shutdown()`` in every case, so one node's failure closes the run for
every node (pytorch/pytorch#67616, #67742, #91943, #116974, #123678, #147064;
kubeflow/trainer#1638; dlrover#450): the other agents, and a restarted pod of the same
node, get ``RendezvousClosedError`` until the run's state expires.

Ours close the run only on a normal end. Called from that ``finally`` while an
exception propagates, ``sys.exc_info()`` is that exception (also in a function called
from there), which is how :meth:`shutdown` tells the two apart:
:func:`exception_in_flight` reads it, :func:`decide` (pure) decides.
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
    """The ending of a ``shutdown()`` called while ``in_flight`` propagates (None: none does).

    * No exception in flight: the agent's job ended normally (torchrun's launcher returns
      the workers' results from that ``try``): :attr:`Ending.CLOSE`, as torch's handlers.
    * Any exception in flight (``ChildFailedError`` when restarts are exhausted, a store
      barrier timeout, a rendezvous error, ``KeyboardInterrupt``...): this node failed, not
      the job: :attr:`Ending.LEAVE`. The run closes when a node ends normally, or with
      ``etcd-rdzv close``.
    * ``etcd_lost`` (the node's last etcd call failed for want of etcd; etcd-v3): leave too,
      whatever is in flight (a close would end the job of nodes that may still reach etcd).

    Pure: no I/O, no global state.
    """
    if etcd_lost or in_flight is not None:
        return Ending.LEAVE
    return Ending.CLOSE


def exception_in_flight() -> BaseException | None:
    """The exception being handled or propagated through a ``finally`` in this thread's
    callers (``sys.exc_info()``), None when there is none.

    Also an exception a caller handles in an ``except`` block around the call (or a
    ``with`` block's ``__exit__`` runs for): ``shutdown()`` called there counts as a
    failed node's, and leaves.
    """
    return sys.exc_info()[1]
