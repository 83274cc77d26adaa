"""EtcdStore under compaction and lost replies (issue 21), against a real etcd.

Lost replies come from :class:`helpers.lost_replies.LostReplies` (the request commits in etcd, the
caller gets UNAVAILABLE and the client resends); compaction from :func:`helpers.lost_replies.compact`
at the current revision. Calls that could spin run in a thread joined with a bound, so a regression
fails instead of hanging the suite.
"""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist
from etcd3.etcdrpc import rpc_pb2
from helpers.lost_replies import LostReplies, compact, txn_puts_key, writes_key

from etcd_store import EtcdStore
from etcd_store._namespace import Manifest
from etcd_store.client import EtcdClient

pytestmark = pytest.mark.etcd_matrix

TIMEOUT = datetime.timedelta(seconds=3)
CHUNK = 1024
BIG = bytes(range(256)) * 20  # 5120 bytes: 5 chunks of 1 KiB


def _bounded(fn: Callable[[], Any], limit: float = 15.0) -> tuple[Any, float]:
    """``fn()`` in a thread; (its result or exception, seconds taken). Fails if it runs past ``limit``."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # handed to the test
            out.append(e)

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    took = time.monotonic() - start
    assert not thread.is_alive(), f"the call was still running after {limit} s"
    return out[0], took


class Stores:
    """Stores on one fresh prefix, each with its own client; the first one's client loses replies."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.prefix = f"faults/{uuid.uuid4().hex[:8]}"
        self.lost = LostReplies()
        self._clients: list[EtcdClient] = []
        self._stores: list[EtcdStore] = []

    def open(self, *, lossy: bool = False, prefix: str | None = None, **kwargs: Any) -> EtcdStore:
        client = EtcdClient(self.endpoint, interceptors=[self.lost] if lossy else [])
        self._clients.append(client)
        kwargs.setdefault("timeout", TIMEOUT)
        kwargs.setdefault("chunk_bytes", CHUNK)
        store = EtcdStore(client, prefix=self.prefix if prefix is None else prefix, **kwargs)
        self._stores.append(store)
        return store

    def close(self) -> None:
        for store in self._stores:
            store.close()
        for client in self._clients:
            client.close()


@pytest.fixture
def stores(etcd_endpoint: str) -> Iterator[Stores]:
    made = Stores(etcd_endpoint)
    try:
        yield made
    finally:
        made.close()


# ------------------------------------------------------------------ 1. chunked values and compaction


def test_chunked_values_are_readable_after_compaction(stores: Stores) -> None:
    writer, reader = stores.open(), stores.open()
    writer.set("big", BIG)
    writer.set("big2", BIG[::-1])
    writer.set("log", BIG)
    compact(stores.endpoint)
    got, took = _bounded(lambda: reader.get("big"))
    assert got == BIG, got
    got, _ = _bounded(lambda: reader.multi_get(["big", "big2"]))
    assert got == [BIG, BIG[::-1]], got
    got, _ = _bounded(lambda: reader.compare_set("big", BIG, "small"))
    assert got == b"small", got
    got, _ = _bounded(lambda: reader.append("log", b"+tail"))
    assert not isinstance(got, BaseException), got
    assert reader.get("log") == BIG + b"+tail"


def test_a_chunked_queue_item_survives_compaction(stores: Stores) -> None:
    pusher, popper = stores.open(), stores.open()
    pusher.queue_push("q", BIG)
    pusher.set("later", "x")  # the item's revision is now below the compaction point
    compact(stores.endpoint)
    got, _ = _bounded(lambda: popper.queue_pop("q"))
    assert got == BIG, got


