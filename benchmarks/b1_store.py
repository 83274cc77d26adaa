"""B1: c10d Store operations, one client, latency per operation.

Contenders: our ``EtcdStore`` (v3 API), torch's v2 ``EtcdStore`` (python-etcd
over HTTP, same etcd binary with the v2 API on), ``TCPStore`` (server in this
process) and the floor: bare :class:`etcd_store.client.EtcdClient` calls doing
the same work (Put; Range; one Txn with the cached value for ``add``; Txn for
``compare_set``; Range + watch for a key written later; one Txn per 128 keys for
``multi_get``; a count-only Range for ``num_keys``).

A run measures every operation on every contender, in batches of ``ops`` calls
(after a short untimed warm-up); the contender order rotates between runs and
operations. Latency is per call (``time.perf_counter`` around it), RPCs per call
come from an :class:`~etcd_store.client.testing.RpcCounter` (gRPC) or a count of HTTP
requests (python-etcd).
"""

from __future__ import annotations

import gc
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .b1_waits import SUPPORTED as WAITS_SUPPORTED
from .b1_waits import WAIT_LABELS, WAIT_OPS, Latency, Ranks, make_ranks, wait_fn
from .common import (
    FLOOR,
    OURS_STORE,
    TCP_STORE,
    TORCH_V2_STORE,
    EtcdFarm,
    Series,
    ratio_summary,
    rotated,
    say,
)

VALUE = b"v" * 64
MG_KEYS = 256
OPS = ["set", "get", "add", "compare_set", "wait", "wait_later", "multi_get_16", "multi_get_256", "num_keys",
       *WAIT_OPS]
OP_LABELS = {
    "set": "set",
    "get": "get (present)",
    "add": "add",
    "compare_set": "compare_set",
    "wait": "wait (present)",
    "wait_later": "wait (written 10 ms later)",
    "multi_get_16": "multi_get 16 keys",
    "multi_get_256": "multi_get 256 keys",
    "num_keys": "num_keys",
    **WAIT_LABELS,
}
LATE_DELAY = 0.010


