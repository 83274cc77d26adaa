"""Errors are classified by gRPC code and etcd's named errors, never by text (issue 21, item 6).

Before, a substring of the error text decided: "tls" or "ssl" anywhere (a host named
``etcd-tls-0`` in a DNS failure) made a TLS error at once, "too large" anywhere (etcd's "too
large lease TTL") blamed ``--max-request-bytes``. Now a TLS failure is one the standard
library's handshake confirms (``etcd_store.client.channels.tls_failure``), and etcd's errors are matched
whole, with their code.
"""

from __future__ import annotations

import time

import pytest

from etcd_store.client import EtcdClient
from etcd_store.errors import EtcdConnectionError, EtcdRequestError, EtcdTLSError


@pytest.mark.parametrize("endpoint", ["etcd-tls-0.invalid:2379", "https://etcd-tls-0.invalid:2379",
                                      "etcd-plain-0.invalid:2379"])  # fmt: skip
def test_an_unknown_host_is_a_connection_error_whatever_its_name(endpoint: str) -> None:
    with EtcdClient(endpoint, timeout=20, connect_timeout=1.0) as client:
        start = time.monotonic()
        with pytest.raises(EtcdConnectionError, match="connect_timeout=1 s") as info:
            client.get(b"/k")
        took = time.monotonic() - start
    assert not isinstance(info.value, EtcdTLSError), info.value
    assert 1.0 <= took < 6.0, took


def test_a_lease_ttl_etcd_finds_too_large_is_a_rejected_request_not_a_request_size(etcd_endpoint: str) -> None:
    with EtcdClient(etcd_endpoint, timeout=5) as client:
        with pytest.raises(EtcdRequestError, match="too large lease TTL") as info:
            client.lease_grant(9_000_000_001)  # above etcd's MaxLeaseTTL (9e9 s)
    assert "max-request-bytes" not in str(info.value)
    assert "rejected the request" in str(info.value)