def test_a_manifest_without_chunks_fails_within_the_timeout(stores: Stores) -> None:
    store = stores.open()
    store.set("k", "v")  # creates the namespace lease
    broken = Manifest("0" * 32, 2, 2048).encode()  # names a generation that was never written
    store.client.put(f"{stores.prefix}/k".encode(), broken)
    for call in (lambda: store.get("k"), lambda: store.multi_get(["k"]), lambda: store.append("k", "x"),
                 lambda: store.compare_set("k", "v", "w")):
        got, took = _bounded(call)
        assert isinstance(got, dist.DistStoreError), got
        assert "k" in str(got) and "chunk" in str(got), got
        assert took < TIMEOUT.total_seconds() + 2, took


# ------------------------------------------------------------------ 2, 3. writes resent after a lost reply


def test_a_resent_queue_push_is_popped_once(stores: Stores) -> None:
    pusher, popper = stores.open(lossy=True), stores.open()
    popped: list[bytes] = []
    rule = stores.lost.lose(
        "KV/Txn", txn_puts_key(lambda key: b"\0q" in key),
        then=lambda: popped.append(popper.queue_pop("q", block=False)),  # popped before the resend
    )
    pusher.queue_push("q", "once")
    assert rule.fired == 1 and popped == [b"once"]
    with pytest.raises(dist.QueueEmptyError):
        popper.queue_pop("q", block=False)
    assert popper.queue_len("q") == 0


def test_a_resent_write_does_not_undo_a_later_writer(stores: Stores) -> None:
    lossy, other = stores.open(lossy=True), stores.open()
    key = f"{stores.prefix}/k".encode()
    stores.lost.lose("KV/", writes_key(lambda k: k == key), then=lambda: other.set("k", "later"))
    lossy.set("k", "first")
    assert other.get("k") == b"later"  # last writer wins, as in TCPStore
    stores.lost.lose("KV/", writes_key(lambda k: k == key), then=lambda: other.set("k", "again"))
    assert lossy.delete_key("k") is True
    assert other.get("k") == b"again"
    stores.lost.lose("KV/", writes_key(lambda k: k == key), then=lambda: other.set("k", "third"))
    lossy.multi_set(["k", "j"], ["batch", "batch"])
    assert other.multi_get(["k", "j"]) == [b"third", b"batch"]


def test_a_resent_chunked_set_keeps_the_other_writers_chunks(stores: Stores) -> None:
    lossy, other, reader = stores.open(lossy=True), stores.open(), stores.open()
    key = f"{stores.prefix}/big".encode()
    stores.lost.lose("KV/", writes_key(lambda k: k == key), then=lambda: other.set("big", BIG[::-1]))
    lossy.set("big", BIG)
    got, _ = _bounded(lambda: reader.get("big"))
    assert got == BIG[::-1], got


def test_compare_set_keeps_its_chunks_when_it_times_out_after_committing(stores: Stores) -> None:
    lossy, reader = stores.open(lossy=True), stores.open()
    key = f"{stores.prefix}/cs".encode()
    # The first send commits and its reply is lost; no resend reaches etcd until the deadline.
    rule = stores.lost.lose("KV/Txn", txn_puts_key(lambda k: k == key))
    cut = stores.lost.lose("KV/Txn", txn_puts_key(lambda k: k == key), times=10_000, send=False)
    got, took = _bounded(lambda: lossy.compare_set("cs", "", BIG))
    stores.lost.clear()
    assert rule.fired == 1 and cut.dropped >= 1
    assert isinstance(got, dist.DistError), got  # the outcome is unknown to the caller
    reader.set("after", "x")
    compact(stores.endpoint)  # deleted chunks would now be gone from history too
    got, _ = _bounded(lambda: reader.get("cs"))
    assert got == BIG, got  # it was committed: its chunks are there


def _reads_chunks_of(key: bytes) -> Callable[[Any], bool]:
    """A ``match`` for ``"KV/Txn"``: the read of a chunked value guarded by ``key``'s mod revision."""

    def match(request: Any) -> bool:
        return (isinstance(request, rpc_pb2.TxnRequest) and not any(op.request_put.key for op in request.success)
                and any(c.key == key and c.target == rpc_pb2.Compare.MOD for c in request.compare))

    return match


