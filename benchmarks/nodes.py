"""The simulated nodes a worker process hosts (one thread each).

Every node has ``rendezvous()`` (the timed action) and ``close()``; a node is
built by :func:`make_node` from a picklable spec sent by the coordinator.

* ``handler``: a rendezvous handler of one contender (c10d, torch's etcd-v2,
  our etcd-v2, our etcd-v3), built the way torchrun builds it.
* ``floor``: the least etcd work a rendezvous can do: one Put of its own key,
  then a watch until N keys exist (every node sees every later join: O(N²)
  events in all).
* ``floor-barrier``: the O(N) barrier: a watch on one ``go`` key (from now),
  then one Txn [count the joined keys, put mine] whose count is the node's
  rank; the N-th node puts ``go``. One watch event per waiting node.
* ``pg``: one rank of ``init_process_group("gloo")`` over a store.

Clients (``spec["clients"]``): ``"node"`` (the default) gives every node its own
``EtcdClient`` (its own gRPC channel and TCP connection), as every host of a real
job has; ``"process"`` has the etcd-v3 handlers and the floors of one worker
process share one client (:class:`SharedClients`: one channel, one keep-alive
stream; every node still has its own lease, watch and transactions), which
models many hosts cheaply: on 2 cores, 1,024 channels cost the harness more than
etcd. Either way every client of this package is connected (one Range) while the
nodes are built, outside the timed phase, as a host's agent is connected before
its rendezvous.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from datetime import timedelta
from typing import Any

from .common import (
    C10D,
    FLOOR,
    FLOOR_BARRIER,
    OURS_ETCD_V2,
    OURS_ETCD_V2_BEFORE,
    OURS_ETCD_V2_FAST,
    OURS_ETCD_V3,
    OURS_STORE,
    TCP_STORE,
    TORCH_ETCD_V2,
    TORCH_V2_STORE,
)

log = logging.getLogger(__name__)

_OURS_BACKEND = {OURS_ETCD_V2: "etcd-v2", OURS_ETCD_V2_BEFORE: "etcd-v2", OURS_ETCD_V2_FAST: "etcd-v2",
                 OURS_ETCD_V3: "etcd-v3"}
#: A key no benchmark writes: the Range that connects a client before the timed phase.
_CONNECT_KEY = b"/bench/connect"


def _undo_issue_29(handler: Any) -> None:
    """Our etcd-v2 handler with issue 29's rules undone, to measure before and after in one run:
    torch's op executor (only the last member's exit ends a sealed round), the heartbeat refreshed
    after torch's keep-alive timer starts (its first tick skipped), member expiry padded by one
    interval (21 s by default)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    handler._op_executor = dr._DistributedRendezvousOpExecutor(
        handler._this_node, handler._state_holder, handler._settings
    )
    handler._state_holder.member_expiry += handler._settings.keep_alive_interval

    def start_heartbeats() -> None:
        dr.DynamicRendezvousHandler._start_heartbeats(handler)
        handler._round_joined = handler._state_holder.state.round
        handler._keep_alive()

    handler._start_heartbeats = start_heartbeats


