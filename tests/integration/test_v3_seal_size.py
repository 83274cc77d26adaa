"""The size bound of the ``etcd-v3`` seal against a real etcd with a small ``--max-request-bytes``.

The seal of a round names every member in one request. With etcd's limit set to 16 KiB
(``max_request_bytes`` told the same), the largest ``max_nodes`` that ``V3Settings``
accepts seals (in the larger form, every member's create revision listed), and a round
twice that size is refused by etcd: what ``V3Settings`` keeps a job from starting into.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest

from etcd_rdzv.native import protocol
from etcd_rdzv.native.records import RunKeys, Sealed
from etcd_rdzv.native.settings import V3Settings, node_id_bytes
from etcd_server import EtcdServer
from etcd_store.client import EtcdClient
from etcd_store.errors import EtcdRequestError

pytestmark = [pytest.mark.timeout(120), pytest.mark.etcd_matrix]

LIMIT = 16384
ADDR = "127.0.0.1"
_ids = itertools.count()


@pytest.fixture(scope="module")
def small_etcd(etcd_server: EtcdServer) -> Iterator[EtcdClient]:
    server = EtcdServer(binary=etcd_server.binary, extra_args=[f"--max-request-bytes={LIMIT}"])
    server.start(timeout=30)
    try:
        with EtcdClient(server.get_endpoint(), timeout=10) as client:
            yield client
    finally:
        server.stop()


def largest_fit(prefix: str, run_id: str) -> int:
    with pytest.raises(ValueError, match="at most") as info:
        V3Settings(run_id, 1, 10**6, local_addr=ADDR, key_prefix=prefix, max_request_bytes=LIMIT)
    fit = int(str(info.value).split("at most ")[1].split()[0])
    V3Settings(run_id, 1, fit, local_addr=ADDR, key_prefix=prefix, max_request_bytes=LIMIT)
    return fit


def fill_round(client: EtcdClient, keys: RunKeys, n: int) -> int:
    """``n`` joiners of round 1 with ids as long as a real one, after one that left (so the
    seal lists every create revision); their lease."""
    lease = client.lease_grant(60)
    width = node_id_bytes(ADDR)
    assert protocol.join(client, keys, "x" * width, b"{}", lease, Sealed()).ok
    assert protocol.leave_if_unsealed(client, keys, 1, keys.join_key(1, "x" * width), Sealed())
    for i in range(n):
        assert protocol.join(client, keys, f"{i:0{width}d}", b'{"addr":"127.0.0.1","port":1}', lease, Sealed()).ok
    return lease


def test_the_largest_accepted_round_seals_and_twice_that_is_refused(small_etcd: EtcdClient) -> None:
    prefix = f"/v3size{next(_ids)}-{time.monotonic_ns() % 10**9}"
    fit = largest_fit(prefix, "fits")
    assert 100 < fit < 400
    keys = RunKeys.for_run(prefix, "fits")
    run_lease = small_etcd.lease_grant(60)
    lease = fill_round(small_etcd, keys, fit)
    read = protocol.read_round(small_etcd, keys, 1)
    out = protocol.seal(small_etcd, keys, 1, Sealed(), read, run_lease, fit)
    assert out.ok
    sealed = protocol.read_meta(small_etcd, keys).sealed
    assert sealed.membership is not None and len(sealed.membership.created) == fit
    small_etcd.lease_revoke(lease)

    keys = RunKeys.for_run(prefix, "too-many")
    lease = fill_round(small_etcd, keys, 2 * fit)
    read = protocol.read_round(small_etcd, keys, 1)
    with pytest.raises(EtcdRequestError, match="too large"):
        protocol.seal(small_etcd, keys, 1, Sealed(), read, run_lease, 2 * fit)
    small_etcd.lease_revoke(lease)