def test_compare_set_from_empty_creates_a_key_deleted_while_its_chunked_value_was_read(stores: Stores) -> None:
    """Found by the linearizability checker (seed 1, 10,000 ops): ``compare_set(k, "", v)`` on a chunked
    value deleted between the failed create and the read of its chunks returned ``b""`` (the expected
    value) instead of creating ``k`` as TCPStore does for a missing key and an empty expected value."""
    lossy, other = stores.open(lossy=True), stores.open()
    other.set("big", BIG)
    key = f"{stores.prefix}/big".encode()
    rule = stores.lost.meddle("KV/Txn", _reads_chunks_of(key), lambda: other.delete_key("big"))
    got, _ = _bounded(lambda: lossy.compare_set("big", "", "mine"))
    assert rule.fired == 1
    assert got == b"mine", got
    assert other.get("big") == b"mine"


# ------------------------------------------------------------------ 4. the namespace lease record


def test_a_resent_lease_record_keeps_the_namespace_lease(stores: Stores) -> None:
    lease_key = stores.prefix.encode() + b"\0lease"
    others: list[EtcdStore] = []

    def another_store_writes() -> None:  # adopts the lease just recorded and writes under it
        others.append(stores.open())
        others[0].set("k", "v")

    rule = stores.lost.lose("KV/Txn", txn_puts_key(lambda k: k == lease_key), then=another_store_writes)
    first = stores.open(lossy=True)
    assert rule.fired == 1
    assert others[0].check(["k"]), "the key written under the recorded lease was deleted"
    first.set("k2", "v2")
    recorded = first.client.get(lease_key)
    assert recorded is not None
    assert first.client.lease_time_to_live(int(recorded.value)) > 0


def test_a_resent_queue_pop_survives_a_compaction_in_between(stores: Stores) -> None:
    pusher, popper = stores.open(), stores.open(lossy=True)
    pusher.queue_push("q", "item")
    stores.lost.lose("KV/Txn", txn_puts_key(lambda k: b"\0q" in k), then=lambda: compact(stores.endpoint))
    got, _ = _bounded(lambda: popper.queue_pop("q", block=False))
    assert got == b"item", got


# ------------------------------------------------------------------ 6. a resent lease grant


def test_a_resent_lease_grant_leaks_no_lease(stores: Stores) -> None:
    rule = stores.lost.lose("Lease/LeaseGrant")
    store = stores.open(lossy=True)
    assert rule.fired == 1
    lost_id = int(rule.replies[0].ID)  # the lease etcd granted for the send whose reply was lost
    recorded = store.client.get(stores.prefix.encode() + b"\0lease")
    assert recorded is not None
    leaked = int(recorded.value) != lost_id and store.client.lease_time_to_live(lost_id) > 0
    assert not leaked, f"lease {lost_id:x} was granted, never used and left alive"


# ------------------------------------------------------------------ 6. contention within the deadline


def test_contended_read_modify_writes_end_within_the_timeout(stores: Stores) -> None:
    lossy, other = stores.open(lossy=True), stores.open()
    other.set("hot", "0")
    other.set("empty", "")
    def race(name: str, value: str) -> None:
        """Another writer changes ``name`` just before every Txn of the caller on it reaches etcd."""
        key = f"{stores.prefix}/{name}".encode()
        stores.lost.meddle("KV/Txn", txn_puts_key(lambda k: k == key), lambda: other.set(name, value),
                           times=100_000)

    race("hot", "7")
    race("empty", "")
    for call in (lambda: lossy.add("hot", 1), lambda: lossy.compare_set("empty", "", "mine")):
        got, took = _bounded(call)
        assert isinstance(got, dist.DistError) and "within" in str(got), got
        assert took < TIMEOUT.total_seconds() + 3, took
