"""A seeded, faulty workload on :class:`~etcd_store.EtcdStore`, recorded for the linearizability checker.

:func:`run` starts ``threads`` clients doing random store operations on one namespace and on a
namespace nested in it (small values, values over ``chunk_bytes``, queues, counters, multi-key ops)
against a 3-member :class:`etcd_server.EtcdCluster`, while a fault thread SIGKILLs and restarts
members, freezes them (SIGSTOP/SIGCONT), compacts etcd's history and makes writes lose their reply
(:class:`helpers.lost_replies.LostReplies`: the request commits, the client sees UNAVAILABLE).
Every operation lands in a :class:`helpers.history.History` with the keys the checker's
:class:`~helpers.linearizability.StoreModel` uses: a key of the nested store ``<ns>/sub`` is
recorded as ``sub/<key>``, which is its name in the outer store too (PrefixStore nesting).

Operation choices and the fault schedule come from ``seed`` alone (each thread and the fault thread
have their own ``random.Random``); the interleaving is the machine's.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from etcd_server import EtcdCluster
from etcd_store import EtcdStore
from etcd_store.client import EtcdClient
from helpers.history import History
from helpers.lost_replies import LostReplies, Rule, compact

log = logging.getLogger(__name__)

__all__ = ["Config", "run"]

CHUNK = 1024


@dataclass
class Config:
    """One run: ``ops`` operations in all, spread over ``threads`` clients; faults every ~``fault_every`` s."""

    seed: int
    ops: int
    threads: int = 4
    timeout: float = 5.0  # the writers' store timeout (every RPC deadline)
    read_timeout: float = 1.0  # get/multi_get waits on missing keys
    fault_every: float = 0.6
    faults: bool = True
    lose_rate: float = 0.05  # the share of write Txns (besides the fault thread's) whose reply is lost


@dataclass
class Run:
    """What :func:`run` returns: the history, the stores' timeouts and the late operations."""

    history: History
    config: Config
    wall: float
    late: list[str] = field(default_factory=list)
    lost_replies: int = 0  # requests that committed and whose reply the client never saw
    unsent: int = 0  # requests dropped before reaching etcd


def _timed_out(exc: BaseException) -> bool:
    """A ``get``/``wait`` that ran out of time waiting for a missing key (TCPStore's message)."""
    return isinstance(exc, dist.DistStoreError) and str(exc).startswith("wait timeout")


