"""The world of the etcd-v3 interleaving checker (tests/helpers/v3_checker.py): the etcd it runs against
(one member or a 3-member cluster, with its faults) and the in-process nodes (real ``etcd-v3`` handlers,
each with its own ``EtcdClient``).

Nothing here decides what is correct; the checker's model does. A node's blocking ``next_rendezvous``
runs in a thread of its own and is recorded in the shared :class:`~helpers.history.History`.

Every node reaches etcd through proxies of its own (a :class:`~helpers.cut_proxy.CutProxy` per etcd
member), so that one node can stall alone (:meth:`Node.stall`: nothing it sends reaches etcd, nothing
etcd sends reaches it, as when its host freezes or its link partitions) while the others run: the
in-process nodes share one process and one gRPC reactor, so no node can be paused from inside.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters

from etcd_rdzv.native.handler import EtcdV3RendezvousHandler, RoundResult
from etcd_rdzv.plugin import create_etcd_v3_rdzv_handler
from etcd_server import EtcdCluster, EtcdServer

from .cut_proxy import CutProxy
from .history import History, Op
from .lost_replies import compact

log = logging.getLogger(__name__)

_generations = itertools.count()


class Etcd:
    """The etcd under test: one :class:`EtcdServer` or an :class:`EtcdCluster` (not owned: the test
    starts and stops it). Faults leave it serving again before they return (``thaw``/``restart``)."""

    def __init__(self, target: EtcdServer | EtcdCluster) -> None:
        self.target = target
        self.cluster = isinstance(target, EtcdCluster)
        self.endpoint = target.endpoint_string if isinstance(target, EtcdCluster) else target.get_endpoint()
        self.down: set[int] = set()  # cluster members killed and not started again
        self.frozen: set[int] = set()  # cluster members stopped with SIGSTOP

    @property
    def size(self) -> int:
        return self.target.size if isinstance(self.target, EtcdCluster) else 1

    def pids(self) -> list[int]:
        if isinstance(self.target, EtcdCluster):
            return [p for p in self.target.pids if p is not None]
        return [self.target.pid] if self.target.pid is not None else []

    def freeze_all(self, seconds: float) -> None:
        """Every member answers nothing for ``seconds`` (SIGSTOP), then resumes: leases age meanwhile."""
        pids = self.pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)  # the fault's duration, not a synchronisation
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)

    def freeze_member(self, i: int) -> None:
        assert isinstance(self.target, EtcdCluster)
        pid = self.target.pids[i]
        if pid is not None:
            os.kill(pid, signal.SIGSTOP)
            self.frozen.add(i)

    def thaw_member(self, i: int) -> None:
        assert isinstance(self.target, EtcdCluster)
        pid = self.target.pids[i]
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        self.frozen.discard(i)

    def kill_member(self, i: int) -> None:
        assert isinstance(self.target, EtcdCluster)
        self.target.stop_member(i)
        self.down.add(i)

    def start_member(self, i: int) -> None:
        assert isinstance(self.target, EtcdCluster)
        self.target.start_member(i, timeout=60)
        self.down.discard(i)

    def restart(self) -> None:
        """Stop etcd (SIGKILL: a crash) and start it again on the same data (single member only)."""
        assert isinstance(self.target, EtcdServer)
        self.target.restart(timeout=60, graceful=False)

    def compact(self) -> int:
        """Compact at the current revision, through a member that is up; returns the revision."""
        endpoints = self.endpoint.split(",")
        up = [e for i, e in enumerate(endpoints) if i not in self.down and i not in self.frozen]
        return compact(up[0])

    def heal(self) -> None:
        """Every member up and unfrozen (the end of a test, or of an episode)."""
        for i in sorted(self.frozen):
            self.thaw_member(i)
        for i in sorted(self.down):
            self.start_member(i)


@dataclass
class Node:
    """One in-process agent: a real handler with its own client, and its current blocking call."""

    name: str
    handler: EtcdV3RendezvousHandler
    status: str = "new"  # new | waiting | member | failed | left | killed | shut
    op: Op | None = None  # the pending or last next_rendezvous
    thread: threading.Thread | None = None
    started: float = 0.0  # monotonic start of the pending/last next_rendezvous
    result: tuple[Any, ...] | None = None  # (round, rank, world, seal revision, master addr, master port)
    error: BaseException | None = None
    lease_lost_at: float | None = None  # the checker revoked its lease while it lived
    history: list[str] = field(default_factory=list)
    proxies: list[CutProxy] = field(default_factory=list)  # its own path to each etcd member
    barrier: str = ""  # torch's rank barrier after its last round: "" (not run), "ok", or its error
    returned: float = 0.0  # monotonic: when its last next_rendezvous returned or raised (before the barrier)

    @property
    def alive(self) -> bool:
        return self.status not in ("left", "killed", "shut")

    @property
    def round(self) -> int | None:
        return self.result[0] if self.status == "member" and self.result is not None else None

    @property
    def client(self) -> Any:
        return self.handler._client

    def session_id(self) -> int | None:
        session = self.handler._node.session
        return None if session is None else session.id

    def stall(self, seconds: float) -> None:
        """Nothing passes between this node and etcd for ``seconds`` (its proxies block: requests and
        renewals wait, as in the kernel's buffers during a partition), then everything held goes on."""
        for proxy in self.proxies:
            proxy.block()
        try:
            time.sleep(seconds)  # the fault's duration, not a synchronisation
        finally:
            for proxy in self.proxies:
                proxy.unblock()

    def close_proxies(self) -> None:
        for proxy in self.proxies:
            proxy.close()


@dataclass(frozen=True)
class NodeConf:
    """The short settings of the checker's nodes (seconds; ``heartbeat`` is the lease TTL)."""

    min_nodes: int = 2
    max_nodes: int = 3
    heartbeat: int = 2
    join_timeout: float = 5.0
    last_call_timeout: float = 0.3
    close_timeout: float = 3.0
    read_timeout: float = 4.0
    fast_recovery: bool = True

    @classmethod
    def drawn(cls, rng: random.Random) -> NodeConf:
        """Group bounds, last call and fast recovery drawn by a seed (the timeouts stay short), and
        one seed in four with a lease of 6 s, long enough that eviction (4 s of silence) comes before
        a stalled node's lease ends (``read_timeout`` 8 s: an outage outlasts the lease, not a read)."""
        min_nodes = rng.choice((1, 2, 2, 3))
        conf = cls(min_nodes=min_nodes, max_nodes=min_nodes + rng.choice((0, 1, 1, 2)),
                   last_call_timeout=rng.choice((0.2, 0.3, 0.8)), fast_recovery=rng.random() < 0.75)
        if rng.random() < 0.25:
            conf = dataclasses.replace(conf, heartbeat=6, read_timeout=8.0)
        return conf


def new_node(etcd: Etcd, conf: NodeConf, run_id: str, prefix: str, slot: int) -> Node:
    """A node with its own handler, its own client, and its own proxy to each etcd member (closed by
    :meth:`Node.close_proxies`, also if the handler cannot be made)."""
    proxies: list[CutProxy] = []
    try:
        for endpoint in etcd.endpoint.split(","):
            host, _, port = endpoint.rpartition(":")
            proxies.append(CutProxy((host, int(port))))
        return _node(etcd, conf, run_id, prefix, slot, proxies)
    except BaseException:
        for proxy in proxies:
            proxy.close()
        raise


def _node(etcd: Etcd, conf: NodeConf, run_id: str, prefix: str, slot: int, proxies: list[CutProxy]) -> Node:
    params = RendezvousParameters(
        backend="etcd-v3", endpoint=",".join(p.endpoint for p in proxies), run_id=run_id, min_nodes=conf.min_nodes,
        max_nodes=conf.max_nodes, local_addr="127.0.0.1", key_prefix=prefix,
        join_timeout=str(conf.join_timeout), last_call_timeout=str(conf.last_call_timeout),
        close_timeout=str(conf.close_timeout), heartbeat=str(conf.heartbeat), read_timeout=str(conf.read_timeout),
        fast_recovery=str(conf.fast_recovery).lower(),
    )
    handler = create_etcd_v3_rdzv_handler(params)  # its own client: a node can be killed alone
    return Node(f"n{slot}.{next(_generations)}", handler, proxies=proxies)


def start_rendezvous(node: Node, history: History, done: Callable[[Node], None]) -> None:
    """``next_rendezvous`` in a thread, recorded; ``done(node)`` runs when it returns or raises."""
    node.status, node.result, node.error, node.barrier = "waiting", None, None, ""
    node.started = time.monotonic()
    ready = threading.Event()

    rounds: list[RoundResult] = []  # what next_rendezvous's own next_round returned
    handler = node.handler

    def next_round() -> RoundResult:
        rounds.append(EtcdV3RendezvousHandler.next_round(handler))
        return rounds[-1]

    handler.next_round = next_round  # type: ignore[method-assign]  # the harness listens (next_rendezvous calls it)

    def body() -> None:
        try:
            with history.op(node.name, "next_rendezvous") as op:
                node.op = op
                ready.set()
                info = node.handler.next_rendezvous()
                last = rounds[-1]  # read after the return, the node's state may already be another's
                bs = info.bootstrap_store_info
                result = (last.round, info.rank, info.world_size, last.seal_revision,
                          None if bs is None else bs.master_addr, None if bs is None else bs.master_port)
                op.ok(result)
                node.result = result
            node.returned = time.monotonic()
            rank_barrier(node, info, history)
        except BaseException as e:  # recorded in the op (unknown outcome)
            node.error = e
            node.returned = time.monotonic()
        finally:
            ready.set()
            done(node)

    node.thread = threading.Thread(target=body, name=f"rdzv-{node.name}", daemon=True)
    node.thread.start()
    ready.wait(5.0)


def rank_barrier(node: Node, info: Any, history: History) -> None:
    """What torch's agent does first with a round: its own ``SimpleElasticAgent._assign_worker_ranks``
    on the round's store, a barrier over every rank of the round (rank 0 reads every member's role
    info, the others wait for their assigned ranks; each wait bounded by the store's timeout).
    ``node.barrier`` is "ok" or the error it raised (the agent would exit on it)."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    spec = _BarrierSpec()
    with history.op(node.name, "rank barrier") as op:
        try:
            SimpleElasticAgent._assign_worker_ranks(None, info.store, info.rank, info.world_size, spec)  # type: ignore[arg-type]
        except Exception as e:
            node.barrier = repr(e)
            op.fail(e)
        else:
            node.barrier = "ok"
            op.ok("ok")


@dataclass(frozen=True)
class _BarrierSpec:
    """The two fields of torch's ``WorkerSpec`` that its rank barrier reads (one worker per node)."""

    role: str = "default"
    local_world_size: int = 1


def kill(node: Node, *, revoke_with: Any | None = None) -> None:
    """The node dies without a word: its client is closed (keep-alives stop, no revoke); with
    ``revoke_with`` (another client) its lease is revoked first (etcd notices at once)."""
    atexit.unregister(node.handler._at_exit)
    lease = node.session_id()
    if revoke_with is not None and lease is not None:
        try:
            revoke_with.lease_revoke(lease)
        except Exception as e:  # etcd may be faulty: the lease then expires
            log.info("could not revoke %s's lease: %s", node.name, e)
    node.status = "killed"
    node.client.close()
    node.close_proxies()
