"""EtcdRendezvousBackend: torch's RendezvousBackend contract, against every etcd of the matrix (3.7, 3.6,
3.5, 3.4): opaque state bytes, fencing tokens, one RPC per call, expiry, an unreachable etcd."""

from __future__ import annotations

import base64
import itertools
import pickle
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from helpers.ports import closed_port
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    _NodeDesc,
    _RendezvousState,
)

from etcd_rdzv import EtcdRendezvousBackend
from etcd_store.client import EtcdClient
from etcd_store.client.testing import RpcCounter

#: The backend contract runs on every etcd version of the matrix.
pytestmark = pytest.mark.etcd_matrix

_ids = itertools.count()


def st(tag: str) -> bytes:
    """A state as torch's handler pickles it, told apart by ``tag``."""
    state = _RendezvousState()
    state.participants = {_NodeDesc(tag, 1, 0): 0}
    return pickle.dumps(state)


@pytest.fixture
def run_id() -> str:
    return f"backend-run-{next(_ids)}"


@pytest.fixture(scope="module")
def counter() -> RpcCounter:
    return RpcCounter()


@pytest.fixture(scope="module")
def client(etcd_endpoint: str, counter: RpcCounter) -> Iterator[EtcdClient]:
    c = EtcdClient(etcd_endpoint, timeout=5, interceptors=[counter])
    yield c
    c.close()


@pytest.fixture
def backend(client: EtcdClient, run_id: str) -> EtcdRendezvousBackend:
    return EtcdRendezvousBackend(client, run_id, key_prefix="/test/rdzv")




# ------------------------------------------------------------------ torch's documented contract
# torch's RendezvousBackend docstrings: the state is opaque bytes ("the encoded rendezvous state");
# set_state writes when the token matches, or when it is None and no state exists, and otherwise
# returns the existing state with its token and False. Checked here with bytes that are no pickle.

OPAQUE = {
    "x": b"x",
    "empty": b"",
    "every byte": bytes(range(256)),
    "a pickle that is no state": pickle.dumps({"round": 1}),
    "a broken pickle": b"\x80\x04junk",
}


@pytest.mark.parametrize("state", list(OPAQUE.values()), ids=list(OPAQUE))
def test_contract_get_state_returns_the_bytes_set(backend: EtcdRendezvousBackend, state: bytes) -> None:
    created = backend.set_state(state)
    assert created is not None
    assert created == (state, created[1], True)
    assert backend.get_state() == (state, created[1])


def test_contract_set_state_with_token_none_returns_the_current_state(backend: EtcdRendezvousBackend) -> None:
    first = backend.set_state(b"x")
    assert first is not None
    assert backend.set_state(b"y") == (b"x", first[1], False)
    assert backend.set_state(b"y", None) == (b"x", first[1], False)
    assert backend.get_state() == (b"x", first[1])


def test_contract_set_state_with_an_old_token_returns_the_current_state(backend: EtcdRendezvousBackend) -> None:
    first = backend.set_state(b"x")
    assert first is not None
    second = backend.set_state(b"y", first[1])
    assert second is not None and second[:1] == (b"y",) and second[2] is True and second[1] != first[1]
    assert backend.set_state(b"z", first[1]) == (b"y", second[1], False)
    assert backend.get_state() == (b"y", second[1])


def test_contract_set_state_with_a_foreign_token_returns_the_current_state(
    client: EtcdClient, backend: EtcdRendezvousBackend, run_id: str
) -> None:
    other = EtcdRendezvousBackend(client, f"{run_id}-other", key_prefix="/test/rdzv")
    mine = backend.set_state(b"x")
    theirs = other.set_state(b"other")
    assert mine is not None and theirs is not None
    assert backend.set_state(b"z", theirs[1]) == (b"x", mine[1], False)  # another key's token
    assert backend.get_state() == (b"x", mine[1])
    assert other.get_state() == (b"other", theirs[1])


@pytest.mark.parametrize("token", ["invalid", object(), 3.5j, -1, 2**70], ids=["text", "object", "complex", "-1", "2**70"])
def test_contract_set_state_with_an_invalid_token_returns_the_current_state(
    backend: EtcdRendezvousBackend, token: object
) -> None:
    first = backend.set_state(b"x")
    assert first is not None
    assert backend.set_state(b"y", token) == (b"x", first[1], False)
    assert backend.get_state() == (b"x", first[1])