class SharedClients:
    """The clients that the nodes of one group share within a worker process (``clients="process"``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[Hashable, Any] = {}
        self._takers: dict[Hashable, int] = {}

    def get(self, key: Hashable, factory: Callable[[], Any], per_client: int = 0) -> Any:
        """A client for ``key``, made by ``factory`` (and connected) on first use; with
        ``per_client``, every ``per_client`` callers of one key get a new client."""
        with self._lock:
            taken = self._takers.get(key, 0)
            self._takers[key] = taken + 1
            slot = (key, taken // per_client if per_client > 0 else 0)
            client = self._clients.get(slot)
            if client is None:
                client = self._clients[slot] = factory()
                client.get(_CONNECT_KEY)
            return client

    def owns(self, client: Any) -> bool:
        with self._lock:
            return any(c is client for c in self._clients.values())

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()


def _shared(spec: dict[str, Any], shared: SharedClients | None) -> SharedClients | None:
    return shared if spec.get("clients", "node") == "process" else None


def ours_creator(backend: str) -> tuple[Any, str]:
    """This package's handler creator for ``backend``, and how it was found.

    Prefers torch's registry (what torchrun uses); when the registry does not map
    the name to ``etcd_rdzv`` (for instance torch refused to replace its own
    ``etcd-v2``), loads the ``torchrun.handlers`` entry point exactly as torch's
    registry would. Raises ``LookupError`` when neither exists.
    """
    from importlib.metadata import entry_points

    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as reg

    creator = getattr(reg, "_registry", {}).get(backend)
    if creator is not None and (getattr(creator, "__module__", "") or "").startswith("etcd_rdzv"):
        return creator, "torch registry"
    for ep in entry_points(group="torchrun.handlers"):
        if ep.name == backend and ep.value.startswith("etcd_rdzv"):
            return ep.load()(), f"entry point {ep.value}"
    raise LookupError(f"no etcd_rdzv handler named {backend!r} is installed")


class HandlerNode:
    """One node: a ``RendezvousHandler`` of the contender named in ``spec["contender"]``."""

    def __init__(self, spec: dict[str, Any], node_id: int, shared: SharedClients | None = None) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        contender = spec["contender"]
        self._shared = _shared(spec, shared) if contender == OURS_ETCD_V3 else None
        self.handler: Any
        conf = dict(spec.get("conf", {}))
        if contender == OURS_ETCD_V2_FAST:
            conf["fast_recovery"] = "true"
        backend = {C10D: "c10d", TORCH_ETCD_V2: "etcd-v2"}.get(contender) or _OURS_BACKEND[contender]
        params = RendezvousParameters(
            backend=backend,
            endpoint=spec["endpoint"],
            run_id=spec["run_id"],
            min_nodes=spec["min_nodes"],
            max_nodes=spec["max_nodes"],
            local_addr=spec.get("local_addr", "127.0.0.1"),
            **conf,
        )
        if contender == C10D:
            from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
            from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

            c10d_backend, store = c10d_rendezvous_backend.create_backend(params)
            self.handler = create_handler(store, c10d_backend, params)
        elif contender == TORCH_ETCD_V2:
            # torch's own creator functions: our package's entry point takes the
            # "etcd-v2" name in the registry.
            from torch.distributed.elastic.rendezvous import etcd_rendezvous_backend
            from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

            backend_obj, store = etcd_rendezvous_backend.create_backend(params)
            self.handler = create_handler(store, backend_obj, params)
        elif self._shared is not None:
            from etcd_rdzv.conf import parse_v3_settings
            from etcd_store.client import EtcdClient

            creator, _how = ours_creator(backend)
            _, options = parse_v3_settings(params)
            client = self._shared.get(("etcd-v3", spec["endpoint"]), lambda: EtcdClient.from_options(options),  # one conf per group
                                      int(spec.get("nodes_per_client", 0)))
            self.handler = creator(params, client=client)
        else:
            creator, _how = ours_creator(backend)
            self.handler = creator(params)
            if contender == OURS_ETCD_V2_BEFORE:
                _undo_issue_29(self.handler)
        self.node_id = node_id

    def rendezvous(self) -> tuple[int, int]:
        info: Any = self.handler.next_rendezvous()
        if isinstance(info, tuple):  # torch < 2.4 returned (store, rank, world_size)
            return int(info[1]), int(info[2])
        return int(info.rank), int(info.world_size)

    def num_nodes_waiting(self) -> int:
        return int(self.handler.num_nodes_waiting())

    def close(self) -> None:
        try:
            self.handler.shutdown()
        finally:
            for attr in ("_backend", "backend"):
                client = getattr(getattr(self.handler, attr, None), "_client", None)
                if self._shared is not None and self._shared.owns(client):
                    continue
                close = getattr(client, "close", None)
                if callable(close):
                    try:
                        close()
                    except Exception:
                        pass


def _floor_client(spec: dict[str, Any], shared: SharedClients | None) -> tuple[Any, bool]:
    """A floor node's client (shared or its own) and whether the node owns it."""
    from etcd_store.client import EtcdClient

    timeout = float(spec.get("timeout", 60.0))
    pool = _shared(spec, shared)
    if pool is not None:
        return pool.get(("floor", spec["endpoint"], timeout), lambda: EtcdClient(spec["endpoint"], timeout=timeout),
                        int(spec.get("nodes_per_client", 0))), False
    return EtcdClient(spec["endpoint"], timeout=timeout), True


class FloorNode:
    """The floor: one Put of this node's key, then a watch until ``n`` keys exist."""

    def __init__(self, spec: dict[str, Any], node_id: int, shared: SharedClients | None = None) -> None:
        self.client, self._owns_client = _floor_client(spec, shared)
        self.prefix = spec["prefix"].encode()
        self.key = self.prefix + f"{node_id:06d}".encode()
        self.n = int(spec["n"])
        self.timeout = float(spec.get("timeout", 60.0))

    def rendezvous(self) -> tuple[int, int]:
        deadline = time.monotonic() + self.timeout
        self.client.put(self.key, b"127.0.0.1")
        res = self.client.range(self.prefix, prefix=True, keys_only=True)
        seen = {kv.key for kv in res.kvs}
        if len(seen) < self.n:
            with self.client.watch(self.prefix, prefix=True, start_revision=res.revision + 1) as w:
                while len(seen) < self.n:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"floor: {len(seen)} of {self.n} keys after {self.timeout:g} s")
                    for ev in w.get(timeout=left):
                        if ev.type == "PUT":
                            seen.add(ev.key)
        return sorted(seen).index(self.key), len(seen)

    def close(self) -> None:
        if self._owns_client:
            self.client.close()


