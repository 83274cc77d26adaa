"""B1's waits with other ranks at work: a blocked ``get`` woken by another rank's write while a
third rank keeps writing, and torch's 4-way ``store_util.barrier``.

* ``wake_busy``: rank A blocks in ``get(key)``; rank B sets ``key`` 10 ms later while rank C
  writes another key of the namespace back to back. The figure is the time from B's ``set``
  returning to A's ``get`` returning (0 when A woke first: the watch event can beat the Put's
  answer), i.e. how late a waiter hears a write on a namespace that is busy.
* ``barrier_4``: four ranks (threads, each with its own store and client) call
  ``torch.distributed.elastic.utils.store.barrier(store, 4, prefix)`` on a fresh prefix at
  the same moment; the figure is the time until the timed rank returns (the barrier returns
  once the fourth rank checked in).

Only stores that torch's ``barrier`` accepts (EtcdStore, TCPStore) take part; the others are
reported as not implementing these operations. The stores of the extra ranks are built by
:func:`make_ranks`, untimed.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .common import OURS_STORE, TCP_STORE, EtcdFarm

WAIT_OPS = ["wake_busy", "barrier_4"]
WAIT_LABELS = {
    "wake_busy": "get woken by a write (another rank writing)",
    "barrier_4": "store_util.barrier of 4 ranks",
}
SUPPORTED = (OURS_STORE, TCP_STORE)
_LATE = 0.010


class Latency(float):
    """A figure an operation measured itself (instead of the time around the call)."""


class Ranks:
    """The other ranks of one contender: ``stores`` (three, one client each) and their threads."""

    def __init__(self, stores: list[Any], closers: list[Callable[[], Any]]) -> None:
        self.stores = stores
        self.closers = closers
        self.errors: list[str] = []
        self._jobs: list[queue.SimpleQueue[Callable[[Any], Any] | None]] = []
        self._threads: list[threading.Thread] = []
        for store in stores:
            jobs: queue.SimpleQueue[Callable[[Any], Any] | None] = queue.SimpleQueue()
            t = threading.Thread(target=self._run, args=(store, jobs), daemon=True, name="b1-rank")
            t.start()
            self._jobs.append(jobs)
            self._threads.append(t)
        self._noise_stop = threading.Event()
        self._noise: threading.Thread | None = None

    def _run(self, store: Any, jobs: queue.SimpleQueue[Callable[[Any], Any] | None]) -> None:
        while (job := jobs.get()) is not None:
            try:
                job(store)
            except Exception as e:
                self.errors.append(f"{type(e).__name__}: {e}")

    def each(self, job: Callable[[Any], Any], ranks: int | None = None) -> None:
        """Run ``job(store)`` on the first ``ranks`` other ranks (all by default), without waiting."""
        for jobs in self._jobs[: ranks if ranks is not None else len(self._jobs)]:
            jobs.put(job)

    def start_noise(self) -> None:
        """The last rank writes one key of the namespace back to back until :meth:`stop_noise`."""
        store = self.stores[-1]

        def run() -> None:
            while not self._noise_stop.is_set():
                store.set("busy/noise", b"n")

        self._noise_stop.clear()
        self._noise = threading.Thread(target=run, daemon=True, name="b1-noise")
        self._noise.start()

    def stop_noise(self) -> None:
        self._noise_stop.set()
        if self._noise is not None:
            self._noise.join(10)
            self._noise = None

    def close(self) -> None:
        self.stop_noise()
        for jobs in self._jobs:
            jobs.put(None)
        for t in self._threads:
            t.join(5)
        for c in self.closers:
            try:
                c()
            except Exception:
                pass


def make_ranks(name: str, farm: EtcdFarm, tcp_endpoint: str, timeout: float) -> Ranks | None:
    """Three more ranks for contender ``name`` on the namespace of its ``waiter`` store (the
    timed rank, see :mod:`benchmarks.b1_store`); None when it does not take part."""
    td = timedelta(seconds=timeout)
    if name == OURS_STORE:
        from etcd_store.store import EtcdStore

        ep = farm.get(name).get_endpoint()
        stores = [EtcdStore(ep, prefix="/bench/b1late-ours", timeout=td) for _ in range(3)]
        return Ranks(stores, [s.close for s in stores])
    if name == TCP_STORE:
        import torch.distributed as dist

        host, port = tcp_endpoint.rsplit(":", 1)
        stores = [dist.PrefixStore("b1late", dist.TCPStore(host, int(port), is_master=False, timeout=td))
                  for _ in range(3)]
        return Ranks(stores, [])
    return None


def wait_fn(op: str, store: Any, ranks: Ranks, rep: int) -> Callable[[int], Any]:
    """One call of ``op`` by ``store`` (the timed rank, on the ranks' prefix)."""
    if op == "wake_busy":
        pause = threading.Event()

        def wake(i: int) -> Latency:
            key = f"busy/{rep}/{i}"
            written: list[float] = []
            done = threading.Event()

            def write(other: Any) -> None:
                pause.wait(_LATE)  # the other rank's work before it publishes the key
                other.set(key, b"v")
                written.append(time.perf_counter())
                done.set()

            ranks.each(write, ranks=1)
            store.get(key)
            woke = time.perf_counter()
            if not done.wait(10):  # the waiter may wake before the writer's set() returned
                raise TimeoutError("the writing rank's set() did not return within 10 s")
            return Latency(max(0.0, woke - written[0]))

        return wake
    if op == "barrier_4":
        from torch.distributed.elastic.utils.store import barrier

        def bar(i: int) -> None:
            prefix = f"bar/{rep}/{i}/"
            ranks.each(lambda other: barrier(other, 4, prefix, barrier_timeout=30))
            barrier(store, 4, prefix, barrier_timeout=30)

        return bar
    raise ValueError(op)
