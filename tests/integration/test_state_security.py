"""A hostile or malformed value at an etcd-v2 run's state key (``<key_prefix>/<run_id>``), against a
real etcd: the handler, created as torchrun creates it, refuses it with ``RendezvousStateError`` naming
the key, and what the pickle names never runs (issue 23, item 1). The backend returns the stored bytes
as they are (torch's contract, issue 29); the refusal comes from the handler's state holder, which
hands torch a state built from the checked values, never the stored bytes (issue 32)."""

from __future__ import annotations

import base64
import itertools
import json
import pickle
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from helpers.v2_pickles import colliding_nodes, no_build, torch_state, two_builds
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from etcd_rdzv import EtcdRendezvousBackend, EtcdRendezvousHandler
from etcd_rdzv.cli import main as cli
from etcd_store.client import EtcdClient

pytestmark = [pytest.mark.timeout(120), pytest.mark.etcd_matrix("3.6")]  # issue 23: each finding on etcd 3.7 and 3.6

_ids = itertools.count()
PREFIX = "/sec/rdzv"


class _Reduce:
    """Pickles as ``open(path, 'w')``: unpickling it creates ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def client(etcd_endpoint: str) -> Iterator[EtcdClient]:
    c = EtcdClient(etcd_endpoint, timeout=5)
    yield c
    c.close()


@pytest.fixture
def handler(etcd_endpoint: str) -> Iterator[EtcdRendezvousHandler]:
    params = RendezvousParameters(
        backend="etcd-v2", endpoint=etcd_endpoint, run_id=f"sec-run-{next(_ids)}", min_nodes=1,
        max_nodes=2, local_addr="127.0.0.1", key_prefix=PREFIX, read_timeout="5", join_timeout="20", last_call_timeout="1",
    )
    h = get_rendezvous_handler(params)
    assert isinstance(h, EtcdRendezvousHandler)
    try:
        yield h
    finally:
        h.shutdown()


def _backend(handler: EtcdRendezvousHandler) -> EtcdRendezvousBackend:
    backend = handler._state_holder.backend  # type: ignore[attr-defined]  # the SealedRoundStateHolder's
    assert isinstance(backend, EtcdRendezvousBackend)
    return backend


def test_a_reducing_pickle_at_the_state_key_is_refused_and_never_run(
    client: EtcdClient, handler: EtcdRendezvousHandler, tmp_path: Path
) -> None:
    target = tmp_path / "pwned"
    key = _backend(handler).key
    assert key.startswith(f"{PREFIX}/sec-run-")
    client.put(key.encode(), base64.b64encode(pickle.dumps(_Reduce(str(target)))))
    # open pickles as _io.open from Python 3.12 on (io.open before)
    with pytest.raises(RendezvousStateError, match=rf"'{key}'.*refusing to load _?io\.open"):
        handler.num_nodes_waiting()  # torch's handler syncs its state through the backend
    with pytest.raises(RendezvousStateError, match=rf"'{key}'"):
        handler.next_rendezvous()
    assert not target.exists()


def test_a_state_hiding_a_callable_in_a_field_is_refused(
    client: EtcdClient, handler: EtcdRendezvousHandler, tmp_path: Path
) -> None:
    target = tmp_path / "pwned"
    state = _RendezvousState()
    state.participants = {_NodeDesc("h", 1, 0): 0}
    state.last_heartbeats = {_NodeDesc("h", 1, 0): _Reduce(str(target))}  # type: ignore[dict-item]
    key = _backend(handler).key
    client.put(key.encode(), base64.b64encode(pickle.dumps(state)))
    with pytest.raises(RendezvousStateError, match="refusing"):
        handler.num_nodes_waiting()
    # A lost race (torch's holder writing over a state it did not read) reads it through the same check.
    holder = handler._state_holder  # type: ignore[attr-defined]
    holder.mark_dirty()
    with pytest.raises(RendezvousStateError, match="refusing"):
        holder.sync()
    assert not target.exists()


def test_the_backend_returns_the_stored_bytes_the_holder_refuses_them(
    client: EtcdClient, handler: EtcdRendezvousHandler, tmp_path: Path
) -> None:
    target = tmp_path / "pwned"
    hostile = pickle.dumps(_Reduce(str(target)))
    key = _backend(handler).key
    client.put(key.encode(), base64.b64encode(hostile))
    got = _backend(handler).get_state()  # torch's contract: opaque bytes, nothing unpickled
    assert got is not None and got[0] == hostile
    with pytest.raises(RendezvousStateError, match=rf"'{key}'.*refusing to load _?io\.open"):  # _io: 3.12+
        handler._state_holder.sync()  # type: ignore[attr-defined]
    assert not target.exists()


def _malformed(kind: str) -> bytes:
    if kind in ("no BUILD: state", "no BUILD: node"):
        return no_build(_RendezvousState if kind.endswith("state") else _NodeDesc)
    if kind == "built twice":  # issue 32: torch's class would keep the first BUILD's fields
        bad = torch_state()
        bad.participants = {"not a node": "not a rank"}  # type: ignore[dict-item]
        return two_builds(dict(vars(bad), __setstate__=frozenset), torch_state())
    state = torch_state()
    state.last_heartbeats = dict.fromkeys(state.participants, datetime.now())  # naive: TypeError in torch
    return pickle.dumps(state)


@pytest.mark.parametrize("kind", ["no BUILD: state", "no BUILD: node", "built twice", "naive heartbeat"])
def test_a_malformed_state_is_a_state_error_naming_the_key(
    client: EtcdClient, handler: EtcdRendezvousHandler, kind: str
) -> None:
    key = _backend(handler).key
    client.put(key.encode(), base64.b64encode(_malformed(kind)))
    with pytest.raises(RendezvousStateError, match=rf"'{key}'"):
        handler.num_nodes_waiting()
    with pytest.raises(RendezvousStateError, match=rf"'{key}'"):
        handler.next_rendezvous()


def test_torch_gets_a_state_built_from_the_checked_values(
    client: EtcdClient, handler: EtcdRendezvousHandler
) -> None:
    stored = torch_state(round_=7)
    stored.wait_list = {_NodeDesc("waiting", 9, 0)}
    stored.extra = "an attribute torch's state lacks"  # type: ignore[attr-defined]
    client.put(_backend(handler).key.encode(), base64.b64encode(pickle.dumps(stored)))
    holder = handler._state_holder  # type: ignore[attr-defined]
    holder.sync()
    state = holder.state
    assert type(state) is _RendezvousState and state.round == 7 and state.complete
    assert set(vars(state)) == set(vars(_RendezvousState()))  # not the stored pickle's attributes
    assert type(state.wait_list) is set and state.wait_list == {_NodeDesc("waiting", 9, 0)}  # torch adds to it
    assert {type(n) for n in state.participants} == {_NodeDesc}
    assert state.participants == stored.participants and state.last_heartbeats == stored.last_heartbeats


def test_torchs_own_state_still_goes_through(client: EtcdClient, handler: EtcdRendezvousHandler) -> None:
    info = handler.next_rendezvous()
    assert info.world_size == 1
    kv = client.get(_backend(handler).key.encode())
    assert kv is not None and isinstance(pickle.loads(base64.b64decode(kv.value)), _RendezvousState)
    assert handler.num_nodes_waiting() == 0


@pytest.mark.parametrize("of", [_RendezvousState, _NodeDesc], ids=["state", "node"])
def test_the_cli_reports_an_object_pickled_without_its_fields_in_one_line(
    client: EtcdClient, etcd_endpoint: str, of: type, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = f"sec-cli-{next(_ids)}"
    key = f"{PREFIX}/{run_id}"
    client.put(key.encode(), base64.b64encode(no_build(of)))
    capsys.readouterr()
    rc = cli(["--endpoints", etcd_endpoint, "--key-prefix", PREFIX, "--timeout", "10", "show", run_id])
    err = capsys.readouterr().err
    assert rc == 2, err  # a refused state (exit 2), not an internal error (exit 1: AttributeError before)
    assert key in err and f"{of.__name__} pickled without its fields" in err and err.count("\n") == 1, err


def test_one_hostile_run_does_not_stall_list_or_gc_of_the_others(
    client: EtcdClient, etcd_endpoint: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 32: a job's user writes, into its own run, a state that took the reader 12-30 s (8,000 nodes
    # of one host whose pids differ by multiples of 2**61 - 1); root's `list` and `gc --dry-run --timeout 5`
    # then ran 24-33 s, exited 2 and reported no other run. Now the run is reported as undecodable and the
    # 99 others are listed and collected, within the timeout.
    prefix = f"{PREFIX}-many-{next(_ids)}"
    old = datetime.now(timezone.utc) - timedelta(hours=1)
    for i in range(99):
        state = torch_state(2)
        state.closed = True
        state.last_heartbeats = dict.fromkeys(state.participants, old)
        client.put(f"{prefix}/run-{i:02d}".encode(), base64.b64encode(pickle.dumps(state)))
    hostile = f"{prefix}/run-50x"
    client.put(hostile.encode(), base64.b64encode(colliding_nodes()))
    base = ["--endpoints", etcd_endpoint, "--key-prefix", prefix, "--timeout", "5"]
    capsys.readouterr()
    for argv in (["list", "--json"], ["gc", "--dry-run", "--json"]):
        started = time.monotonic()
        rc = cli([*base, *argv])
        took = time.monotonic() - started
        out, err = capsys.readouterr()
        assert rc == 0 and took < 5, (argv, rc, took, err[-2000:])
        doc = json.loads(out)
        if argv[0] == "list":
            good = {r["run_id"] for r in doc["runs"] if "error" not in r}
            bad = [r for r in doc["runs"] if "error" in r]
            assert len(good) == 99 and [r["run_id"] for r in bad] == ["run-50x"], doc
            assert "out of range" in bad[0]["error"], bad
        else:
            assert len(doc["removed"]) == 99 and "run-50x" not in {r["run_id"] for r in doc["removed"]}, doc
            logged = err + caplog.text  # in-process, the warning goes to pytest's handler
            assert f"gc skips {hostile}" in logged and "out of range" in logged, logged[-2000:]
