"""Nested EtcdStore namespaces are disjoint from the outer store's keys, and a store writes only
under its own prefix (issue 21 item 5, issue 23), against a real etcd."""

from __future__ import annotations

import datetime
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist
from helpers.watch_opened import WatchOpened

from etcd_server import AuthConfig, EtcdServer
from etcd_store import EtcdStore
from etcd_store.client import EtcdClient
from etcd_store.client.testing import RpcCounter

pytestmark = pytest.mark.etcd_matrix

TIMEOUT = datetime.timedelta(seconds=5)


@pytest.fixture
def nested(etcd_endpoint: str) -> Iterator[tuple[EtcdStore, EtcdStore, WatchOpened]]:
    """An outer store on ``<job>`` (its client signals watches) and an inner one on ``<job>/sub``
    holding a key, a counter (a thread marker), a chunked value and a queue item."""
    job = f"nest-{uuid.uuid4().hex[:8]}"
    opened = WatchOpened()
    outer_client = EtcdClient(etcd_endpoint, interceptors=[opened])
    inner_client = EtcdClient(etcd_endpoint)
    outer = EtcdStore(outer_client, prefix=job, timeout=TIMEOUT, chunk_bytes=1024)
    inner = EtcdStore(inner_client, prefix=f"{job}/sub", timeout=TIMEOUT, chunk_bytes=1024)
    try:
        inner.set("k", "v")
        inner.add("n", 1)
        inner.set("big", "x" * 5000)
        inner.queue_push("q", "item")
        yield outer, inner, opened
    finally:
        inner.close()
        outer.close()
        inner_client.close()
        outer_client.close()


def test_the_inner_namespace_is_not_a_key_or_queue_of_the_outer(
    nested: tuple[EtcdStore, EtcdStore, WatchOpened],
) -> None:
    outer, inner, _ = nested
    assert outer.check(["sub"]) is False
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        outer.wait(["sub"], datetime.timedelta(milliseconds=300))
    with pytest.raises(dist.QueueEmptyError):
        outer.queue_pop("sub", block=False)
    assert outer.queue_len("sub") == 0
    # As with PrefixStore, the inner store's user keys are the outer store's "sub/<key>".
    assert outer.list_keys() == ["sub/big", "sub/k", "sub/n"] and outer.num_keys() == 3
    assert outer.get("sub/k") == b"v" and outer.check(["sub/k"])
    assert inner.queue_pop("q") == b"item"  # untouched by the outer store


def test_a_waiting_outer_store_ignores_the_inner_stores_internal_writes(
    nested: tuple[EtcdStore, EtcdStore, WatchOpened],
) -> None:
    outer, inner, opened = nested
    opened.opened.clear()
    out: list[Any] = []

    def wait() -> None:
        try:
            outer.wait(["sub"], datetime.timedelta(seconds=20))
            out.append(None)
        except BaseException as e:  # handed to the test
            out.append(e)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    assert opened.opened.wait(5), "the wait never opened its watch"
    inner.add("n", 1)  # writes the inner thread marker ns/sub\0w/...
    inner.set("big", "y" * 5000)  # and inner chunks
    waiter.join(1.0)  # events arrive within milliseconds: a wake-up by them would end the wait
    assert waiter.is_alive() and out == [], out
    outer.set("sub", "now")  # the awaited key itself
    waiter.join(25)
    assert out == [None]


def test_a_store_writes_only_under_its_prefix(etcd_endpoint: str) -> None:
    team = f"/team-{uuid.uuid4().hex[:8]}"
    prefix = f"{team}/job/store"
    with EtcdClient(etcd_endpoint) as client:
        with EtcdStore(client, prefix=prefix, timeout=TIMEOUT, chunk_bytes=1024) as store:
            store.set("k", "v")
            store.add("n", 1)
            store.set("big", "x" * 5000)
            store.queue_push("q", "item")
            everything = client.range(b"\0", b"\0", keys_only=True).kvs
            mine = [kv.key for kv in everything if team.encode() in kv.key]
            assert mine, "the store wrote nothing"
            outside = [k for k in mine if not k.startswith(prefix.encode())]
            assert outside == []


@pytest.fixture
def limited_etcd(etcd_binary: str) -> Iterator[EtcdServer]:
    """etcd with auth: user ``job`` may read and write only the keys starting with ``/team-x/job/store``."""
    auth = AuthConfig("r00t-nest-pw", user="job", password="j0b-pw", prefix=b"/team-x/job/store")
    with EtcdServer(binary=etcd_binary, auth=auth) as server:
        yield server


def test_a_role_limited_to_the_prefix_runs_the_store_without_denials(limited_etcd: EtcdServer) -> None:
    counter = RpcCounter()
    with EtcdClient(limited_etcd.get_endpoint(), user="job", password="j0b-pw",  # loopback: no TLS here
                    allow_insecure_auth=True, interceptors=[counter]) as client:
        with EtcdStore(client, prefix="/team-x/job/store", timeout=TIMEOUT, chunk_bytes=1024) as store:
            assert counter.snapshot().get("KV/Txn") == 1  # the lease record, without a denied first try
            store.set("k", "v")
            assert store.add("n", 2) == 2
            store.set("big", "x" * 5000)
            assert store.get("big") == b"x" * 5000
            store.queue_push("q", "item")
            assert store.queue_pop("q") == b"item"
            assert store.num_keys() == 3
        assert client.stats.snapshot().errors == {}  # no permission denied, nothing retried