# ------------------------------------------------------------------ basics


def test_is_a_torch_backend_with_the_requested_name(client: EtcdClient) -> None:
    assert isinstance(EtcdRendezvousBackend(client, "r"), RendezvousBackend)
    assert EtcdRendezvousBackend(client, "r").name == "etcd-v2"
    assert EtcdRendezvousBackend(client, "r", name="etcd").name == "etcd"


def test_empty_run_id_is_rejected(client: EtcdClient) -> None:
    with pytest.raises(ValueError, match="run id"):
        EtcdRendezvousBackend(client, "")


def test_no_state_yields_none(backend: EtcdRendezvousBackend) -> None:
    assert backend.get_state() is None


def test_state_key_is_prefix_slash_run_id_and_holds_base64(
    client: EtcdClient, backend: EtcdRendezvousBackend, run_id: str
) -> None:
    backend.set_state(st("state"))
    kv = client.get(f"/test/rdzv/{run_id}".encode())
    assert kv is not None
    assert base64.b64decode(kv.value) == st("state")
    # No prefix: the key is the run id itself (as torch's backend).
    bare = EtcdRendezvousBackend(client, f"{run_id}-bare", key_prefix="")
    bare.set_state(st("x"))
    assert client.get(f"{run_id}-bare".encode()) is not None
    client.delete(f"{run_id}-bare".encode())


def test_create_then_update_with_token(backend: EtcdRendezvousBackend) -> None:
    created = backend.set_state(st("one"))
    assert created is not None
    state, token, has_set = created
    assert (state, has_set) == (st("one"), True)
    assert backend.get_state() == (st("one"), token)

    updated = backend.set_state(st("two"), token)
    assert updated is not None
    assert updated[0] == st("two") and updated[2] is True
    assert updated[1] != token
    assert backend.get_state() == (st("two"), updated[1])


def test_create_without_token_when_state_exists_returns_current(
    backend: EtcdRendezvousBackend,
) -> None:
    first = backend.set_state(st("first"))
    assert first is not None
    assert backend.set_state(st("second")) == (st("first"), first[1], False)
    assert backend.get_state() == (st("first"), first[1])


def test_stale_token_returns_current_state_unchanged(backend: EtcdRendezvousBackend) -> None:
    first = backend.set_state(st("a"))
    assert first is not None
    second = backend.set_state(st("b"), first[1])
    assert second is not None and second[2]
    # A node still holding the first token loses and learns the current state.
    assert backend.set_state(st("c"), first[1]) == (st("b"), second[1], False)
    assert backend.get_state() == (st("b"), second[1])


@pytest.mark.parametrize("token", ["not-a-number", object(), 3.5j])
def test_unparsable_token_returns_current_state(
    backend: EtcdRendezvousBackend, token: object
) -> None:
    assert backend.set_state(st("x"), token) is None  # no state: nothing written, None
    assert backend.get_state() is None
    created = backend.set_state(st("y"))
    assert created is not None
    assert backend.set_state(st("z"), token) == (st("y"), created[1], False)


def test_token_of_a_state_that_is_gone_yields_none(
    client: EtcdClient, backend: EtcdRendezvousBackend
) -> None:
    created = backend.set_state(st("x"))
    assert created is not None
    client.delete(backend.key.encode())
    assert backend.set_state(st("y"), created[1]) is None
    assert backend.get_state() is None


def test_corrupt_state_raises_state_error(
    client: EtcdClient, backend: EtcdRendezvousBackend
) -> None:
    client.put(backend.key.encode(), b"%%% not base64 %%%")
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.get_state()
    # set_state's failure branch returns the same corrupt value.
    with pytest.raises(RendezvousStateError):
        backend.set_state(st("x"))
    with pytest.raises(RendezvousStateError):
        backend.set_state(st("x"), 1)


def test_concurrent_creators_exactly_one_wins(client: EtcdClient, run_id: str) -> None:
    backends = [EtcdRendezvousBackend(client, run_id, key_prefix="/test/rdzv") for _ in range(8)]
    results: list[tuple[bytes, object, bool] | None] = [None] * len(backends)
    start = threading.Barrier(len(backends))

    def create(i: int) -> None:
        start.wait()
        results[i] = backends[i].set_state(st(f"node-{i}"))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(len(backends))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(r is not None for r in results)
    winners = [r for r in results if r is not None and r[2]]
    assert len(winners) == 1
    # Every loser learnt the winner's state and token.
    assert {(r[0], r[1]) for r in results if r is not None} == {(winners[0][0], winners[0][1])}


