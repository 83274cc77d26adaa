"""The one arrow from etcd_server to etcd_store: :func:`make_client`.

``EtcdServer.get_client()`` and ``EtcdCluster.get_client()`` (torch's
``EtcdServer.get_client()`` API, but returning this project's v3 client)
both call :func:`make_client`, which imports ``etcd_store.client`` (and with
it grpc) inside the function, on the first call. Importing etcd_server never
imports etcd_store; nothing else in etcd_server refers to it.
"""

from __future__ import annotations

from typing import Any

from .config import AuthConfig, TLSConfig

__all__ = ["make_client"]


def _client_target(urls: list[str], tls: TLSConfig | None) -> str | list[str]:
    """Endpoints for EtcdClient: "host:port" without TLS, https URLs with it."""
    if tls is None:
        urls = [u.split("://", 1)[1] for u in urls]
    return urls[0] if len(urls) == 1 else urls


def make_client(
    urls: list[str],
    tls: TLSConfig | None,
    auth: AuthConfig | None,
    overrides: dict[str, Any],
) -> Any:
    """An ``etcd_store.client.EtcdClient`` for ``urls`` with TLS and auth filled in.

    TLS files from ``tls`` and (with ``auth``) the root credentials are
    passed (without TLS, with ``allow_insecure_auth``: the server listens on
    this host); ``overrides`` (e.g. ``user=..., password=..., timeout=...``)
    replace them. Constructing the client sends no request. Typed ``Any`` so
    that etcd_server's signatures do not name an etcd_store type.

    Raises:
        ImportError: etcd_store (or grpc) is not installed.
    """
    # The dependency etcd_server -> etcd_store, deliberately here and only here:
    # etcd_server stays standard-library only at import time.
    from etcd_store.client import EtcdClient

    kwargs: dict[str, Any] = {}
    if tls is not None:
        kwargs.update(ca_cert=tls.ca_file, cert=tls.client_cert, key=tls.client_key)
    if auth is not None:
        kwargs.update(user="root", password=auth.root_password)
        # The server's own client on its loopback URLs: plain text only when it runs without TLS.
        kwargs.update(allow_insecure_auth=tls is None)
    kwargs.update(overrides)
    return EtcdClient(_client_target(urls, tls), **kwargs)
