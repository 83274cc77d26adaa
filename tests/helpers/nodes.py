"""The one in-process node harness of the integration tests: handlers of one run, their blocking calls
in threads, every one shut down at the end (also when the test failed).

``Nodes(endpoint, backend)`` makes handlers of one run id under a fresh key prefix, through the same
creators torchrun's registry calls (``etcd-v3``, ``etcd-v2``), or torch's own ``c10d`` handler over a
TCPStore the harness starts (for side-by-side tests). A test's settings are ``conf`` (the backend's
rdzv-conf keys); ``shared=True`` makes every etcd-v3 handler use the harness's one client (as the
benchmarks' processes do), else each handler has its own client (as real agents have).
``tapped(...)`` makes an etcd-v3 handler whose client is a :class:`~etcd_store.client.testing.WatchTap`:
the test sees the events that node's watches deliver, or makes it deaf (``keep``), from outside the node.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousParameters

from etcd_store.client import EtcdClient, Event
from etcd_store.client.testing import WatchTap

from .handlers import shut_down_all

_ids = itertools.count()
WAIT = 30.0  # generous bound for what should happen within a few seconds

ETCD_V3 = "etcd-v3"
ETCD_V2 = "etcd-v2"
C10D = "c10d"


class Nodes:
    """Handlers of one run of ``backend`` (``etcd-v3``, ``etcd-v2`` or torch's ``c10d``), run in threads.

    ``conf`` holds the run's rdzv-conf (the tests' fast settings); ``new(..., **conf)`` overrides it for
    one handler. ``client`` is an :class:`EtcdClient` on the run's etcd for the test's own reads.
    """

    def __init__(self, endpoint: str, backend: str = ETCD_V3, *, conf: dict[str, str] | None = None,
                 shared: bool = False, name: str = "run", workers: int = 8) -> None:
        self.endpoint, self.backend, self.shared = endpoint, backend, shared
        self.conf = dict(conf or {})
        self.run_id = f"{name}-{next(_ids)}"
        self.prefix = f"/{name}{next(_ids)}-{time.monotonic_ns() % 10**9}"
        self.handlers: list[Any] = []
        self.pool = ThreadPoolExecutor(max_workers=workers)
        self.client = EtcdClient(endpoint, timeout=10)
        self.own_clients: list[EtcdClient] = []  # made for tapped handlers (shared=False); closed last
        self.tcp_store: Any = None
        if backend == C10D:
            self._start_tcp_store()

    def _start_tcp_store(self) -> None:
        import torch.distributed as dist
        from torch.distributed.elastic.utils.distributed import get_free_port

        self.tcp_store = dist.TCPStore("127.0.0.1", get_free_port(), is_master=True,
                                       wait_for_workers=False, timeout=timedelta(seconds=30))

    def params(self, min_nodes: int, max_nodes: int, **conf: str) -> RendezvousParameters:
        endpoint = f"127.0.0.1:{self.tcp_store.port}" if self.backend == C10D else self.endpoint
        merged: dict[str, Any] = {**self.conf, **conf}
        if self.backend != C10D:
            merged.setdefault("key_prefix", self.prefix)
        return RendezvousParameters(backend=self.backend, endpoint=endpoint, run_id=self.run_id,
                                    min_nodes=min_nodes, max_nodes=max_nodes, local_addr="127.0.0.1",
                                    **merged)

    def new(self, min_nodes: int, max_nodes: int, **conf: str) -> Any:
        """A new handler of the run (``--nnodes=min_nodes:max_nodes``); no RPC until it is used."""
        params = self.params(min_nodes, max_nodes, **conf)
        handler: RendezvousHandler
        if self.backend == ETCD_V3:
            from etcd_rdzv.plugin import create_etcd_v3_rdzv_handler

            handler = create_etcd_v3_rdzv_handler(params, client=self.client if self.shared else None)
        elif self.backend == ETCD_V2:
            from etcd_rdzv.plugin import create_etcd_v2_rdzv_handler

            handler = create_etcd_v2_rdzv_handler(params)
        else:
            handler = self._new_c10d(params)
        self.handlers.append(handler)
        return handler

    def tapped(self, min_nodes: int, max_nodes: int, *, keep: Callable[[Event], bool] = lambda ev: True,
               **conf: str) -> tuple[Any, WatchTap]:
        """A new etcd-v3 handler whose client (the harness's one when ``shared``, else its own, made from
        its rdzv-conf as the creator would) is wrapped in a :class:`WatchTap` (``keep``: the events its
        watches hand on); the handler and the tap."""
        from etcd_rdzv.conf import parse_v3_settings
        from etcd_rdzv.plugin import create_etcd_v3_rdzv_handler

        assert self.backend == ETCD_V3, "only etcd-v3 handlers take a client"
        params = self.params(min_nodes, max_nodes, **conf)
        if self.shared:
            client = self.client
        else:
            client = EtcdClient.from_options(parse_v3_settings(params)[1])
            self.own_clients.append(client)
        tap = WatchTap(client, keep)
        handler = create_etcd_v3_rdzv_handler(params, client=tap)
        self.handlers.append(handler)
        return handler, tap

    def intercepted(self, min_nodes: int, max_nodes: int, *interceptors: Any, **conf: str) -> Any:
        """A new etcd-v3 handler with a client of its own, made from its rdzv-conf as the creator would,
        whose unary RPCs pass through ``interceptors`` (an ``RpcCounter``, a ``LostReplies``): the test
        counts what that node asks etcd, or acts just before one of its requests. Closed by :meth:`close`."""
        from etcd_rdzv.conf import parse_v3_settings
        from etcd_rdzv.plugin import create_etcd_v3_rdzv_handler

        assert self.backend == ETCD_V3, "only etcd-v3 handlers take a client"
        params = self.params(min_nodes, max_nodes, **conf)
        client = EtcdClient.from_options(parse_v3_settings(params)[1], interceptors=interceptors)
        self.own_clients.append(client)
        handler = create_etcd_v3_rdzv_handler(params, client=client)
        self.handlers.append(handler)
        return handler

    def _new_c10d(self, params: RendezvousParameters) -> RendezvousHandler:
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        # One TCPStore client per node, as each torchrun agent has (one client object is not safe for
        # two nodes' blocking calls at once).
        store = dist.TCPStore("127.0.0.1", self.tcp_store.port, is_master=False, timeout=timedelta(seconds=30))
        return create_handler(store, C10dRendezvousBackend(store, self.run_id), params)

    def many(self, n: int, min_nodes: int, max_nodes: int, **conf: str) -> list[Any]:
        return [self.new(min_nodes, max_nodes, **conf) for _ in range(n)]

    def join(self, *handlers: Any) -> list[Future[RendezvousInfo]]:
        """``next_rendezvous()`` of each handler, in the pool's threads."""
        return [self.pool.submit(h.next_rendezvous) for h in handlers]

    def start(self, *handlers: Any) -> list[Future[Any]]:
        """etcd-v3's ``next_round()`` (the barrier without the store) of each handler, in threads."""
        return [self.pool.submit(h.next_round) for h in handlers]

    def group(self, n: int) -> list[Any]:
        """``n`` handlers (``--nnodes=n``) that formed one round (ranks checked)."""
        hs = self.many(n, n, n)
        infos = results(self.join(*hs))
        assert sorted(i.rank for i in infos) == list(range(n))
        return hs

    @property
    def keys(self) -> Any:
        """The etcd-v3 run's key layout."""
        from etcd_rdzv.native.records import RunKeys

        return RunKeys.for_run(self.prefix, self.run_id)

    def join_prefix(self, round_: int) -> bytes:
        return bytes(self.keys.join_prefix(round_))

    def joined(self, round_: int) -> int:
        """How many join keys etcd-v3's round ``round_`` has (one count-only Range)."""
        return self.client.range(self.join_prefix(round_), prefix=True, count_only=True).count

    def until_joined(self, round_: int, count: int, timeout: float = 20.0) -> None:
        """Return once round ``round_`` holds at least ``count`` join keys (polls :meth:`joined`)."""
        deadline = time.monotonic() + timeout
        while self.joined(round_) < count:
            assert time.monotonic() < deadline, f"round {round_} never had {count} joiners"
            time.sleep(0.05)

    def members(self, round_: int) -> list[str]:
        kv = self.client.get(self.keys.members(round_))
        assert kv is not None, f"round {round_} has no members record"
        return list(json.loads(kv.value))

    def close(self) -> None:
        if self.backend == ETCD_V2:
            for h in self.handlers:
                h._stop_heartbeats()
        shut_down_all(self.handlers, self.pool)
        for client in self.own_clients:
            client.close()
        self.client.close()


