"""The start transition's Txns against a real etcd (etcd_rdzv/native/start.py; docs/etcd-v3-design.md,
"Start"): the two fences of the ack and the put-once fate, each of which the "same fate for every
member" argument rests on. ``decide`` alone is unit-tested (tests/unit/test_native_start.py); these
fail if a compare is dropped from ``acknowledge`` or ``settle``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest

from etcd_rdzv.native import start
from etcd_rdzv.native.records import RunKeys
from etcd_server import EtcdServer
from etcd_store.client import EtcdClient

pytestmark = [pytest.mark.timeout(60)]

_runs = itertools.count()


@pytest.fixture
def run(etcd_server: EtcdServer) -> Iterator[tuple[EtcdClient, RunKeys, int]]:
    """A client, the keys of a fresh run, and a lease standing in for the run lease."""
    keys = RunKeys.for_run(f"/v3start{time.monotonic_ns() % 10**9}", f"r{next(_runs)}")
    with EtcdClient(etcd_server.get_endpoint(), timeout=10) as client:
        lease = client.lease_grant(30)
        try:
            yield client, keys, lease
        finally:
            client.lease_revoke(lease)


def _join(client: EtcdClient, keys: RunKeys, node: str, lease: int) -> None:
    client.put(keys.join_key(1, node), b"{}", lease=lease)


def test_a_member_whose_join_key_is_gone_cannot_ack(run: tuple[EtcdClient, RunKeys, int]) -> None:
    """Fenced on its own key: a member whose key went before its ack never counts, so W acks are not
    reached and the round is voided rather than started with it."""
    client, keys, lease = run
    _join(client, keys, "a", lease)  # b named by the seal, its key already gone
    read = start.acknowledge(client, keys, 1, "b", lease)
    assert client.get(keys.ack(1, "b")) is None
    assert (read.acks, read.present, read.mine, read.start) == (0, 1, False, None)
    assert start.decide(read, 2) is start.Fate.PUT_VOID
    read = start.acknowledge(client, keys, 1, "a", lease)  # a's own ack goes through
    assert client.get(keys.ack(1, "a")) is not None and (read.acks, read.mine) == (1, True)


def test_no_ack_after_the_fate(run: tuple[EtcdClient, RunKeys, int]) -> None:
    """Fenced on an undecided fate: once void is put, a late ack adds nothing, so the acks can never
    reach W after a void."""
    client, keys, lease = run
    for node in ("a", "b"):
        _join(client, keys, node, lease)
    assert start.settle(client, keys, 1, start.VOID, lease) == start.VOID
    read = start.acknowledge(client, keys, 1, "a", lease)
    assert client.get(keys.ack(1, "a")) is None
    assert (read.acks, read.start) == (0, start.VOID)
    assert start.decide(read, 2) is start.Fate.VOIDED


def test_the_fate_is_put_once(run: tuple[EtcdClient, RunKeys, int]) -> None:
    """The first fate stands: a member that decided go after another put void gets void back (and the
    stored key keeps its first version)."""
    client, keys, lease = run
    assert start.settle(client, keys, 1, start.VOID, lease) == start.VOID
    assert start.settle(client, keys, 1, start.GO, lease) == start.VOID
    kv = client.get(keys.start(1))
    assert kv is not None and (kv.value, kv.version) == (start.VOID, 1)
