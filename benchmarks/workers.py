"""Worker processes that host simulated nodes, and the coordinator's handle on them.

A :class:`Pool` spawns worker processes (``multiprocessing`` "spawn": each imports
torch once and is reused for every measurement). A worker hosts *groups* of
nodes; every node is a thread with its own object from :mod:`benchmarks.nodes`
(a rendezvous handler, a floor node, a process-group rank). The coordinator
drives a measurement in four steps, each a message to every worker involved::

    create  -> build the nodes (untimed, in parallel threads)
    arm     -> start one thread per node, blocked on the group's "go" event
    go      -> set the event (sent to the workers back to back; t0 is taken
               just before the first send)
    collect -> join the threads; each reports its CLOCK_MONOTONIC end time

(:func:`go_together` releases many armed groups with one ``go_many`` message per worker: B6's
jobs start at one instant.) (``watch_counts``, before and after, reads each node's delivered watch events: those
of the watches its threads created, counted per node also when nodes share a client.)
Nodes of one group in one worker share clients when their spec says
``clients="process"`` (see :mod:`benchmarks.nodes`).

``CLOCK_MONOTONIC`` is system wide on Linux, so the coordinator computes
"time until the last node finished" as ``max(end) - t0`` across processes.
Every wait has a deadline; a worker that does not answer in time is killed.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker failed a command, died, or did not answer within its deadline."""


# --------------------------------------------------------------------------- worker side


@dataclass
class _NodeRun:
    ok: bool = False
    end: float = 0.0
    start: float = 0.0
    value: Any = None
    error: str | None = None


class _Group:
    def __init__(self) -> None:
        from .nodes import SharedClients

        self.shared = SharedClients()  # the clients the group's nodes share here (spec["clients"])
        self.stats: dict[int, Any] = {}  # per node: the WatchStats of the watches its threads made
        self.nodes: dict[int, Any] = {}
        self.go = threading.Event()
        self.threads: list[threading.Thread] = []
        self.runs: dict[int, _NodeRun] = {}


class _WorkerState:
    """The commands a worker understands (method name = command name)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.groups: dict[str, _Group] = {}

    def ping(self, preload: tuple[str, ...] = ()) -> int:
        """The worker's pid, after importing ``preload`` (modules every node kind needs)."""
        import importlib

        for name in preload:
            try:
                importlib.import_module(name)
            except ImportError as e:  # a contender that is missing fails later, with its own message
                log.debug("preloading %s failed: %s", name, e)
        return os.getpid()

    def create(self, group: str, kind: str, spec: dict[str, Any], node_ids: list[int], timeout: float) -> dict[str, Any]:
        from etcd_store.client.testing import WatchStats, counting_watches

        from . import nodes

        g = self.groups.setdefault(group, _Group())
        errors: dict[int, str] = {}
        lock = threading.Lock()

        def build(node_id: int) -> None:
            try:
                stats = WatchStats()
                with counting_watches(stats):
                    node = nodes.make_node(kind, spec, node_id, g.shared)
                with lock:
                    g.nodes[node_id] = node
                    g.stats[node_id] = stats
            except BaseException as e:
                with lock:
                    errors[node_id] = f"{type(e).__name__}: {e}"

        threads = [threading.Thread(target=build, args=(i,), daemon=True) for i in node_ids]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        missing = [i for i in node_ids if i not in g.nodes and i not in errors]
        for i in missing:
            errors[i] = f"node creation did not finish within {timeout:g} s"
        return {"created": len(g.nodes), "errors": errors}

    def arm(self, group: str, action: str, args: dict[str, Any] | None = None) -> int:
        from etcd_store.client.testing import counting_watches

        g = self.groups[group]
        g.go = threading.Event()
        g.runs = {}
        g.threads = []
        ready = threading.Barrier(len(g.nodes) + 1)

        def run(node_id: int, node: Any) -> None:
            rec = _NodeRun()
            g.runs[node_id] = rec
            ready.wait()
            g.go.wait()
            rec.start = time.monotonic()
            try:
                with counting_watches(g.stats[node_id]):
                    rec.value = getattr(node, action)(**(args or {}))
                rec.ok = True
            except BaseException as e:
                rec.error = f"{type(e).__name__}: {e}"
            rec.end = time.monotonic()

        for node_id, node in g.nodes.items():
            t = threading.Thread(target=run, args=(node_id, node), daemon=True, name=f"node-{node_id}")
            g.threads.append(t)
            t.start()
        ready.wait()
        return len(g.threads)

    def go(self, group: str) -> float:
        now = time.monotonic()
        self.groups[group].go.set()
        return now

    def go_many(self, groups: list[str]) -> float:
        """Release several armed groups at one instant (B6: many jobs start together)."""
        now = time.monotonic()
        for name in groups:
            self.groups[name].go.set()
        return now

    def collect(self, group: str, timeout: float) -> dict[int, dict[str, Any]]:
        g = self.groups[group]
        deadline = time.monotonic() + timeout
        for t in g.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        out: dict[int, dict[str, Any]] = {}
        for node_id in g.nodes:
            rec = g.runs.get(node_id)
            if rec is None or (not rec.ok and rec.error is None):
                out[node_id] = {"ok": False, "error": f"did not finish within {timeout:g} s", "end": None}
            else:
                out[node_id] = {"ok": rec.ok, "error": rec.error, "end": rec.end, "start": rec.start, "value": rec.value}
        return out

    def watch_counts(self, group: str) -> dict[int, tuple[int, int] | None]:
        """Per node, the ``(events, bytes)`` its clients' watches delivered so far."""
        from . import nodes

        g = self.groups[group]
        return {node_id: nodes.watch_counts(node, g.stats[node_id]) for node_id, node in g.nodes.items()}

    def close(self, group: str, timeout: float) -> int:
        g = self.groups.pop(group, None)
        if g is None:
            return 0

        def shut(node: Any) -> None:
            try:
                node.close()
            except BaseException as e:  # closing is best effort
                log.debug("closing a node failed: %s", e)

        threads = [threading.Thread(target=shut, args=(n,), daemon=True) for n in g.nodes.values()]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        g.shared.close()
        return sum(t.is_alive() for t in threads)


