"""EtcdStore when etcd restarts, goes away, loses its leader or loses the namespace lease."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist
from helpers.watch_opened import WatchOpened

from etcd_server import EtcdServer
from etcd_server.cluster import EtcdCluster
from etcd_store import EtcdStore
from etcd_store.client import EtcdClient
from etcd_store.client.testing import RpcCounter


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # handed to the test
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_blocked_wait_returns_after_etcd_restarts(fresh_etcd: EtcdServer) -> None:
    endpoint = fresh_etcd.get_endpoint()
    counter = WatchOpened()
    client = EtcdClient(endpoint, interceptors=[counter])
    store = EtcdStore(client, prefix="restart", timeout=datetime.timedelta(seconds=60))
    try:
        store.set("before", "kept")
        getter, got = _in_thread(lambda: store.get("after"))
        waiter, waited = _in_thread(lambda: store.clone().wait(["after-too"]))
        assert counter.opened.wait(10), "the waiting get never opened its watch"
        fresh_etcd.restart()  # same data dir, same ports
        with EtcdStore(endpoint, prefix="restart") as writer:
            writer.set("after", "value")
            writer.set("after-too", "x")
        getter.join(30)
        waiter.join(30)
        assert got == [b"value"]
        assert waited == [None]
        # Data and the namespace lease survived the restart; writes go on.
        assert store.get("before") == b"kept"
        assert store.add("n", 2) == 2
    finally:
        store.close()
        client.close()


def test_calls_fail_within_the_timeout_naming_the_endpoints(fresh_etcd: EtcdServer) -> None:
    endpoint = fresh_etcd.get_endpoint()
    timeout = datetime.timedelta(seconds=1)
    store = EtcdStore(endpoint, prefix="down", timeout=timeout)
    store.set("k", "v")
    store.queue_push("q", "item")
    counter = WatchOpened()
    client = EtcdClient(endpoint, interceptors=[counter])
    blocked = EtcdStore(client, prefix="down", timeout=datetime.timedelta(seconds=3))
    waiter, waited = _in_thread(lambda: blocked.wait(["never"]))
    assert counter.opened.wait(10)
    fresh_etcd.stop(keep_data=True)
    calls: dict[str, Callable[[], Any]] = {
        "set": lambda: store.set("k", "w"),
        "get": lambda: store.get("k"),
        "add": lambda: store.add("n", 1),
        "append": lambda: store.append("k", "x"),
        "compare_set": lambda: store.compare_set("k", "v", "w"),
        "check": lambda: store.check(["k"]),
        "wait": lambda: store.wait(["k"]),
        "multi_get": lambda: store.multi_get(["k"]),
        "multi_set": lambda: store.multi_set(["a"], ["b"]),
        "delete_key": lambda: store.delete_key("k"),
        "num_keys": store.num_keys,
        "list_keys": store.list_keys,
        "queue_push": lambda: store.queue_push("q", "x"),
        "queue_pop": lambda: store.queue_pop("q"),
        "queue_len": lambda: store.queue_len("q"),
        "barrier": lambda: store.barrier("b", 2),
        "new store": lambda: EtcdStore(endpoint, prefix="other", timeout=timeout),
    }
    started = time.monotonic()
    running = {name: _in_thread(fn) for name, fn in calls.items()}
    for name, (thread, out) in running.items():
        thread.join(30)
        assert not thread.is_alive(), f"{name} hangs with etcd down"
        assert len(out) == 1 and isinstance(out[0], dist.DistNetworkError), (name, out)
        assert endpoint in str(out[0]), (name, str(out[0]))
    # All ran at once: each gave up after about one timeout (generous bound).
    assert time.monotonic() - started < 15
    # A wait that was already blocked in its watch ends at its deadline too.
    waiter.join(30)
    assert len(waited) == 1 and isinstance(waited[0], dist.DistStoreError), waited
    assert "wait timeout after 3000ms" in str(waited[0])
    store.close()
    blocked.close()
    client.close()


def test_a_dead_endpoint_in_the_list_is_skipped(etcd_endpoint: str) -> None:
    with EtcdStore(f"127.0.0.1:1,{etcd_endpoint}", prefix="failover") as store:
        store.set("k", "v")
        assert store.get("k") == b"v"
        assert store.add("n", 1) == 1


def test_calls_continue_when_the_leader_of_three_members_dies(etcd_binary: str) -> None:
    with EtcdCluster(3, binary=etcd_binary) as cluster:
        store = EtcdStore(cluster.endpoint_string, prefix="ha", timeout=datetime.timedelta(seconds=30))
        try:
            store.set("before", "1")
            assert store.add("n", 1) == 1
            store.queue_push("q", "a")
            waiter, got = _in_thread(lambda: store.clone().get("after"))
            cluster.stop_member(cluster.leader(), graceful=False)
            store.set("x", "1")
            assert store.get("before") == b"1"
            assert store.add("n", 1) == 2
            assert store.compare_set("x", "1", "2") == b"2"
            store.multi_set(["m1", "m2"], ["1", "2"])
            assert store.multi_get(["m1", "m2"]) == [b"1", b"2"]
            assert store.queue_pop("q") == b"a"
            store.set("after", "value")
            waiter.join(30)
            assert got == [b"value"]
            assert store.clone().add("n", 1) == 3
        finally:
            store.close()


def test_a_lost_namespace_lease_is_replaced_and_writes_go_on(etcd_endpoint: str) -> None:
    """As if this process had been cut off from etcd for longer than lease_ttl."""
    client = EtcdClient(etcd_endpoint)
    store = EtcdStore(client, prefix="lost-lease", timeout=datetime.timedelta(seconds=5))
    try:
        store.set("old", "gone with the lease")
        store.add("n", 5)
        lease_key = b"lost-lease\0lease"
        old_lease = int(client.get(lease_key).value)  # type: ignore[union-attr]
        client.lease_revoke(old_lease)
        assert not store.check(["old"])  # etcd deleted the namespace with its lease
        store.set("new", "1")  # the write finds the lease gone, renews it, retries
        assert store.add("n", 1) == 1
        assert store.compare_set("c", "", "x") == b"x"
        store.queue_push("q", "v")
        assert store.queue_pop("q") == b"v"
        new_lease = int(client.get(lease_key).value)  # type: ignore[union-attr]
        assert new_lease != old_lease
        assert client.get(b"lost-lease/new").lease == new_lease  # type: ignore[union-attr]
        assert sorted(store.list_keys()) == ["c", "n", "new"]
    finally:
        store.close()
        client.close()


def test_a_given_lease_carries_every_key_and_its_loss_is_an_error(etcd_endpoint: str) -> None:
    """EtcdStore(lease=L): keys ride on the caller's lease; the store records and
    refreshes nothing; once etcd drops L, writes fail clearly instead of renewing."""
    counter = RpcCounter()
    client = EtcdClient(etcd_endpoint, interceptors=[counter])
    lease = client.lease_grant(30)
    counter.reset()
    store = EtcdStore(client, prefix="given-lease", timeout=datetime.timedelta(seconds=5), lease=lease)
    try:
        assert counter.total() == 0  # opening the store cost no RPC
        store.set("k", "v")
        assert store.add("n", 2) == 2
        store.queue_push("q", "item")
        res = client.range(b"given-lease", prefix=True)
        assert {kv.lease for kv in res.kvs} == {lease}
        assert client.get(b"given-lease\0lease") is None
        client.lease_revoke(lease)
        assert not store.check(["k"])
        with pytest.raises(dist.DistStoreError, match="lease"):
            store.set("k2", "v")
    finally:
        store.close()
        client.close()
    with pytest.raises(ValueError, match="lease"):
        EtcdStore(etcd_endpoint, prefix="bad-lease", lease=0)


@pytest.mark.parametrize("threads", [16])
def test_one_store_shared_by_many_threads(etcd_endpoint: str, threads: int) -> None:
    with EtcdStore(etcd_endpoint, prefix="threads", timeout=datetime.timedelta(seconds=30)) as store:
        errors: list[BaseException] = []
        rounds = 10

        def work(i: int) -> None:
            try:
                for r in range(rounds):
                    store.set(f"t{i}/{r}", f"{i}:{r}")
                    store.add("total", 1)
                    store.append(f"log{i % 4}", f"{i},")
                    store.queue_push("jobs", f"{i}:{r}")
                    assert store.get(f"t{(i + 1) % threads}/{r}") == f"{(i + 1) % threads}:{r}".encode()
                    store.queue_pop("jobs")
                assert store.multi_get([f"t{i}/{r}" for r in range(rounds)]) == [
                    f"{i}:{r}".encode() for r in range(rounds)
                ]
                store.barrier("done", threads)
            except BaseException as e:  # reported below
                errors.append(e)

        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert not errors, errors[:3]
        assert store.get("total") == str(threads * rounds).encode()
        assert store.queue_len("jobs") == 0
        logs = b"".join(store.get(f"log{j}") for j in range(4))
        assert sorted(logs.decode().rstrip(",").split(",")) == sorted(
            str(i) for i in range(threads) for _ in range(rounds)
        )
