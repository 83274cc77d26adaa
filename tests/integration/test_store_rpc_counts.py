"""EtcdStore costs one round trip per operation: counted with an RpcCounter interceptor."""

from __future__ import annotations

import datetime
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist

from etcd_store import EtcdStore
from etcd_store.client import EtcdClient
from etcd_store.client.testing import RpcCounter

TIMEOUT = datetime.timedelta(seconds=10)


class Counted:
    """A store whose client counts RPCs; ``rpcs(fn)`` runs ``fn`` and returns the counts."""

    def __init__(self, endpoint: str, counter: RpcCounter | None = None, prefix: str | None = None) -> None:
        self.counter = counter or RpcCounter()
        self.client = EtcdClient(endpoint, interceptors=[self.counter])
        self.store = EtcdStore(self.client, prefix=prefix or f"rpc/{uuid.uuid4().hex[:8]}", timeout=TIMEOUT)

    def rpcs(self, fn: Callable[[], Any]) -> dict[str, int]:
        self.counter.reset()
        fn()
        return {k: n for k, n in self.counter.snapshot().items() if not k.startswith("Lease/")}

    def close(self) -> None:
        self.store.close()
        self.client.close()


@pytest.fixture
def counted(etcd_endpoint: str) -> Iterator[Callable[..., Counted]]:
    made: list[Counted] = []

    def make(**kwargs: Any) -> Counted:
        c = Counted(etcd_endpoint, **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


ONE_RANGE = {"KV/Range": 1}
ONE_TXN = {"KV/Txn": 1}


def test_plain_operations_are_one_request(counted: Callable[..., Counted]) -> None:
    c = counted()
    s = c.store
    assert c.rpcs(lambda: s.set("k", "v")) == ONE_TXN  # fenced by the thread's marker
    assert c.rpcs(lambda: s.get("k")) == ONE_RANGE
    assert c.rpcs(lambda: s.check(["k", "missing"])) == ONE_TXN
    assert c.rpcs(lambda: s.wait(["k"])) == ONE_TXN
    assert c.rpcs(s.num_keys) == ONE_RANGE  # the keys, listed: nested namespaces' keys are left out
    assert c.rpcs(s.list_keys) == ONE_RANGE
    assert c.rpcs(lambda: s.delete_key("k")) == ONE_TXN
    assert c.rpcs(lambda: s.delete_key("k")) == ONE_TXN


@pytest.mark.parametrize("n", [1, 16, 64])
def test_multi_get_and_multi_set_of_n_keys_are_one_txn(n: int, counted: Callable[..., Counted]) -> None:
    c = counted()
    keys = [f"rank/{i}" for i in range(n)]
    assert c.rpcs(lambda: c.store.multi_set(keys, [str(i) for i in range(n)])) == ONE_TXN
    assert c.rpcs(lambda: c.store.multi_get(keys)) == ONE_TXN
    assert c.store.multi_get(keys) == [str(i).encode() for i in range(n)]


def test_many_keys_split_at_etcds_txn_op_limit(counted: Callable[..., Counted]) -> None:
    # etcd's default --max-txn-ops is 128: 300 reads need 3 Txns, 300 writes (64 a Txn) need 5.
    c = counted()
    keys = [f"k{i}" for i in range(300)]
    assert c.rpcs(lambda: c.store.multi_set(keys, keys)) == {"KV/Txn": 5}
    assert c.rpcs(lambda: c.store.multi_get(keys)) == {"KV/Txn": 3}
    assert c.store.multi_get(keys) == [k.encode() for k in keys]


def test_read_modify_write_operations_are_one_txn(counted: Callable[..., Counted]) -> None:
    c = counted()
    s = c.store
    assert c.rpcs(lambda: s.add("counter", 1)) == ONE_TXN  # new key
    assert c.rpcs(lambda: s.add("counter", 1)) == ONE_TXN  # this store wrote it last
    s.set("preset", "10")
    assert c.rpcs(lambda: s.add("preset", 5)) == ONE_TXN  # this store wrote it last
    assert s.get("counter") == b"2" and s.get("preset") == b"15"
    assert c.rpcs(lambda: s.append("log", "a")) == ONE_TXN
    assert c.rpcs(lambda: s.append("log", "b")) == ONE_TXN
    assert c.rpcs(lambda: s.compare_set("cs", "", "1")) == ONE_TXN  # missing, empty expected
    assert c.rpcs(lambda: s.compare_set("cs", "1", "2")) == ONE_TXN  # match
    assert c.rpcs(lambda: s.compare_set("cs", "1", "3")) == ONE_TXN  # mismatch
    assert c.rpcs(lambda: s.compare_set("nope", "x", "y")) == ONE_TXN  # missing, expected given
    assert c.rpcs(lambda: s.barrier("b", 1)) == ONE_TXN


def test_queue_operations_are_one_request(counted: Callable[..., Counted]) -> None:
    c = counted()
    s = c.store
    assert c.rpcs(lambda: s.queue_push("q", "a")) == ONE_TXN
    assert c.rpcs(lambda: s.queue_push("q", "b")) == ONE_TXN
    assert c.rpcs(lambda: s.queue_len("q")) == ONE_RANGE
    assert c.rpcs(lambda: s.queue_pop("q")) == ONE_TXN
    assert c.rpcs(lambda: s.queue_pop("q", False)) == ONE_TXN
    # A store that never touched the queue reads it once first.
    other = counted(prefix=s.prefix)
    s.queue_push("q", "c")
    assert other.rpcs(lambda: other.store.queue_pop("q")) == {"KV/Range": 1, "KV/Txn": 1}


def test_num_keys_is_one_range_also_with_queues(counted: Callable[..., Counted]) -> None:
    c = counted()
    s = c.store
    s.multi_set(["a", "b", "c"], ["1", "2", "3"])
    assert c.rpcs(s.num_keys) == ONE_RANGE and s.num_keys() == 3
    s.queue_push("q", "item")  # queue items share the user key range: they are left out
    assert c.rpcs(s.num_keys) == ONE_RANGE
    assert s.num_keys() == 3 and sorted(s.list_keys()) == ["a", "b", "c"]


def test_a_stale_view_retries_from_the_value_the_failed_txn_returned(
    counted: Callable[..., Counted],
) -> None:
    a = counted()
    b = counted(prefix=a.store.prefix)
    assert a.store.add("n", 1) == 1
    assert b.store.add("n", 10) == 11  # b has never seen n: guess "missing", fail, retry
    # a's view (n = 1) is stale: the failed Txn returns n = 11, the retry succeeds. No Range.
    assert a.rpcs(lambda: a.store.add("n", 100)) == {"KV/Txn": 2}
    assert a.store.get("n") == b"111"
    b.store.set("cs", "x")
    a.store.compare_set("cs", "x", "y")
    assert b.rpcs(lambda: b.store.append("cs", "z")) == {"KV/Txn": 2}
    assert a.store.get("cs") == b"yz"


def test_construction_and_clone_costs(etcd_endpoint: str, counted: Callable[..., Counted]) -> None:
    counter = RpcCounter()
    first = counted(counter=counter)
    # First store of a namespace: read the lease key, grant a lease, record it.
    assert counter.snapshot() == {"KV/Range": 1, "Lease/LeaseGrant": 1, "KV/Txn": 1}
    counter2 = RpcCounter()
    counted(counter=counter2, prefix=first.store.prefix)
    # Later stores adopt the recorded lease (their keep-alive thread then refreshes it).
    counts = {k: n for k, n in counter2.snapshot().items() if k != "Lease/LeaseKeepAlive"}
    assert counts == ONE_RANGE
    assert first.rpcs(first.store.clone) == {}


class _WriteAfterFirstRange(RpcCounter):
    """Counts RPCs and, right after the first Range completes, runs ``hook`` once.

    This puts a write exactly between a waiting call's read and its watch.
    """

    def __init__(self, hook: Callable[[], None]) -> None:
        super().__init__()
        self.hook = hook
        self.armed = False
        self.fired = False

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        response = super().intercept_unary_unary(continuation, details, request)
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if self.armed and not self.fired and method.endswith(("KV/Range", "KV/Txn")):
            response.result()
            self.fired = True
            self.hook()
        return response


class _WatchStarts(_WriteAfterFirstRange):
    """Also records the ``start_revision`` of every watch the client creates, and
    sets ``created`` when etcd confirms one (the client shows its streams' messages to an
    interceptor with ``stream_message``: see ``Transport.stream_opened``)."""

    def __init__(self, hook: Callable[[], None]) -> None:
        super().__init__(hook)
        self.starts: list[int] = []
        self.created = threading.Event()

    def stream_message(self, method: str, sent: bool, message: Any) -> None:
        if not method.endswith("Watch/Watch"):  # lease keep-alives
            return
        if sent and message.HasField("create_request"):
            self.starts.append(message.create_request.start_revision)
        if not sent and message.created:
            self.created.set()


WAITS = ["get", "wait", "multi_get", "queue_pop", "barrier"]


def _waiting_call(op: str, waiter: EtcdStore, writer: EtcdStore) -> tuple[Callable[[], Any], Callable[[], None]]:
    """``op`` on ``waiter`` blocking on "key", and the write by ``writer`` that releases it."""
    calls: dict[str, Callable[[], Any]] = {
        "get": lambda: waiter.get("key"),
        "wait": lambda: waiter.wait(["key"]),
        "multi_get": lambda: waiter.multi_get(["key"]),
        "queue_pop": lambda: waiter.queue_pop("key"),
        "barrier": lambda: waiter.barrier("key", 2),
    }
    writes: dict[str, Callable[[], None]] = {
        "queue_pop": lambda: writer.queue_push("key", "value"),
        "barrier": lambda: writer.barrier("key", 2),
    }
    return calls[op], writes.get(op, lambda: writer.set("key", "value"))


@pytest.mark.parametrize("op", WAITS)
def test_a_write_between_the_read_and_the_watch_is_not_lost(
    op: str, etcd_endpoint: str, counted: Callable[..., Counted]
) -> None:
    writer = counted()
    counter = _WatchStarts(lambda: write_now())
    waiter = counted(counter=counter, prefix=writer.store.prefix)
    waiter.store.set_timeout(datetime.timedelta(seconds=5))
    call, write_now = _waiting_call(op, waiter.store, writer.store)
    counter.reset()
    counter.armed = True
    result = call()
    assert counter.fired
    assert result in (b"value", [b"value"], None)
    counts = counter.snapshot()
    # The first read found the key missing; the write landed before the watch, which
    # starts from now (synced: etcd streams its events at once instead of on its 100 ms
    # catch-up tick). etcd reports that it registered the watch at a revision above
    # the read's, so the store reads once more, at a revision at or above it, and
    # finds the write. barrier: the add is the first "read".
    assert counts.get("Watch/Watch") == 1
    assert counter.starts == [0]
    reads = counts.get("KV/Range", 0) + counts.get("KV/Txn", 0)
    assert reads == (3 if op == "queue_pop" else 2)  # queue_pop: then the pop Txn


@pytest.mark.parametrize("op", WAITS)
def test_waits_watch_from_now_and_read_once_when_etcd_is_quiet(
    op: str, etcd_endpoint: str, counted: Callable[..., Counted]
) -> None:
    writer = counted()
    counter = _WatchStarts(lambda: None)
    waiter = counted(counter=counter, prefix=writer.store.prefix)
    waiter.store.set_timeout(datetime.timedelta(seconds=5))
    call, write = _waiting_call(op, waiter.store, writer.store)
    done = threading.Event()
    results: list[Any] = []

    def run() -> None:
        results.append(call())
        done.set()

    counter.reset()
    thread = threading.Thread(target=run)
    thread.start()
    # Nothing is written until etcd confirmed the watch: it covers every revision after the read.
    assert counter.created.wait(10)
    assert not done.is_set()
    write()
    thread.join(10)
    assert done.is_set() and results[0] in (b"value", [b"value"], None)
    counts = counter.snapshot()
    assert counter.starts == [0]
    assert counts.get("Watch/Watch") == 1
    reads = counts.get("KV/Range", 0) + counts.get("KV/Txn", 0)
    assert reads == (2 if op == "queue_pop" else 1)


def test_waiting_costs_no_rpc_while_nothing_happens(counted: Callable[..., Counted]) -> None:
    c = counted()
    c.store.set_timeout(datetime.timedelta(milliseconds=1500))
    counts = c.rpcs(lambda: pytest.raises(dist.DistStoreError, c.store.get, "never"))
    assert counts == {"KV/Range": 1, "Watch/Watch": 1}


def test_big_values_cost_one_request_per_chunk(counted: Callable[..., Counted]) -> None:
    c = counted()
    value = bytes(range(256)) * (12 * 1024)  # 3 MiB: 3 chunks of 1 MiB
    assert c.rpcs(lambda: c.store.set("big", value)) == {"KV/Put": 3, "KV/Txn": 1}
    # The chunks are read at the latest revision, guarded by the manifest's mod revision.
    assert c.rpcs(lambda: c.store.get("big")) == {"KV/Range": 1, "KV/Txn": 1}
    # Replacing it deletes the old chunks.
    assert c.rpcs(lambda: c.store.set("big", "small")) == {"KV/Txn": 1, "KV/DeleteRange": 1}
    assert c.client.range(c.store.prefix.encode() + b"\0c/", prefix=True, count_only=True).count == 0


def test_contended_add_is_exact_without_sleeps(counted: Callable[..., Counted]) -> None:
    c = counted()
    threads, increments = 8, 25
    stores = [c.store.clone() for _ in range(threads)]
    errors: list[BaseException] = []

    def work(s: EtcdStore) -> None:
        try:
            for _ in range(increments):
                s.add("hot", 1)
        except BaseException as e:  # reported below
            errors.append(e)

    c.counter.reset()
    workers = [threading.Thread(target=work, args=(s,)) for s in stores]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors
    counts = c.counter.snapshot()
    assert c.store.get("hot") == str(threads * increments).encode()
    # Every failed Txn lost to a successful one and returned its value: no reads in between.
    assert set(counts) == {"KV/Txn"}
    assert threads * increments <= counts["KV/Txn"] < threads * threads * increments
