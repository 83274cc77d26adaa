"""A hostile value at an etcd-v2 run's state key (``<key_prefix>/<run_id>``), against a real etcd:
torch's own handler, created as torchrun creates it, refuses it with ``RendezvousStateError``
naming the key, and what the pickle names never runs (issue 23, item 1)."""

from __future__ import annotations

import base64
import itertools
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.v2_pickles import no_build
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
    backend = handler._state_holder._backend  # type: ignore[attr-defined]
    assert isinstance(backend, EtcdRendezvousBackend)
    return backend


def test_a_reducing_pickle_at_the_state_key_is_refused_and_never_run(
    client: EtcdClient, handler: EtcdRendezvousHandler, tmp_path: Path
) -> None:
    target = tmp_path / "pwned"
    key = _backend(handler).key
    assert key.startswith(f"{PREFIX}/sec-run-")
    client.put(key.encode(), base64.b64encode(pickle.dumps(_Reduce(str(target)))))
    with pytest.raises(RendezvousStateError, match=rf"'{key}'.*refusing to load io\.open"):
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
    # A lost race reads the stored value through the same check.
    with pytest.raises(RendezvousStateError, match="refusing"):
        _backend(handler).set_state(pickle.dumps(_RendezvousState()))
    assert not target.exists()


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
