"""The seal of an ``etcd-v3`` round is one etcd request naming every member: its size bound.

etcd refuses a request larger than its ``--max-request-bytes`` (1.5 MiB by default), so a
round of too many nodes could never be sealed. :func:`~etcd_rdzv.native.settings.seal_request_bytes`
bounds the seal's size, and ``V3Settings`` refuses a ``max_nodes`` whose round would not fit,
with an error that says how many do. No etcd here: the seal's request is built and measured
(tests/integration/test_v3_seal_size.py seals one at the bound against etcd).
"""

from __future__ import annotations

from typing import Any

import pytest
from etcd3.etcdrpc import rpc_pb2

from etcd_rdzv.conf_keys import DEFAULT_MAX_REQUEST_BYTES
from etcd_rdzv.native import protocol
from etcd_rdzv.native.handler import EtcdV3RendezvousHandler
from etcd_rdzv.native.protocol import RoundRead
from etcd_rdzv.native.records import Joiner, RunKeys, Sealed
from etcd_rdzv.native.settings import V3Settings, node_id_bytes, seal_request_bytes
from etcd_store.client import EtcdClient


class _Measure:
    """A client whose ``txn`` only measures the request it would send."""

    size = 0

    def txn(self, compare: Any, success: Any = (), failure: Any = (), **_: Any) -> Any:
        self.size = rpc_pb2.TxnRequest(compare=list(compare), success=list(success),
                                       failure=list(failure)).ByteSize()

        class Answer:
            succeeded, revision, responses = True, 1, []

        return Answer()


def seal_size(keys: RunKeys, members: int, id_bytes: int, *, left: bool) -> int:
    """The bytes of the seal Txn of ``members`` joiners with ids of ``id_bytes`` bytes, their create
    revisions as far apart as the bound allows (``left``: somebody left, so the record lists them)."""
    joiners = [Joiner(f"{i:0{id_bytes}d}", 10**18 + i * (10**11 - 1), b"{}") for i in range(members)]
    joins = members + 1 if left else members
    read = RoundRead(5, joiners, joins, 3, 0, Sealed(), False)
    client = _Measure()
    protocol.seal(client, keys, 2, Sealed(1, 4, 1), read, 2**63 - 1, members,  # type: ignore[arg-type]
                  master=("x" * 253, 65535))
    return client.size


@pytest.mark.parametrize("addr", ["10.0.0.1", "node-12345.cluster.example.com", "x" * 253])
@pytest.mark.parametrize("members", [1, 100, 5000])
def test_the_estimate_bounds_the_seal_request(addr: str, members: int) -> None:
    keys = RunKeys.for_run("/torch/elastic/rendezvous", "a-fairly-long-run-id-of-a-job-42")
    id_bytes = node_id_bytes(addr)
    actual = max(seal_size(keys, members, id_bytes, left=left) for left in (False, True))
    estimate = seal_request_bytes(keys.root, members, id_bytes)
    assert actual <= estimate <= actual + 2048 + members * 4  # safe, and not far off


def test_a_node_id_is_no_longer_than_its_bound() -> None:
    settings = V3Settings("r", 1, 1, local_addr="node-7.example.com")
    client = EtcdClient("127.0.0.1:1", timeout=1)
    try:
        handler = EtcdV3RendezvousHandler(settings, client)
        assert len(handler.node_id.encode()) <= node_id_bytes("node-7.example.com")
        handler.leave(0.1)
    finally:
        client.close()


def test_a_max_nodes_whose_round_could_not_be_sealed_is_refused_naming_the_bound() -> None:
    addr = "node-12345.cluster.example.com"
    with pytest.raises(ValueError, match=r"max_nodes=30000 is too large.*--max-request-bytes") as info:
        V3Settings("r", 1, 30000, local_addr=addr)
    fit = int(str(info.value).split("at most ")[1].split()[0])
    assert 20000 < fit < 30000
    V3Settings("r", 1, fit, local_addr=addr)  # the largest that fits is accepted
    with pytest.raises(ValueError, match=f"at most {fit} nodes fit"):
        V3Settings("r", 1, fit + 1, local_addr=addr)
    # A larger etcd limit, set with the same key as etcd's.
    V3Settings("r", 1, 30000, local_addr=addr, max_request_bytes=4 * DEFAULT_MAX_REQUEST_BYTES)


def test_max_request_bytes_is_read_from_the_rdzv_conf() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from etcd_rdzv.conf import parse_v3_settings

    params = RendezvousParameters("etcd-v3", "localhost:2379", "r", 1, 30000, local_addr="10.0.0.1")
    assert parse_v3_settings(params)[0].max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    small = RendezvousParameters("etcd-v3", "localhost:2379", "r", 1, 1000, local_addr="10.0.0.1",
                                 max_request_bytes="20000")
    with pytest.raises(ValueError, match="at most"):
        parse_v3_settings(small)
    with pytest.raises(ValueError, match="max_request_bytes"):
        parse_v3_settings(RendezvousParameters("etcd-v3", "localhost:2379", "r", 1, 2, max_request_bytes="big"))
