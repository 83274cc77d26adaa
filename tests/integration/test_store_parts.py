"""The store's parts, each built alone from what its constructor asks for (a client, a layout,
the parts it calls), on a real etcd, without an :class:`~etcd_store.EtcdStore` around them."""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from etcd_store._namespace import ChunkedValues, GivenLease, Layout, StoreTimeout, gen_of
from etcd_store._waits import Waits
from etcd_store._writes import ReadModifyWrite
from etcd_store.client import EtcdClient

TIMEOUT = StoreTimeout(lambda: datetime.timedelta(seconds=10))


@pytest.fixture
def client(etcd_endpoint: str) -> Iterator[EtcdClient]:
    c = EtcdClient(etcd_endpoint)
    yield c
    c.close()


@pytest.fixture
def layout() -> Layout:
    return Layout(f"parts/{uuid.uuid4().hex[:8]}")


def test_chunked_values_round_trip_and_clean_up_alone(client: EtcdClient, layout: Layout) -> None:
    lease = client.lease_grant(30)
    values = ChunkedValues(client, layout, 1024, TIMEOUT)
    big = bytes(range(256)) * 20  # 5120 bytes: 5 chunks
    deadline = time.monotonic() + 10
    stored = values.encode(big, lease, deadline)
    assert not values.inline(big) and gen_of(stored) is not None
    k = layout.key("big")
    client.put(k, stored, lease=lease)
    kv = client.get(k)
    assert kv is not None and values.decode(kv, deadline) == big
    chunks = layout.chunk_prefix(gen_of(stored) or "")
    assert client.range(chunks, prefix=True, count_only=True).count == 5
    values.drop_replaced(kv)
    assert client.range(chunks, prefix=True, count_only=True).count == 0
    client.lease_revoke(lease)


def test_read_modify_write_alone_adds_and_compares_exactly_once(client: EtcdClient, layout: Layout) -> None:
    lease = client.lease_grant(30)
    values = ChunkedValues(client, layout, 1024, TIMEOUT)
    writes = ReadModifyWrite(client, layout, values, GivenLease(lease), TIMEOUT)
    k = layout.key("n")
    assert writes.add(k, 2, "n")[0] == 2
    assert writes.add(k, 3, "n")[0] == 5
    assert writes.compare_set(k, b"4", b"9") == b"5"  # a mismatch returns the value
    assert writes.compare_set(k, b"5", b"9") == b"9"
    kv = client.get(k)
    assert kv is not None and kv.value == b"9" and kv.lease == lease
    writes.append(k, b"x")
    with pytest.raises(dist.DistStoreError, match="not an integer"):
        writes.add(k, 1, "n")
    client.lease_revoke(lease)


def test_waits_alone_wake_on_a_write_and_time_out_on_none(client: EtcdClient, layout: Layout) -> None:
    waits = Waits(client, layout)
    k = layout.key("late")
    writer = threading.Timer(0.2, lambda: client.put(k, b"v"))
    writer.start()
    try:
        waits.wait_keys([k], 10.0, ["late"])
    finally:
        writer.join()
    assert waits.probe([k], 5.0)[0] == {k}
    with pytest.raises(dist.DistStoreError, match=r"wait timeout after 200ms, keys: .*/never"):
        waits.wait_keys([layout.key("never")], 0.2, ["never"])