class FloorBarrierNode:
    """The O(N) barrier floor: watch ``go`` from now, one Txn [count the joined keys, put mine]
    (its count is the rank; a ``count_only`` range ignores revision filters, so the count is
    taken in the same Txn, before the put); the node whose count is ``n - 1`` puts ``go``."""

    def __init__(self, spec: dict[str, Any], node_id: int, shared: SharedClients | None = None) -> None:
        self.client, self._owns_client = _floor_client(spec, shared)
        prefix = spec["prefix"].encode()
        self.joined = prefix + b"joined/"
        self.key = self.joined + f"{node_id:06d}".encode()
        self.go_key = prefix + b"go"
        self.n = int(spec["n"])
        self.timeout = float(spec.get("timeout", 60.0))

    def rendezvous(self) -> tuple[int, int]:
        from etcd_store.client import op_get, op_put
        from etcd_store.client.synced import SyncedWatch

        deadline = time.monotonic() + self.timeout
        # Confirmed before the Txn (or WatchNotConfirmed, a TimeoutError, or the watch's error):
        # the watch covers every revision after the Txn, so no event is skipped.
        with SyncedWatch.open(self.client, self.go_key, None, 0, self.timeout,
                              f"floor-barrier: the watch on {self.go_key!r}") as w:
            res = self.client.txn([], [op_get(self.joined, prefix=True, count_only=True),
                                       op_put(self.key, b"127.0.0.1")])
            rank = res.responses[0].count  # type: ignore[union-attr]
            if rank == self.n - 1:
                self.client.put(self.go_key, b"go")
                return rank, self.n
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"floor-barrier: no go after {self.timeout:g} s (rank {rank})")
                if any(ev.type == "PUT" for ev in w.get(timeout=left)):
                    return rank, self.n

    def close(self) -> None:
        if self._owns_client:
            self.client.close()


class PgNode:
    """One rank of ``init_process_group("gloo")`` over a store; one per worker process."""

    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        import torch.distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.rank = rank
        self.world_size = int(spec["world_size"])
        self.timeout = timedelta(seconds=float(spec.get("timeout", 60.0)))
        kind = spec["store"]
        self._closers: list[Any] = []
        if kind == OURS_STORE:
            from etcd_store.store import EtcdStore

            store = EtcdStore(spec["endpoint"], prefix=spec["prefix"], timeout=self.timeout)
            self._closers.append(getattr(store, "close", None))
            self.store: Any = store
        elif kind == TCP_STORE:
            host, port = spec["endpoint"].rsplit(":", 1)
            base = dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout)
            self.store = dist.PrefixStore(spec["prefix"], base)
        elif kind == TORCH_V2_STORE:
            import etcd
            from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore as TorchEtcdStore

            host, port = spec["endpoint"].rsplit(":", 1)
            self.store = TorchEtcdStore(etcd.Client(host=host, port=int(port)), spec["prefix"], self.timeout)
        else:
            raise ValueError(f"unknown store {kind!r}")

    def rendezvous(self) -> int:
        import torch.distributed as dist

        dist.init_process_group("gloo", store=self.store, rank=self.rank, world_size=self.world_size,
                                timeout=self.timeout)
        return self.rank

    def check(self) -> float:
        """An all-reduce of ones: returns the world size when the group works."""
        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t.item())

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        for close in self._closers:
            if callable(close):
                close()


def make_node(kind: str, spec: dict[str, Any], node_id: int, shared: SharedClients | None = None) -> Any:
    """A node of ``kind``; ``shared`` holds the clients its process shares (``spec["clients"]``).

    Every client of this package the node holds is connected here (one Range)."""
    node: Any
    if kind == "handler":
        node = HandlerNode(spec, node_id, shared)
    elif kind == FLOOR:
        node = FloorNode(spec, node_id, shared)
    elif kind == FLOOR_BARRIER:
        node = FloorBarrierNode(spec, node_id, shared)
    elif kind == "pg":
        return PgNode(spec, node_id)
    else:
        raise ValueError(f"unknown node kind {kind!r}")
    from etcd_store.client.testing import count_watches

    for client in _clients(node):
        count_watches(client)  # its watches count into the node's WatchStats (see workers.create)
        if shared is None or not shared.owns(client):
            client.get(_CONNECT_KEY)
    return node


def _clients(obj: Any, depth: int = 4) -> list[Any]:
    """This package's ``EtcdClient`` objects reachable from ``obj`` through attributes
    (``depth`` levels: node, handler, state holder, backend, client)."""
    from etcd_store.client import EtcdClient

    found: dict[int, Any] = {}
    seen: set[int] = set()

    def walk(o: Any, d: int) -> None:
        if id(o) in seen:
            return
        seen.add(id(o))
        if isinstance(o, EtcdClient):
            found[id(o)] = o
            return
        if d == 0:
            return
        for v in list(getattr(o, "__dict__", {}).values()):
            if v is not None and not isinstance(v, (str, bytes, int, float, bool, list, dict, tuple)):
                walk(v, d - 1)

    walk(obj, depth)
    return list(found.values())


def watch_counts(node: Any, stats: Any) -> tuple[int, int] | None:
    """``(events, bytes)`` delivered so far to the watches ``node``'s threads created (``stats``:
    the node's :class:`~etcd_store.client.testing.WatchStats`, see ``counting_watches`` and
    ``count_watches``, subscribed in :func:`make_node`);
    None when the node holds none of this package's clients (c10d, torch's etcd-v2)."""
    if not _clients(node):
        return None
    return tuple(stats.snapshot())  # type: ignore[return-value]
