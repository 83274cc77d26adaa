"""The client's endpoint checks against its TLS and protocol options (``etcd_store.client.endpoints``),
without etcd: what docs/security.md ("What the client refuses") promises."""

from __future__ import annotations

import pytest

from etcd_store.client import client_endpoints


@pytest.mark.parametrize("spec", ["http://h:1", "h:1", "https://h:1"])
def test_tls_files_with_protocol_http_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match=r"^Invalid etcd protocol 'http' with TLS certificate files \(ca_cert, "
                                         r"cert\): .*drop the TLS files\.$"):
        client_endpoints(spec, protocol="http", tls=True)


@pytest.mark.parametrize("protocol, tls", [("https", False), (None, True), ("https", True)])
def test_an_explicit_http_endpoint_is_refused_with_protocol_https_or_tls_files(protocol: str | None,
                                                                              tls: bool) -> None:
    with pytest.raises(ValueError, match=r"^Invalid etcd endpoint 'http://h:1': it says http but the client is "
                                         r"configured for https \(option protocol, or TLS certificate files"):
        client_endpoints("http://h:1", protocol=protocol, tls=tls)
    assert [str(ep) for ep in client_endpoints("h:1", protocol=protocol, tls=tls)] == ["https://h:1"]


def test_plain_text_stays_possible_without_tls_files() -> None:
    assert [str(ep) for ep in client_endpoints("http://h:1,h:2", protocol="http")] == ["http://h:1", "http://h:2"]
    assert [str(ep) for ep in client_endpoints("h:1")] == ["http://h:1"]