class _Client:
    """One worker thread: a store on the outer or nested namespace, and its seeded choices."""

    def __init__(self, name: str, store: EtcdStore, reader: EtcdStore, prefix: str, keys: dict[str, list[str]],
                 rng: random.Random, history: History) -> None:
        self.name, self.store, self.reader, self.prefix = name, store, reader, prefix
        self.keys, self.rng, self.history = keys, rng, history
        self.n = 0
        self.last: dict[str, bytes] = {}

    def value(self, key: str) -> bytes:
        self.n += 1
        v = f"{self.name}.{self.n}".encode()
        if key.startswith("big") or self.rng.random() < 0.05:
            v += b"." + bytes(self.rng.randrange(256) for _ in range(8)) * (CHUNK // 8 * 3)
        return v

    def step(self) -> None:
        r, rng = self.rng.random(), self.rng
        reg = rng.choice(self.keys["reg"])
        q = self.keys["queue"][0]
        c = self.keys["counter"][0]
        if r < 0.18:
            v = self.value(reg)
            self._do("set", (reg, v), lambda: self.store.set(self._k(reg), v))
        elif r < 0.32:
            self._do("get", (reg,), lambda: self.reader.get(self._k(reg)), missing=None)
        elif r < 0.42:
            self._do("add", (c, 1), lambda: self.store.add(self._k(c), 1))
        elif r < 0.54:
            expected = rng.choice([self.last.get(reg, b""), b"", b"nope"])
            v = self.value(reg)
            self._do("compare_set", (reg, expected, v), lambda: self.store.compare_set(self._k(reg), expected, v))
        elif r < 0.60:
            self._do("delete_key", (reg,), lambda: self.store.delete_key(self._k(reg)))
        elif r < 0.65:
            self._do("check", ([reg],), lambda: self.store.check([self._k(reg)]))
        elif r < 0.69:
            self._do("wait", ([reg],), lambda: self._wait(reg), missing=False)
        elif r < 0.79:
            v = self.value(q)
            self._do("queue_push", (q, v), lambda: self.store.queue_push(self._k(q), v))
        elif r < 0.89:
            self._do("queue_pop", (q,), lambda: self.store.queue_pop(self._k(q), block=False), missing=None)
        elif r < 0.92:
            v = self.value("log")[:12]
            self._do("append", (reg, v), lambda: self.store.append(self._k(reg), v))
        elif r < 0.96:
            ks = self.keys["multi"]
            vs = [self.value(k) for k in ks]
            self._do("multi_set", (ks, vs), lambda: self.store.multi_set([self._k(k) for k in ks], vs))
        else:
            ks = self.keys["multi"]
            self._do("multi_get", (ks,), lambda: self.reader.multi_get([self._k(k) for k in ks]), missing=None)

    def _wait(self, key: str) -> bool:
        self.reader.wait([self._k(key)], datetime.timedelta(seconds=0.2))
        return True

    def _k(self, key: str) -> str:
        """The store's own name of a recorded key (``sub/x`` is ``x`` in the nested store)."""
        return key[len(self.prefix):] if self.prefix else key

    def _do(self, kind: str, args: tuple[Any, ...], call: Callable[[], Any], missing: Any = "no") -> None:
        try:
            with self.history.op(self.name, kind, *args) as op:
                try:
                    result = call()
                except dist.QueueEmptyError:
                    op.ok(None)
                    return
                except dist.DistStoreError as exc:
                    if missing != "no" and _timed_out(exc):
                        op.ok(missing)
                        return
                    raise
                op.ok(result)
                if kind in ("get", "compare_set") and isinstance(result, bytes):
                    self.last[args[0]] = result
        except Exception as exc:  # an unknown outcome, recorded by the history
            log.debug("%s %s: %r", self.name, kind, exc)


class _Faults:
    """The fault thread: at most one member down or frozen at a time; everything undone by :meth:`heal`."""

    def __init__(self, cluster: EtcdCluster, lost: LostReplies, rng: random.Random, history: History,
                 every: float) -> None:
        self.cluster, self.lost, self.rng, self.history, self.every = cluster, lost, rng, history, every
        self.stop = threading.Event()
        self.frozen: int | None = None
        self.killed: int | None = None
        self.rules: list[Rule] = []
        # every kind of fault once, in a seeded order, before random ones (a short run sees them all)
        self.first = ["kill", "freeze", "compact", "lose"]
        rng.shuffle(self.first)

    def loop(self) -> None:
        while not self.stop.wait(self.rng.uniform(0.5, 1.5) * self.every):
            try:
                self.once()
            except Exception as exc:  # a fault that could not be applied is noted, the run goes on
                self.history.note("fault failed", error=repr(exc))

    def steady(self, rate: float) -> None:
        """Lose the reply of about ``rate`` of all Txns, all along (besides the rules :meth:`once` arms)."""
        rng = random.Random(self.rng.random())
        self.rules.append(self.lost.lose("KV/Txn", lambda request: rng.random() < rate, times=10**9))

    def once(self) -> None:
        self.heal()
        kinds = ["kill", "freeze", "compact", "lose", "lose", "lose-unsent"]
        what = self.first.pop() if self.first else self.rng.choice(kinds)
        i = self.rng.randrange(self.cluster.size)
        if what == "kill":
            self.history.note("kill", member=i)
            self.cluster.stop_member(i)
            self.killed = i
        elif what == "freeze":
            pid = self.cluster.pids[i]
            if pid is not None:
                self.history.note("SIGSTOP", member=i)
                os.kill(pid, signal.SIGSTOP)
                self.frozen = i
        elif what == "compact":
            live = [e for j, e in enumerate(self.cluster.endpoints) if self.cluster.is_running(j)]
            self.history.note("compact", revision=compact(live[0]))
        else:
            times = self.rng.randint(1, 3)
            method = self.rng.choice(["KV/Txn", "KV/"])
            self.history.note(what, method=method, times=times)
            self.rules.append(self.lost.lose(method, times=times, send=what == "lose"))

    def heal(self) -> None:
        if self.frozen is not None:
            pid = self.cluster.pids[self.frozen]
            if pid is not None:
                os.kill(pid, signal.SIGCONT)
            self.history.note("SIGCONT", member=self.frozen)
            self.frozen = None
        if self.killed is not None:
            self.cluster.start_member(self.killed, timeout=60)
            self.history.note("restarted", member=self.killed)
            self.killed = None


def run(cluster: EtcdCluster, config: Config) -> Run:
    """Run the workload of ``config`` on ``cluster``; returns the recorded :class:`Run`.

    Blocks until every worker finished its share of ``config.ops`` (each store call is bounded by
    its timeout; a call later than that is listed in ``Run.late``). Stores, clients and faults are
    undone on return, also on failure.
    """
    history = History()
    lost = LostReplies()
    ns = f"lin/{config.seed}-{uuid.uuid4().hex[:6]}"
    outer_keys = {"reg": ["r0", "r1", "big", "sub"], "queue": ["q"], "counter": ["n"], "multi": ["m0", "m1"]}
    inner_keys = {name: [f"sub/{k}" for k in ks if k != "sub"] for name, ks in outer_keys.items()}
    clients: list[EtcdClient] = []
    stores: list[EtcdStore] = []
    workers: list[_Client] = []
    write_t = datetime.timedelta(seconds=config.timeout)
    read_t = datetime.timedelta(seconds=config.read_timeout)
    faults = _Faults(cluster, lost, random.Random(f"{config.seed}-faults"), history, config.fault_every)
    start = time.monotonic()
    try:
        for t in range(config.threads):
            nested = t % 4 == 3
            client = EtcdClient(cluster.endpoint_string, interceptors=[lost], timeout=config.timeout)
            clients.append(client)
            store = EtcdStore(client, prefix=f"{ns}/sub" if nested else ns, timeout=write_t, chunk_bytes=CHUNK,
                              lease_ttl=60)
            reader = store.clone()
            reader.set_timeout(read_t)
            stores += [store, reader]
            workers.append(_Client(f"c{t}", store, reader, "sub/" if nested else "",
                                   inner_keys if nested else outer_keys, random.Random(f"{config.seed}-{t}"),
                                   history))
        share = [config.ops // config.threads + (t < config.ops % config.threads) for t in range(config.threads)]
        threads = [threading.Thread(target=lambda w=w, k=k: [w.step() for _ in range(k)], daemon=True)
                   for w, k in zip(workers, share, strict=True)]
        fault_thread = threading.Thread(target=faults.loop, daemon=True)
        if config.faults:
            faults.steady(config.lose_rate)
            fault_thread.start()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        faults.stop.set()
        if config.faults:
            fault_thread.join(120)
        faults.heal()
        lost.clear()
        for s in stores:
            s.close()
        for c in clients:
            c.close()
    done = Run(history, config, time.monotonic() - start)
    done.late = _late(history, config)
    done.lost_replies = sum(r.fired for r in faults.rules)
    done.unsent = sum(r.dropped for r in faults.rules)
    return done


def _late(history: History, config: Config, slack: float = 5.0) -> list[str]:
    """Operations that took longer than their store timeout (+ ``slack`` for a loaded machine), or never ended."""
    late = []
    for op in history.ops():
        end = op.completed or op.raised
        bound = config.read_timeout if op.kind in ("get", "multi_get") else config.timeout
        if end is None or (end - op.invoked) / 1e9 > bound + slack:
            late.append(str(op) + ("" if end is None else f" took {(end - op.invoked) / 1e9:.1f} s"))
    return late