# ------------------------------------------------------------------ round trips


def test_each_call_is_one_rpc(
    client: EtcdClient, counter: RpcCounter, backend: EtcdRendezvousBackend
) -> None:
    counter.reset()
    assert backend.get_state() is None
    assert counter.snapshot() == {"KV/Range": 1}

    counter.reset()
    created = backend.set_state(st("a"))  # first write of this backend: takes its lease
    assert created is not None
    assert counter.snapshot() == {"Lease/LeaseGrant": 1, "KV/Txn": 1}

    counter.reset()
    updated = backend.set_state(st("b"), created[1])
    stale = backend.set_state(st("c"), created[1])
    assert updated is not None and updated[2]
    assert stale is not None and not stale[2]
    assert counter.snapshot() == {"KV/Txn": 2}


# ------------------------------------------------------------------ expiry


def test_state_expires_ttl_after_last_write_and_not_while_written(
    client: EtcdClient, run_id: str
) -> None:
    ttl = 2
    backend = EtcdRendezvousBackend(client, run_id, key_prefix="/test/rdzv", ttl=ttl)
    key = backend.key.encode()
    with client.watch(key) as watch:
        assert watch.wait_created(5)
        created = backend.set_state(st("s0"))
        assert created is not None
        token = created[1]
        # Keep writing for longer than two lease lifetimes (1.5 x ttl each): the
        # backend must move to fresh leases and the key must never disappear.
        until = time.monotonic() + 2 * 1.5 * ttl + 1
        i = 0
        while time.monotonic() < until:
            i += 1
            result = backend.set_state(st(f"s{i}"), token)
            assert result is not None and result[2], f"write {i} lost: {result}"
            token = result[1]
            events = watch.get(timeout=0.5)
            assert all(e.type == "PUT" for e in events), "state expired while being written"
        last_write = time.monotonic()
        deleted_at = None
        deadline = last_write + 1.5 * ttl + 5
        while deleted_at is None and time.monotonic() < deadline:
            if any(e.type == "DELETE" for e in watch.get(timeout=deadline - time.monotonic())):
                deleted_at = time.monotonic()
    assert deleted_at is not None, "state did not expire after the writes stopped"
    assert deleted_at - last_write >= ttl - 0.5  # never before state_ttl after the last write
    assert backend.get_state() is None


def test_revoked_lease_is_replaced(client: EtcdClient, backend: EtcdRendezvousBackend) -> None:
    created = backend.set_state(st("a"))
    assert created is not None
    kv = client.get(backend.key.encode())
    assert kv is not None and kv.lease != 0
    # Move the key to another lease, then revoke ours: the next write must not fail.
    other = client.lease_grant(60)
    client.put(backend.key.encode(), base64.b64encode(st("moved")), lease=other)
    client.lease_revoke(kv.lease)
    current = backend.get_state()
    assert current is not None
    result = backend.set_state(st("b"), current[1])
    assert result is not None and result[2]
    kv2 = client.get(backend.key.encode())
    assert kv2 is not None and kv2.lease not in (0, kv.lease, other)
    client.lease_revoke(other)


# ------------------------------------------------------------------ unreachable etcd


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A TCP port that accepts connections and never answers (a hung etcd)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                accepted.append(conn)
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(2)
    for conn in accepted:
        conn.close()
    server.close()


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_unreachable_etcd_raises_connection_error_within_read_timeout(
    kind: str, request: pytest.FixtureRequest
) -> None:
    endpoint = (
        f"127.0.0.1:{closed_port()}" if kind == "refused" else request.getfixturevalue("silent_endpoint")
    )
    read_timeout = 1.0
    with EtcdClient(endpoint, timeout=read_timeout) as dead:
        backend = EtcdRendezvousBackend(dead, "unreachable")
        for call in (backend.get_state, lambda: backend.set_state(st("x")), lambda: backend.set_state(st("x"), 5)):
            started = time.monotonic()
            with pytest.raises(RendezvousConnectionError, match=endpoint):
                call()
            assert time.monotonic() - started < read_timeout + 2.0
