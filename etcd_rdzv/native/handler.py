"""``EtcdV3RendezvousHandler``: torch's ``RendezvousHandler`` contract on etcd v3 primitives.

One node = one handler = one lease (TTL ``lease_ttl``) on one keep-alive stream; a join is one Txn,
a wait one watch of the run's ``ctl/`` keys, a seal one fenced Txn (:mod:`~etcd_rdzv.native.protocol`,
driven by :class:`~etcd_rdzv.native.rounds.Participant`; docs/etcd-v3-design.md). No node writes
while a job runs: liveness is the lease alone. This module is the one place where the node's errors
become torch's (:func:`torch_error`).

Cost of an uncontended ``next_rendezvous``: one join Txn, one watch; a read Txn and a seal Txn for
one node per round; plus one store Txn for rank 0 (MASTER_ADDR/PORT), nothing for the others while
the sealed record names rank 0's port (probed at most ``MASTER_PORT_MAX_AGE`` before the seal).

**Liveness.** torch's agent polls ``num_nodes_waiting()`` while its workers are healthy and restarts
them when it is positive; it never calls ``is_closed()``. A closed run answers 0, as torch's
handlers do (torchrun closes the run at each agent's normal end, and a node still running, e.g.
rank 0 writing a checkpoint, must keep its workers); an aborted run (``etcd-rdzv close``,
:meth:`~EtcdV3RendezvousHandler.set_closed`) answers positive for every node.

An etcd outage longer than the TTL expires every lease, and with them the members' join keys,
although no node died. So a member whose key (or lease session) is gone **re-attaches** with one
Txn fenced on "our round is still the last sealed one and the run is open"
(:meth:`~etcd_rdzv.native.rounds.Participant.reattach`; if that fails its group is over). After a
sign of an outage (this node re-attached, or the read took over a third of the TTL), missing members
get :attr:`GroupCheck.grace` to re-attach before they count as lost, unless a node already waits in
the next round; without such a sign a missing member counts at once. Why this drops no live member:
docs/etcd-v3-design.md (Transitions, "num_nodes_waiting()"). A check costs one read Txn; after an
outage one LeaseGrant and one Txn more, each bounded by the client's timeout.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from etcd_store.client import EtcdClient
from etcd_store.errors import EtcdConnectionError, EtcdError, EtcdTimeoutError

from .. import metrics
from ..ending import Ending, decide, exception_in_flight
from . import protocol
from .barrier import Group, JoinDeadline, RoundResult, nodes_waiting
from .records import (
    ClosedWhileKeptOut,
    NodeError,
    NodeShutDown,
    ProtocolStateError,
    RoundTimeout,
    RunClosed,
    RunKeys,
)
from .rounds import Participant
from .settings import V3Settings
from .start import bootstrap_info, round_store
from .telemetry import Telemetry

if TYPE_CHECKING:
    from etcd_store import EtcdStore

log = logging.getLogger(__name__)

__all__ = ["BACKEND_NAME", "EtcdV3RendezvousHandler", "GroupCheck", "RoundResult"]

BACKEND_NAME = "etcd-v3"

LEAVE_TIMEOUT = 2.0
"""Seconds :meth:`EtcdV3RendezvousHandler.leave` may take (all RPCs): it runs at interpreter exit."""

OUTAGE_CLOSE_TIMEOUT = LEAVE_TIMEOUT
"""Seconds :meth:`EtcdV3RendezvousHandler.shutdown` may take after etcd was unreachable (it then
only leaves): the agent exits about ``read_timeout`` + 2 s after its failing call began."""

_local_ids = itertools.count()


def torch_error(e: NodeError | ProtocolStateError | EtcdError, run_id: str, *, closing: bool = False,
                shut_down: bool = False) -> RendezvousError:
    """The one translation of an ``etcd-v3`` node's errors into torch's (pure).

    :class:`RunClosed`, :class:`NodeShutDown` → ``RendezvousClosedError``; :class:`ClosedWhileKeptOut`
    → ``RendezvousGracefulExitError``; :class:`RoundTimeout` → ``RendezvousTimeoutError``;
    ``ProtocolStateError`` → ``RendezvousStateError``. etcd's: ``EtcdTimeoutError`` while ``closing``
    → ``RendezvousTimeoutError``; after ``shut_down`` → ``RendezvousClosedError``; else
    ``RendezvousConnectionError``.
    """
    if isinstance(e, ClosedWhileKeptOut):
        return RendezvousGracefulExitError(str(e))
    if isinstance(e, (RunClosed, NodeShutDown)):
        return RendezvousClosedError(str(e))
    if isinstance(e, RoundTimeout):
        return RendezvousTimeoutError(str(e))
    if isinstance(e, ProtocolStateError):
        return RendezvousStateError(f"rendezvous {run_id!r}: {e}")
    if isinstance(e, EtcdTimeoutError):
        if closing:
            return RendezvousTimeoutError(f"closing the rendezvous timed out: {e}")
        return RendezvousConnectionError(f"etcd did not answer in time: {e}")
    if shut_down and not closing:
        return RendezvousClosedError("the handler was shut down")
    return RendezvousConnectionError(str(e))


# --------------------------------------------------------------------------- liveness


class GroupCheck:
    """``num_nodes_waiting()`` of one node (see the module docstring); one call at a time."""

    def __init__(
        self, settings: V3Settings, client: EtcdClient, keys: RunKeys, node: Participant, node_id: str,
        on_member_lost: Callable[[int, int, int], None] | None = None,
    ) -> None:
        """``on_member_lost(round, active, world)``: telemetry when members are gone; must not raise."""
        self._settings = settings
        self._on_member_lost = on_member_lost
        self._node_id = node_id
        self._client = client
        self._keys = keys
        self._node = node
        self._tolerate_until = 0.0
        self._tolerated_round: int | None = None
        self._cannot_reattach: int | None = None  # a round whose re-attach failed: the group is over

    @property
    def grace(self) -> float:
        """Seconds missing members have after an outage to re-attach: client timeout + lease TTL."""
        return self._client.timeout + self._settings.lease_ttl

    def nodes_waiting(self) -> int:
        node, s = self._node, self._settings
        member_round = node.standing.member_round
        started = time.monotonic()
        if member_round is None:
            round_ = protocol.read_meta(self._client, self._keys).sealed.round
            occ = protocol.count_waiting(self._client, self._keys, round_)
            return nodes_waiting(occ, Group(), s.max_nodes, time.monotonic())
        occ = protocol.count_waiting(
            self._client, self._keys, member_round, node_key=self._keys.join_key(member_round, self._node_id)
        )
        now = time.monotonic()
        if self._tolerated_round != member_round:  # a new group: forget an older outage
            self._tolerated_round, self._tolerate_until = member_round, 0.0
        outage = now - started > s.lease_ttl / 3.0  # etcd did not answer for a keep-alive interval
        lease_ok = True
        session = node.session
        if not occ.closed and (not occ.mine or session is None or session.done().is_set()):
            reattached = None if self._cannot_reattach == member_round else node.reattach()
            lease_ok, outage = reattached is not None, True
            if reattached is None:
                self._cannot_reattach = member_round  # no second LeaseGrant for a group that is over
            else:
                occ = reattached
            now = time.monotonic()
        if outage:
            self._tolerate_until = max(self._tolerate_until, now + self.grace)
        group = Group(node.standing.member_world, lease_ok, self._tolerate_until)
        answer = nodes_waiting(occ, group, s.max_nodes, now)
        if answer > 0 and not occ.closed and occ.active < group.world and self._on_member_lost:
            self._on_member_lost(member_round, occ.active, group.world)
        if outage and answer == 0 and occ.active < group.world:
            log.warning("node %s: %d of the %d members of round %d hold their key after etcd was out "
                        "of reach; the others have %.1f s to re-attach", self._node_id, occ.active,
                        group.world, member_round, self._tolerate_until - now)
        return answer


# --------------------------------------------------------------------------- the handler


class EtcdV3RendezvousHandler(RendezvousHandler):
    """A rendezvous over etcd v3 leases, transactions and watches (``--rdzv-backend=etcd-v3``).

    ``client`` may be shared by several handlers (each keeps its own lease and watch); ``owns_client``:
    close it in :meth:`shutdown`. Thread safety: one ``next_rendezvous`` at a time per handler; the
    other methods may be called from any thread, also while it blocks.
    """

    def __init__(self, settings: V3Settings, client: EtcdClient, *, owns_client: bool = False) -> None:
        self._settings = settings
        self._client = client
        self._owns_client = owns_client
        self._keys = RunKeys.for_run(settings.key_prefix, settings.run_id)
        addr = settings.node_addr.replace("/", "_")
        local_id = next(_local_ids)
        self._node_id = f"{addr}_{os.getpid()}_{local_id}_{uuid.uuid4().hex[:6]}"
        self._rdzv_lock = threading.Lock()
        self._telemetry = Telemetry(settings, self._node_id, local_id)
        self._node = Participant(settings, client, self._keys, self._node_id, observer=self._telemetry)
        metrics.watch_client(client.stats)
        self._group = GroupCheck(settings, client, self._keys, self._node, self._node_id,
                                 on_member_lost=self._telemetry.member_lost)
        self._store: EtcdStore | None = None
        self._closed_run = False  # shutdown() closed the run
        self._etcd_lost = False  # the last etcd call failed for want of etcd (see shutdown())
        # torchrun skips shutdown() on SIGTERM/SIGINT: leave at exit instead.
        self._at_exit = functools.partial(_leave_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)

    # ------------------------------------------------------------------ torch API

    def get_backend(self) -> str:
        """``"etcd-v3"``."""
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        """False: workers bootstrap from ``MASTER_ADDR``/``MASTER_PORT`` published per round."""
        return False

    @property
    def settings(self) -> V3Settings:
        return self._settings

    @property
    def node_id(self) -> str:
        """This handler's node id (the last part of its join keys)."""
        return self._node_id

    @property
    def keys(self) -> RunKeys:
        return self._keys

    def get_run_id(self) -> str:
        return self._settings.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """Block until this node is a member of a sealed round every member confirmed (:meth:`next_round`;
        a round voided before that is re-formed, :mod:`etcd_rdzv.native.start`).

        Returns the round's ``EtcdStore`` (prefix ``rounds/<T>/store/``) and ``bootstrap_store_info``:
        rank 0 publishes ``MASTER_ADDR`` and a free port of its host every round (the one it probed
        when joining if the sealed record names it, else one probed now).
        """
        while True:  # a round some member left before all confirmed it is re-formed without it
            result = self.next_round()
            if self._started(result):
                break
        try:
            store = self._round_store(result.round)
            try:
                master = self._node.standing.round_master
                bootstrap = bootstrap_info(result.rank, store, master, self._settings.node_addr)
            except Exception as e:
                self._etcd_lost = isinstance(e, EtcdConnectionError)
                raise RendezvousConnectionError(
                    f"Round {result.round} of the rendezvous {self._settings.run_id!r} was sealed, "
                    f"but exchanging MASTER_ADDR/MASTER_PORT through its store failed: {e}"
                ) from e
        except RendezvousError as e:
            self._telemetry.failed("next_rendezvous", e)
            raise
        return RendezvousInfo(store, result.rank, result.world_size, bootstrap)

    def _started(self, result: RoundResult) -> bool:
        """:meth:`Participant.start`, errors translated: whether every member confirmed the round."""
        try:
            return self._node.start(result)
        except EtcdError as e:
            raise self._etcd_failed("next_rendezvous", e) from e
        except (NodeError, ProtocolStateError) as e:
            error = torch_error(e, self._settings.run_id)
            self._telemetry.failed("next_rendezvous", error)
            raise error from e

    def next_round(self) -> RoundResult:
        """The barrier of :meth:`next_rendezvous`, without the store (tests, benchmarks).

        Leaves the node's current round and blocks until a round including it is sealed. Raises
        ``RendezvousClosedError`` (run closed), ``RendezvousTimeoutError`` (``join_timeout``),
        ``RendezvousConnectionError`` (etcd unreachable within ``read_timeout``), ``RendezvousStateError``
        (foreign records), ``RendezvousGracefulExitError`` (closed while kept out by a full group).
        """
        with self._rdzv_lock:
            if self._node.shut_down:
                raise RendezvousClosedError(f"the handler of node {self._node_id} was shut down")
            started = self._telemetry.attempt()
            clock = JoinDeadline.start(self._settings.join_timeout, time.monotonic())
            try:
                result = self._barrier(clock)
            except Exception as e:
                self._telemetry.failed("next_rendezvous", e)
                raise
            self._telemetry.completed(result.round, result.rank, result.world_size, started,
                                      self._node.standing.round_master)
            log.info(
                "node %s joined round %d of %r as rank %d of %d",
                self._node_id, result.round, self._settings.run_id, result.rank, result.world_size,
            )
            return result

    def _barrier(self, clock: JoinDeadline) -> RoundResult:
        """:meth:`Participant.rendezvous`, its errors translated to torch's (:func:`torch_error`)."""
        try:
            result = self._node.rendezvous(clock)
        except EtcdError as e:
            shut_down = self._node.shut_down
            if not shut_down:
                self._etcd_lost = isinstance(e, EtcdConnectionError)
            raise torch_error(e, self._settings.run_id, shut_down=shut_down) from e
        except (NodeError, ProtocolStateError) as e:
            raise torch_error(e, self._settings.run_id) from e
        self._etcd_lost = False
        return result

    def _etcd_failed(self, what: str, e: EtcdError) -> RendezvousError:
        """torch's error for a failed etcd call, recorded; notes whether etcd was out of reach (for
        :meth:`shutdown`)."""
        self._etcd_lost = isinstance(e, EtcdConnectionError)
        error = torch_error(e, self._settings.run_id)
        self._telemetry.failed(what, error)
        return error

    def _close_run(self, deadline: float, *, abort: bool = False) -> None:
        """:meth:`Participant.close_run`, its errors translated to torch's (:func:`torch_error`)."""
        try:
            self._node.close_run(deadline, abort=abort)
        except EtcdError as e:
            raise torch_error(e, self._settings.run_id, closing=True) from e

    def is_closed(self) -> bool:
        """Whether the run is closed. One Range (none after :meth:`shutdown`, which closed it)."""
        if self._closed_run:
            return True
        try:
            closed = protocol.is_closed(self._client, self._keys)
        except EtcdError as e:
            raise self._etcd_failed("is_closed", e) from e
        self._etcd_lost = False
        return closed

    def set_closed(self) -> None:
        """Close the run and stop every agent now, as ``etcd-rdzv close`` does (:func:`protocol.abort`).

        One Txn (plus a Range, or a LeaseGrant and a Txn, if the run lease is unknown). Waiting nodes raise
        ``RendezvousClosedError``; every member's :meth:`num_nodes_waiting` turns positive. torchrun never
        calls this (its :meth:`shutdown` closes without stopping running members). Raises
        ``RendezvousTimeoutError`` past ``close_timeout``, ``RendezvousConnectionError`` on other etcd
        failures. A no-op after :meth:`shutdown`.
        """
        if self._node.shut_down:
            return
        try:
            self._close_run(time.monotonic() + self._settings.close_timeout, abort=True)
        except RendezvousError as e:
            self._telemetry.failed("set_closed", e)
            raise
        self._telemetry.closed()

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join the round after ours (one read-only Txn, no key scan).

        At least 1 when the run was aborted or our group lost a member (re-rendezvous now rather than
        after the workers' collective timeout); 0 when the run is closed otherwise or our round is full
        and intact; else the nodes joined in the next round (:func:`~etcd_rdzv.native.barrier.nodes_waiting`).
        After an outage a member re-attaches first (see the module docstring).
        """
        if self._node.shut_down:
            return 0
        try:
            waiting = self._group.nodes_waiting()
        except EtcdError as e:
            raise self._etcd_failed("num_nodes_waiting", e) from e
        except NodeError as e:  # stopped meanwhile, before a re-attach
            raise torch_error(e, self._settings.run_id) from e
        self._etcd_lost = False
        return waiting

    def shutdown(self) -> bool:
        """End this node: close the run on a normal end, else only leave it (:mod:`etcd_rdzv.ending`).

        torchrun calls it in a ``finally``, also when its agent failed. With no exception in flight it
        closes the run (running members keep running: a closed run answers 0), revokes the lease and, as
        the last node, deletes the rounds' stores; False if closing failed (the lease then expires). At
        most about ``close_timeout``.

        With an exception in flight it only leaves (:meth:`leave`), as a SIGTERM'd agent does: one node's
        failure must not end the others' job nor keep a restarted node out (torch's handlers close;
        pytorch/pytorch#67616). After this node lost etcd it also only leaves, within
        :data:`OUTAGE_CLOSE_TIMEOUT`, and returns False: the others may still reach etcd and re-form, and
        waiting on an etcd that just failed only delays the exit.
        """
        if self._node.shut_down:
            return True
        in_flight = exception_in_flight()
        if decide(in_flight, etcd_lost=self._etcd_lost) is Ending.LEAVE:
            return self._leave_on_failure(in_flight)
        atexit.unregister(self._at_exit)
        deadline = time.monotonic() + self._settings.close_timeout
        ok = True
        try:
            self._close_run(deadline)
            self._closed_run = True
            self._telemetry.closed()
        except RendezvousError as e:
            log.warning("node %s could not close the rendezvous %r: %s", self._node_id,
                        self._settings.run_id, e)
            self._telemetry.failed("shutdown", e)
            ok = False
        session = self._node.stop()
        self._close_store()
        if ok:  # etcd answers: release our keys now, and the rounds' records if we are last
            if session is not None:
                session.close(revoke=True, timeout=max(deadline - time.monotonic(), 1.0))
            self._remove_round_records(max(deadline - time.monotonic(), 1.0))
        elif session is not None:  # unreachable: our keys go when the lease expires
            session.close(revoke=False)
        if self._owns_client:
            self._client.close()
        return ok

    def _leave_on_failure(self, in_flight: BaseException | None) -> bool:
        """:meth:`shutdown` for a failed node: leave, never close."""
        if self._etcd_lost:
            log.warning("node %s lost etcd: leaving the rendezvous %r without closing it",
                        self._node_id, self._settings.run_id)
            self.leave(OUTAGE_CLOSE_TIMEOUT)
            return False
        log.warning("node %s ends on %s: leaving the rendezvous %r without closing it", self._node_id,
                    type(in_flight).__name__, self._settings.run_id)
        return self.leave(self._settings.close_timeout)

    def leave(self, timeout: float = LEAVE_TIMEOUT) -> bool:
        """Leave the rendezvous for good WITHOUT closing the run; the handler is done after.

        Registered with ``atexit`` (torchrun skips ``shutdown()`` on SIGTERM/SIGINT, since it would close
        the run): withdraws from the round it waits in and revokes its lease, so its running round sees
        the lost member now, not a TTL later; the last node out removes the rounds' records. At most
        about ``timeout`` (all RPCs); never raises for etcd failures (the lease then expires); returns
        whether the lease was revoked. A no-op (True) after :meth:`shutdown`.
        """
        if self._node.shut_down:
            return True
        atexit.unregister(self._at_exit)
        deadline = time.monotonic() + timeout
        ok = self._node.leave(deadline)
        self._close_store()
        if ok:
            self._remove_round_records(max(deadline - time.monotonic(), 0.1))
        if self._owns_client:
            self._client.close()
        log.info("node %s left the rendezvous %r%s", self._node_id, self._settings.run_id,
                 "" if ok else " (etcd did not answer: its lease will expire)")
        self._telemetry.left(ok)
        return ok

    def _remove_round_records(self, timeout: float) -> None:
        """Last node out removes the rounds' records (one Txn); best effort."""
        try:
            protocol.remove_round_records_if_idle(self._client, self._keys, timeout=timeout)
        except EtcdError as e:
            log.info("could not remove the round records of %r: %s", self._settings.run_id, e)

    # ------------------------------------------------------------------ the store

    def _round_store(self, round_: int) -> EtcdStore:
        """The round's ``EtcdStore`` (:func:`~etcd_rdzv.native.start.round_store`); closes the previous one."""
        self._close_store()
        try:
            store = round_store(self._client, self._keys, round_, self._settings.state_ttl, self._node.run_lease)
        except Exception as e:
            raise RendezvousConnectionError(
                f"cannot open the store of round {round_} of {self._settings.run_id!r}: {e}"
            ) from e
        self._store = store
        return store

    def _close_store(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.close()

    def __repr__(self) -> str:
        return f"EtcdV3RendezvousHandler(run_id={self._settings.run_id!r}, node={self._node_id!r})"


def _leave_at_exit(ref: weakref.ref[EtcdV3RendezvousHandler]) -> None:
    """``atexit`` hook of a handler: :meth:`~EtcdV3RendezvousHandler.leave` unless it was shut down."""
    handler = ref()
    if handler is None:
        return
    try:
        handler.leave()
    except Exception as e:  # never let a failed leave disturb the exit
        log.warning("node %s could not leave at exit: %s", handler.node_id, e)