def _worker_main(conn: Connection, index: int, log_level: int) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s [worker {index}] %(levelname)s %(name)s: %(message)s")
    # Quiet torch's per-node INFO lines (thousands at N = 1024).
    for name in ("torch.distributed", "etcd_rdzv", "etcd_store"):
        logging.getLogger(name).setLevel(max(log_level, logging.WARNING))
    from .common import raise_fd_limit

    raise_fd_limit()  # a worker may hold 512 nodes, each with its own etcd connection
    state = _WorkerState(index)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            conn.send(("ok", None))
            return
        op, kwargs = msg
        try:
            conn.send(("ok", getattr(state, op)(**kwargs)))
        except BaseException as e:
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))


# --------------------------------------------------------------------------- coordinator side


class Worker:
    """One spawned worker process and its command pipe."""

    def __init__(self, ctx: Any, index: int, log_level: int) -> None:
        self.index = index
        parent, child = ctx.Pipe()
        self.conn: Connection = parent
        self.proc = ctx.Process(target=_worker_main, args=(child, index, log_level), daemon=True,
                                name=f"bench-worker-{index}")
        self.proc.start()
        child.close()
        self._pending = False

    def send(self, op: str, **kwargs: Any) -> None:
        if self._pending:
            raise WorkerError(f"worker {self.index}: a command is still pending")
        try:
            self.conn.send((op, kwargs))
        except (OSError, BrokenPipeError) as e:
            raise WorkerError(f"worker {self.index} is gone ({e})") from None
        self._pending = True

    def recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            self.kill()
            raise WorkerError(f"worker {self.index} did not answer within {timeout:g} s (killed)")
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError) as e:
            raise WorkerError(f"worker {self.index} died ({e})") from None
        self._pending = False
        if status != "ok":
            raise WorkerError(f"worker {self.index}: {value}")
        return value

    def call(self, op: str, wait: float, **kwargs: Any) -> Any:
        """Send a command and wait up to ``wait`` seconds for its answer."""
        self.send(op, **kwargs)
        return self.recv(wait)

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        """SIGKILL the worker (a node dying without a chance to clean up)."""
        if self.proc.pid is not None and self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.join(5)
        self.conn.close()

    def stop(self, timeout: float = 10.0) -> None:
        if not self.proc.is_alive():
            self.proc.join(1)
            return
        try:
            if not self._pending:
                self.conn.send(None)
                if self.conn.poll(timeout):
                    self.conn.recv()
        except (OSError, EOFError):
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.kill()


# Imported by every worker at start, in parallel, so that no measurement pays for an import.
PRELOAD = (
    "torch.distributed",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "torch.distributed.elastic.rendezvous.etcd_rendezvous_backend",
    "etcd_store.client",
    "etcd_store.store",
    "etcd_rdzv.plugin",
    "benchmarks.nodes",
)