class FloorStore:
    """The same work as a Store's operations, as bare client calls (no layer on top)."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        self.prefix = prefix.encode()
        self._mod: dict[bytes, tuple[int, int]] = {}

    def _k(self, key: str) -> bytes:
        return self.prefix + key.encode()

    def set(self, key: str, value: bytes) -> None:
        self.client.put(self._k(key), value)

    def get(self, key: str) -> bytes:
        kv = self.client.get(self._k(key))
        if kv is None:
            raise LookupError(key)
        return kv.value

    def add(self, key: str, amount: int) -> int:
        from etcd_store.client import compare_mod, op_get, op_put

        k = self._k(key)
        mod, value = self._mod.get(k, (0, 0))
        while True:
            res = self.client.txn([compare_mod(k, "==", mod)], [op_put(k, str(value + amount).encode())],
                                  [op_get(k)])
            if res.succeeded:
                self._mod[k] = (res.revision, value + amount)
                return value + amount
            kvs = res.responses[0].kvs
            mod, value = (kvs[0].mod_revision, int(kvs[0].value)) if kvs else (0, 0)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        from etcd_store.client import compare_value, op_get, op_put

        k = self._k(key)
        res = self.client.txn([compare_value(k, "==", expected)], [op_put(k, desired)], [op_get(k)])
        if res.succeeded:
            return desired
        kvs = res.responses[0].kvs
        return kvs[0].value if kvs else expected

    def wait(self, keys: list[str], timeout: float = 10.0) -> None:
        from etcd_store.client import op_get

        ks = [self._k(k) for k in keys]
        if len(ks) == 1:
            res = self.client.range(ks[0])
            present = {kv.key for kv in res.kvs}
            revision = res.revision
        else:
            t = self.client.txn([], [op_get(k) for k in ks])
            present = {r.kvs[0].key for r in t.responses if r.kvs}
            revision = t.revision
        missing = set(ks) - present
        if not missing:
            return
        deadline = time.monotonic() + timeout
        lo, hi = min(missing), max(missing) + b"\0"
        with self.client.watch(lo, hi, start_revision=revision + 1) as w:
            while missing:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"keys {sorted(missing)} not set within {timeout} s")
                for ev in w.get(timeout=left):
                    if ev.type == "PUT":
                        missing.discard(ev.key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        from etcd_store.client import op_get

        ks = [self._k(k) for k in keys]
        out: dict[bytes, bytes] = {}
        for i in range(0, len(ks), 128):  # etcd's default --max-txn-ops
            res = self.client.txn([], [op_get(k) for k in ks[i: i + 128]])
            for r in res.responses:
                if r.kvs:
                    out[r.kvs[0].key] = r.kvs[0].value
        return [out[k] for k in ks]

    def num_keys(self) -> int:
        return int(self.client.range(self.prefix, prefix=True, count_only=True).count)


class _HttpCounter:
    """Counts HTTP requests of a python-etcd client (wraps its pool's ``urlopen``)."""

    def __init__(self, etcd_client: Any) -> None:
        self.count = 0
        pool = etcd_client.http
        inner = pool.urlopen

        def urlopen(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return inner(*args, **kwargs)

        pool.urlopen = urlopen

    def total(self) -> int:
        return self.count

    def reset(self) -> None:
        self.count = 0


class Contender:
    """A store, and for "wait (written 10 ms later)" a pair on a second namespace: ``waiter``
    (same client and counter as ``store``) and ``writer`` (a second client, the other rank)."""

    def __init__(self, name: str, store: Any, waiter: Any, writer: Any, counter: Any | None,
                 closers: list[Callable[[], Any]]):
        self.name = name
        self.store = store
        self.waiter = waiter
        self.writer = writer
        self.counter = counter
        self.closers = closers
        self.unsupported: dict[str, str] = {}
        self.ranks: Ranks | None = None  # the other ranks of the B1 waits (b1_waits)

    def close(self) -> None:
        if self.ranks is not None:
            self.ranks.close()
        for c in self.closers:
            try:
                c()
            except Exception:
                pass


def make_contender(name: str, farm: EtcdFarm, tcp_endpoint: str, timeout: float) -> Contender:
    from etcd_store.client import EtcdClient
    from etcd_store.client.testing import RpcCounter

    td = timedelta(seconds=timeout)
    store: Any
    waiter: Any
    writer: Any
    if name == OURS_STORE:
        from etcd_store.store import EtcdStore

        ep = farm.get(name).get_endpoint()
        counter = RpcCounter()
        client = EtcdClient(ep, timeout=timeout, interceptors=[counter])
        store = EtcdStore(client, prefix="/bench/b1-ours", timeout=td)
        waiter = EtcdStore(client, prefix="/bench/b1late-ours", timeout=td)
        writer = EtcdStore(ep, prefix="/bench/b1late-ours", timeout=td)
        return Contender(name, store, waiter, writer, counter,
                         [store.close, waiter.close, writer.close, client.close])
    if name == TORCH_V2_STORE:
        import etcd
        from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore as TorchEtcdStore

        host, port = farm.get(name).get_endpoint().rsplit(":", 1)
        c1 = etcd.Client(host=host, port=int(port))
        http = _HttpCounter(c1)
        store = TorchEtcdStore(c1, "/bench/b1", td)
        waiter = TorchEtcdStore(c1, "/bench/b1late", td)
        writer = TorchEtcdStore(etcd.Client(host=host, port=int(port)), "/bench/b1late", td)
        return Contender(name, store, waiter, writer, http, [])
    if name == TCP_STORE:
        import torch.distributed as dist

        host, port = tcp_endpoint.rsplit(":", 1)
        base = dist.TCPStore(host, int(port), is_master=False, timeout=td)
        store = dist.PrefixStore("b1", base)
        waiter = dist.PrefixStore("b1late", base)
        writer = dist.PrefixStore("b1late", dist.TCPStore(host, int(port), is_master=False, timeout=td))
        return Contender(name, store, waiter, writer, None, [])
    if name == FLOOR:
        ep = farm.get(name).get_endpoint()
        counter = RpcCounter()
        client = EtcdClient(ep, timeout=timeout, interceptors=[counter])
        wclient = EtcdClient(ep, timeout=timeout)
        return Contender(name, FloorStore(client, "/bench/b1-floor/"), FloorStore(client, "/bench/b1late-floor/"),
                         FloorStore(wclient, "/bench/b1late-floor/"), counter, [client.close, wclient.close])
    raise ValueError(name)


class _LateWriter:
    """A thread that writes a key ``LATE_DELAY`` after being asked to."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.requests: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True, name="late-writer")
        self.thread.start()

    def _run(self) -> None:
        pause = threading.Event()
        while True:
            key = self.requests.get()
            if key is None:
                return
            pause.wait(LATE_DELAY)  # the other rank's work before it publishes the key
            try:
                self.store.set(key, VALUE)
            except Exception as e:
                self.errors.append(f"{type(e).__name__}: {e}")

    def stop(self) -> None:
        self.requests.put(None)
        self.thread.join(5)


def _populate(c: Contender) -> None:
    s = c.store
    s.set("get", VALUE)
    s.set("cas", b"a")
    for i in range(MG_KEYS):
        s.set(f"mg/{i:03d}", VALUE)
    s.add("add", 1)
    probes: dict[str, Callable[[], Any]] = {
        "compare_set": lambda: s.compare_set("cas", b"a", b"a"),
        "num_keys": lambda: s.num_keys(),
        "multi_get_16": lambda: s.multi_get([f"mg/{i:03d}" for i in range(16)]),
    }
    for op, probe in probes.items():
        try:
            probe()
        except Exception as e:  # torch's v2 EtcdStore has no compare_set / num_keys
            c.unsupported[op] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    if "multi_get_16" in c.unsupported:
        c.unsupported["multi_get_256"] = c.unsupported["multi_get_16"]


def _op_fn(c: Contender, op: str, rep: int) -> Callable[[int], Any]:
    s = c.store
    keys16 = [f"mg/{i:03d}" for i in range(16)]
    keys256 = [f"mg/{i:03d}" for i in range(MG_KEYS)]
    if op == "set":
        return lambda i: s.set("set", VALUE)
    if op == "get":
        return lambda i: s.get("get")
    if op == "add":
        return lambda i: s.add("add", 1)
    if op == "compare_set":
        # Toggle a <-> b so that every call succeeds and writes.
        state = {"cur": s.get("cas")}

        def cas(i: int) -> Any:
            cur = state["cur"]
            nxt = b"b" if cur == b"a" else b"a"
            got = s.compare_set("cas", cur, nxt)
            state["cur"] = got
            return got

        return cas
    if op == "wait":
        return lambda i: s.wait(["get"])
    if op == "multi_get_16":
        return lambda i: s.multi_get(keys16)
    if op == "multi_get_256":
        return lambda i: s.multi_get(keys256)
    if op == "num_keys":
        return lambda i: s.num_keys()
    raise ValueError(op)


def _late_fn(c: Contender, late: _LateWriter, rep: int) -> Callable[[int], Any]:
    """One ``wait`` on a key that ``late`` writes ``LATE_DELAY`` after being asked."""

    def call(i: int) -> Any:
        key = f"late/{rep}/{i}"
        late.requests.put(key)
        return c.waiter.wait([key])

    return call


def _interleaved(cs: dict[str, Contender], op: str, rep: int, ops: int, warmup: int,
                 writers: dict[str, _LateWriter], budget: float,
                 errors: dict[str, dict[str, str]]) -> dict[str, tuple[list[float], float | None]]:
    """Latencies (seconds) of ``ops`` calls per contender, and RPCs per call (None when not countable).

    The contenders take turns call by call (the order rotates every call), so slow
    drifts of the machine hit them alike. A contender stops early once its calls
    took ``budget`` seconds in all (torch's v2 ``multi_get`` of 256 keys takes
    about a second per call), after at least one call. A contender whose call
    raises is dropped for this op, its error recorded in ``errors``.
    """
    fns: dict[str, Callable[[int], Any]] = {}
    for name, c in cs.items():
        try:
            if op in WAIT_OPS:
                assert c.ranks is not None
                fn = wait_fn(op, c.waiter, c.ranks, rep)
            else:
                fn = _late_fn(c, writers[name], rep) if op == "wait_later" else _op_fn(c, op, rep)
            for i in range(warmup):
                fn(-1 - i if op != "wait_later" else ops + i)
        except Exception as e:
            errors[name][op] = f"{type(e).__name__}: {e}"
            say(f"B1 {name} {op}: FAILED {errors[name][op][:200]}")
            continue
        if c.counter is not None:
            c.counter.reset()
        fns[name] = fn
    times: dict[str, list[float]] = {name: [] for name in fns}
    spent = dict.fromkeys(fns, 0.0)
    live = list(fns)
    for i in range(ops):
        if not live:
            break
        for name in rotated(live, i):
            t0 = time.perf_counter()
            try:
                res = fns[name](i)
            except Exception as e:
                errors[name][op] = f"{type(e).__name__}: {e}"
                say(f"B1 {name} {op}: FAILED {errors[name][op][:200]}")
                live.remove(name)
                continue
            elapsed = time.perf_counter() - t0
            if isinstance(res, Latency):  # the op measured its own figure
                elapsed = float(res)
            times[name].append(elapsed)
            spent[name] += elapsed
            if spent[name] > budget:
                live.remove(name)
    out: dict[str, tuple[list[float], float | None]] = {}
    for name, ts in times.items():
        if op in errors[name] or not ts:
            continue
        counter = cs[name].counter
        out[name] = (ts, counter.total() / len(ts) if counter is not None else None)
    return out


def run_b1(farm: EtcdFarm, tcp_endpoint: str, contenders: list[str], reps: int, ops: int, late_ops: int,
           batch_budget: float = 2.0, timeout: float = 30.0) -> dict[str, Any]:
    """Measure every store operation on every contender; returns the B1 section."""
    objs: dict[str, Contender] = {}
    writers: dict[str, _LateWriter] = {}
    series: dict[str, dict[str, Series]] = {c: {op: Series() for op in OPS} for c in contenders}
    rpcs: dict[str, dict[str, list[float]]] = {c: {op: [] for op in OPS} for c in contenders}
    errors: dict[str, dict[str, str]] = {c: {} for c in contenders}
    try:
        for name in contenders:
            objs[name] = make_contender(name, farm, tcp_endpoint, timeout)
            _populate(objs[name])
            if name in WAITS_SUPPORTED:
                objs[name].ranks = make_ranks(name, farm, tcp_endpoint, timeout)
            else:
                for op in WAIT_OPS:
                    objs[name].unsupported[op] = "torch's store_util.barrier needs a c10d Store (timeout, set_timeout)"
            writers[name] = _LateWriter(objs[name].writer)
        gc_was = gc.isenabled()
        for rep in range(reps):
            gc.collect()
            for op in OPS:
                cs = {name: objs[name] for name in contenders
                      if op not in objs[name].unsupported and op not in errors[name]}
                n = late_ops if op == "wait_later" or op in WAIT_OPS else ops
                noisy = [c.ranks for c in cs.values() if op == "wake_busy" and c.ranks is not None]
                for r in noisy:
                    r.start_noise()
                gc.disable()
                try:
                    measured = _interleaved(cs, op, rep, n, 2, writers, batch_budget, errors)
                finally:
                    if gc_was:
                        gc.enable()
                    for r in noisy:
                        r.stop_noise()
                for name, (times, per_call) in measured.items():
                    series[name][op].add_run(times)
                    if per_call is not None:
                        rpcs[name][op].append(per_call)
            say(f"B1 run {rep + 1}/{reps} done")
    finally:
        for w in writers.values():
            w.stop()
        for c in objs.values():
            c.close()
    return summarize_b1(series, rpcs, errors, {n: o.unsupported for n, o in objs.items()}, contenders,
                        reps, ops, late_ops, batch_budget)


def summarize_b1(series: dict[str, dict[str, Series]], rpcs: dict[str, dict[str, list[float]]],
                 errors: dict[str, dict[str, str]], unsupported: dict[str, dict[str, str]],
                 contenders: list[str], reps: int, ops: int, late_ops: int, batch_budget: float) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for op in OPS:
        for c in contenders:
            row: dict[str, Any] = {"op": op, "label": OP_LABELS[op], "contender": c,
                                   "us": series[c][op].summary(scale=1e6)}
            counts = rpcs[c][op]
            row["rpcs_per_op"] = round(sorted(counts)[len(counts) // 2], 2) if counts else None
            if op in unsupported.get(c, {}):
                row["na"] = f"not implemented ({unsupported[c][op]})"
            elif op in errors[c]:
                row["na"] = f"failed: {errors[c][op][:200]}"
            for base in (FLOOR, TORCH_V2_STORE, TCP_STORE):
                if base != c and base in series:
                    row[f"ratio_vs_{base}"] = ratio_summary(series[c][op], series[base][op])
            rows.append(row)
    return {"ops": OPS, "labels": OP_LABELS, "contenders": contenders, "reps": reps, "ops_per_batch": ops,
            "late_ops_per_batch": late_ops, "batch_budget_s": batch_budget, "value_bytes": len(VALUE), "keys_in_namespace": MG_KEYS + 4,
            "rows": rows,
            "note": "RPCs per op: gRPC calls (watch streams count once) for EtcdStore and the floor, "
                    "HTTP requests for torch's v2 EtcdStore; TCPStore: not counted (one request per "
                    "call by protocol). wait (written 10 ms later) includes the 10 ms. get woken by a write: from the "
                    "writing rank's set() returning to the waiting rank's get() returning, while a third rank "
                    "writes back to back; store_util.barrier of 4 ranks: 4 threads, one store and client each."}
