"""EtcdStore against an etcd with TLS (client certificates) and auth (a user limited to a prefix)."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from helpers.certs import CertPaths, have_openssl, make_certs

from etcd_server import AuthConfig, EtcdServer, TLSConfig
from etcd_store import EtcdStore

PASSWORD = "al1ce-st0re-pw"

pytestmark = pytest.mark.etcd_matrix("3.6")  # issue 23: each finding on etcd 3.7 and 3.6


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    if not have_openssl():
        pytest.skip("openssl command not available")
    return make_certs(tmp_path_factory.mktemp("store-certs"))


@pytest.fixture
def secure_etcd(etcd_binary: str, certs: CertPaths) -> Iterator[EtcdServer]:
    tls = TLSConfig(
        certs.server_cert, certs.server_key, certs.ca,
        client_cert_file=certs.client_cert, client_key_file=certs.client_key,
    )
    auth = AuthConfig("r00t-st0re-pw", user="alice", password=PASSWORD, prefix=b"/jobs/alice/")
    with EtcdServer(binary=etcd_binary, tls=tls, auth=auth) as server:
        yield server


def test_store_over_tls_and_auth(secure_etcd: EtcdServer, certs: CertPaths) -> None:
    options = dict(
        ca_cert=certs.ca, cert=certs.client_cert, key=certs.client_key, user="alice", password=PASSWORD,
    )
    url = secure_etcd.get_client_url()
    assert url.startswith("https://")
    timeout = datetime.timedelta(seconds=10)
    with EtcdStore(url, prefix="/jobs/alice/run1/store", timeout=timeout, **options) as store:
        store.set("k", "v")
        assert store.get("k") == b"v"
        assert store.add("n", 2) == 2
        assert store.compare_set("k", "v", "w") == b"w"
        store.multi_set(["a", "b"], ["1", "2"])
        assert store.multi_get(["a", "b"]) == [b"1", b"2"]
        store.queue_push("q", "item")
        assert store.queue_pop("q") == b"item"
        big = b"\x01" * (3 * 1024 * 1024)  # chunk keys stay under the user's prefix
        store.set("big", big)
        assert store.get("big") == big
        timer = threading.Timer(0.2, store.clone().set, args=("late", "x"))
        timer.start()
        store.wait(["late"])  # watches pass auth too
        timer.join()
        store.barrier("done", 1)
        assert sorted(store.list_keys()) == ["a", "b", "big", "done", "k", "late", "n"]
        # "endpoint:port" without a scheme: TLS is on because TLS files are given.
        with EtcdStore(secure_etcd.get_endpoint(), prefix="/jobs/alice/run1/store", **options) as again:
            assert again.get("n") == b"2"


def test_permission_and_password_errors_are_store_errors(
    secure_etcd: EtcdServer, certs: CertPaths
) -> None:
    tls = dict(ca_cert=certs.ca, cert=certs.client_cert, key=certs.client_key)
    url = secure_etcd.get_client_url()
    with pytest.raises(dist.DistStoreError, match="permission denied"):
        EtcdStore(url, prefix="/jobs/bob/store", user="alice", password=PASSWORD, **tls)
    with pytest.raises(dist.DistStoreError, match="alice"):
        EtcdStore(url, prefix="/jobs/alice/store", user="alice", password="wrong", **tls)
