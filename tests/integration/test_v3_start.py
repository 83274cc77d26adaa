"""The start transition's Txns against a real etcd (etcd_rdzv/native/start.py; docs/etcd-v3-design.md,
"Start"): the two fences of the ack and the put-once fate, each of which the "same fate for every
member" argument rests on. ``decide`` alone is unit-tested (tests/unit/test_native_start.py); these
fail if a compare is dropped from ``acknowledge`` or ``settle``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from etcd_rdzv.native import start
from etcd_rdzv.native.records import RunKeys
from etcd_server import EtcdServer
from etcd_store.client import EtcdClient
from etcd_store.client.testing import WatchTap

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


def _until_acked(client: EtcdClient, keys: RunKeys, round_: int, node: str, timeout: float = 10.0) -> None:
    """Return once ``node``'s ack of ``round_`` is stored (a watch on it, opened before the first look)."""
    with client.watch(keys.ack(round_, node)) as watch:
        deadline = time.monotonic() + timeout
        while client.get(keys.ack(round_, node)) is None:
            assert time.monotonic() < deadline, f"{node} never acked round {round_}"
            watch.get(timeout=deadline - time.monotonic())


def test_a_member_hears_the_fate_and_the_departures_of_its_round_not_the_acks(
        run: tuple[EtcdClient, RunKeys, int]) -> None:
    """Claim (design "Start"; ``start_round``): a member waiting for the fate of round T watches exactly
    ``[ctl/, join/T+1/)``: the fate's copy ``ctl/fate`` and the join keys of T (a departure), not the
    acks nor the newcomers of T + 1. (tests/unit/test_native_start.py checks that order of the keys, not
    what ``start_round`` watches.) Round 1: a waits, b's join key goes; a hears it and voids the round.
    Round 2: a waits, four newcomers join round 3, b acks and puts go; a's watch delivered the fate
    alone, and a starts (before: a heard every newcomer's join, and looked again at each)."""
    client, keys, lease = run
    for round_, go in ((1, False), (2, True)):
        for node in ("a", "b"):
            client.put(keys.join_key(round_, node), b"{}", lease=lease)
        tap = WatchTap(client)
        with ThreadPoolExecutor(1) as pool:
            fate = pool.submit(start.start_round, tap, keys, round_, 2, "a", lease,  # type: ignore[arg-type]
                               time.monotonic() + 10.0)
            _until_acked(client, keys, round_, "a")
            if go:
                for newcomer in range(4):
                    client.put(keys.join_key(round_ + 1, f"new{newcomer}"), b"{}", lease=lease)
                assert start.decide(start.acknowledge(client, keys, round_, "b", lease), 2) is start.Fate.PUT_GO
                assert start.settle(client, keys, round_, start.GO, lease) == start.GO
            else:
                client.delete(keys.join_key(round_, "b"))
            assert fate.result(timeout=15) is go
        heard = [(ev.type, ev.kv.key) for ev in tap.events()]
        if go:
            assert heard == [("PUT", keys.fate)], heard  # no ack (a's own, b's), no newcomer reached a
        else:
            assert heard == [("DELETE", keys.join_key(round_, "b"))], heard
        [watch] = tap.watches
        assert (watch.key, watch.range_end) == keys.start_watch_range(round_)


def test_an_abort_ends_the_start_wait(run: tuple[EtcdClient, RunKeys, int]) -> None:
    """``etcd-rdzv close`` while a member waits for a confirmation that will not come (a member named
    but silent): the wait ends at the abort's event with RunClosed, not after the dead member's TTL
    (before: the start watch did not cover ``ctl/``; a member waited 14.3 s with read_timeout 5)."""
    from etcd_rdzv.native import protocol
    from etcd_rdzv.native.records import RunClosed

    client, keys, lease = run
    for node in ("a", "b"):
        _join(client, keys, node, lease)
    with ThreadPoolExecutor(1) as pool:
        fate = pool.submit(start.start_round, client, keys, 1, 2, "a", lease, time.monotonic() + 30.0)
        _until_acked(client, keys, 1, "a")
        aborted = time.monotonic()
        assert protocol.abort(client, keys, lease).aborted
        with pytest.raises(RunClosed, match="aborted"):
            fate.result(timeout=10)
        assert time.monotonic() - aborted < 2.0


def test_a_node_whose_key_the_seal_did_not_name_never_starts(run: tuple[EtcdClient, RunKeys, int]) -> None:
    """Identity by etcd in the start barrier: a node that believes it is a member but whose key is not
    the one named (it was evicted, and its key put again since: another create revision) cannot ack,
    and a go decided by the members is not its round (Fate.OUT). Before, start.decide returned STARTED
    on a go without looking at the node's own key or ack."""
    client, keys, lease = run
    for node in ("a", "b"):
        _join(client, keys, node, lease)
    named = client.get(keys.join_key(1, "a"))
    assert named is not None
    client.delete(keys.join_key(1, "a"))
    _join(client, keys, "a", lease)  # a's key again: a new create revision
    read = start.acknowledge(client, keys, 1, "a", lease, named.create_revision)
    assert client.get(keys.ack(1, "a")) is None and not read.mine
    client.put(keys.ack(1, "x"), b"")
    client.put(keys.ack(1, "y"), b"")
    assert start.settle(client, keys, 1, start.GO, lease) == start.GO  # the named members' go
    assert start.decide(start.look(client, keys, 1, "a", named.create_revision), 2) is start.Fate.OUT