class Pool:
    """``size`` spawned workers; a context manager that stops them all on exit."""

    def __init__(self, size: int, *, log_level: int = logging.WARNING, start_timeout: float = 180.0) -> None:
        self.ctx = mp.get_context("spawn")
        self.log_level = log_level
        self.workers: list[Worker] = []
        try:
            self.workers = [Worker(self.ctx, i, log_level) for i in range(size)]
            for w in self.workers:
                w.send("ping", preload=PRELOAD)
            deadline = time.monotonic() + start_timeout
            for w in self.workers:
                w.recv(max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.close()
            raise

    def spawn_extra(self, count: int, timeout: float = 180.0) -> list[Worker]:
        """Start ``count`` more workers (not part of the pool; the caller stops them)."""
        extra = [Worker(self.ctx, 1000 + i, self.log_level) for i in range(count)]
        for w in extra:
            w.send("ping", preload=PRELOAD)
        deadline = time.monotonic() + timeout
        for w in extra:
            w.recv(max(0.1, deadline - time.monotonic()))
        return extra

    def close(self) -> None:
        for w in self.workers:
            w.stop()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def assign(node_ids: list[int], workers: list[Worker]) -> dict[Worker, list[int]]:
    """Spread nodes round-robin over workers (only workers that get a node appear)."""
    out: dict[Worker, list[int]] = {}
    for k, node_id in enumerate(node_ids):
        out.setdefault(workers[k % len(workers)], []).append(node_id)
    return out


def go_together(groups: list[NodeGroup]) -> float:
    """Release every armed group of ``groups`` at once: one ``go_many`` message per
    worker naming all its groups; returns t0, taken just before the first send."""
    by_worker: dict[Worker, list[str]] = {}
    for g in groups:
        for w in g.layout:
            by_worker.setdefault(w, []).append(g.name)
    t0 = time.monotonic()
    for w, names in by_worker.items():
        w.send("go_many", groups=names)
    for w in by_worker:
        w.recv(30)
    return t0


@dataclass
class GroupRun:
    """The outcome of one timed phase of a node group."""

    t0: float
    results: dict[int, dict[str, Any]]

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r["ok"] for r in self.results.values())

    @property
    def elapsed(self) -> float | None:
        """Seconds from the go signal until the last node finished (None if one failed)."""
        if not self.ok:
            return None
        return max(r["end"] for r in self.results.values()) - self.t0

    def first_error(self) -> str | None:
        """The failure that came first (usually the cause of the others, which then wait in
        vain), and how many nodes failed."""
        failed = [(r["end"] if r.get("end") is not None else float("inf"), node_id, r)
                  for node_id, r in self.results.items() if not r["ok"]]
        if not failed:
            return None
        _, node_id, r = min(failed, key=lambda x: (x[0], x[1]))
        more = f" (and {len(failed) - 1} more node(s))" if len(failed) > 1 else ""
        return f"node {node_id}: {r['error']}{more}"


class NodeGroup:
    """Nodes of one contender spread over workers; create, run timed phases, close."""

    def __init__(self, name: str, layout: dict[Worker, list[int]]) -> None:
        self.name = name
        self.layout = layout

    def create(self, kind: str, spec: dict[str, Any], timeout: float) -> dict[int, str]:
        for w, ids in self.layout.items():
            w.send("create", group=self.name, kind=kind, spec=spec, node_ids=ids, timeout=timeout)
        errors: dict[int, str] = {}
        for w in self.layout:
            res = w.recv(timeout + 30)
            errors.update({int(k): v for k, v in res["errors"].items()})
        return errors

    def arm(self, action: str, args: dict[str, Any] | None = None, *, timeout: float = 60.0,
            only: list[Worker] | None = None) -> None:
        targets = [w for w in self.layout if only is None or w in only]
        for w in targets:
            w.send("arm", group=self.name, action=action, args=args)
        for w in targets:
            w.recv(timeout)

    def go(self, only: list[Worker] | None = None) -> float:
        targets = [w for w in self.layout if only is None or w in only]
        t0 = time.monotonic()
        for w in targets:
            w.send("go", group=self.name)
        for w in targets:
            w.recv(30)
        return t0

    def collect(self, t0: float, timeout: float, only: list[Worker] | None = None) -> GroupRun:
        targets = [w for w in self.layout if only is None or w in only]
        for w in targets:
            w.send("collect", group=self.name, timeout=timeout)
        results: dict[int, dict[str, Any]] = {}
        for w in targets:
            results.update({int(k): v for k, v in w.recv(timeout + 30).items()})
        return GroupRun(t0, results)

    def watch_counts(self, timeout: float = 60.0) -> dict[int, tuple[int, int] | None]:
        """Per node, the ``(events, bytes)`` its etcd clients' watches delivered so far."""
        for w in self.layout:
            w.send("watch_counts", group=self.name)
        out: dict[int, tuple[int, int] | None] = {}
        for w in self.layout:
            out.update({int(k): (int(v[0]), int(v[1])) if v is not None else None for k, v in w.recv(timeout).items()})
        return out

    def run(self, action: str, timeout: float, args: dict[str, Any] | None = None) -> GroupRun:
        """arm + go + collect: one timed phase on every node of the group."""
        self.arm(action, args)
        t0 = self.go()
        return self.collect(t0, timeout)

    def close(self, timeout: float = 30.0) -> None:
        live = [w for w in self.layout if w.alive]
        for w in live:
            try:
                w.send("close", group=self.name, timeout=timeout)
            except WorkerError:
                pass
        for w in live:
            try:
                w.recv(timeout + 15)
            except WorkerError as e:
                log.warning("closing group %s: %s", self.name, e)