def lease_of(handler: Any) -> int:
    """The lease id of an etcd-v3 handler's node (it must have joined)."""
    session = handler._node.session
    assert session is not None
    return int(session.id)


def until_silent(client: EtcdClient, lease: int, seconds: int, timeout: float = 15.0) -> None:
    """Return once etcd's leader reports ``lease`` unrenewed for at least ``seconds`` (``silent_for``: granted
    TTL - remaining - 1, whole seconds): a look from then on condemns a member of that lease. Polls etcd's
    own count (a deadline, no guessed sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        remaining, granted = client.lease_ttls(lease)
        assert remaining >= 0, f"lease {lease:x} expired"
        if granted - remaining - 1 >= seconds:
            return
        assert time.monotonic() < deadline, f"lease {lease:x} never {seconds} s silent"
        time.sleep(0.05)


def results(futures: Sequence[Future[Any]], timeout: float = WAIT) -> list[Any]:
    return [f.result(timeout=timeout) for f in futures]


@contextmanager
def nodes_of(endpoint: str, backend: str = ETCD_V3, **kwargs: Any) -> Iterator[Nodes]:
    """A :class:`Nodes` closed at the end of the block, also when it raised."""
    n = Nodes(endpoint, backend, **kwargs)
    try:
        yield n
    finally:
        n.close()
