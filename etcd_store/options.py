"""``EtcdClientOptions``: everything that makes an :class:`~etcd_store.client.EtcdClient`, frozen.

:class:`~etcd_store.client.EtcdClient` builds it from its keywords (or takes it whole:
:meth:`~etcd_store.client.EtcdClient.from_options`) for its
:class:`~etcd_store.client.transport.Transport`; :func:`etcd_rdzv.conf.parse_client_options`
builds one from torchrun's parameters. Standard library only, so reading a configuration never
imports gRPC. Fields: as ``EtcdClient``'s arguments; the transport checks them (``ValueError``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_CONNECT_TIMEOUT", "DEFAULT_TIMEOUT", "EtcdClientOptions"]

#: The default deadline in seconds of every client call, retries included.
DEFAULT_TIMEOUT = 30.0
#: How long a client that never reached etcd keeps retrying refused connections.
DEFAULT_CONNECT_TIMEOUT = 5.0


@dataclass(frozen=True)
class EtcdClientOptions:
    """The endpoints, deadlines, TLS files and credentials of one client (``password`` out of ``repr``).

    Frozen and hashable: a list of endpoints or interceptors is kept as a tuple, a deadline given as a
    number as a float.
    """

    endpoints: str | Sequence[str]
    timeout: float = DEFAULT_TIMEOUT
    protocol: str | None = None
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    allow_insecure_auth: bool = False
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    interceptors: Sequence[Any] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.endpoints, str):
            object.__setattr__(self, "endpoints", tuple(self.endpoints))
        object.__setattr__(self, "interceptors", tuple(self.interceptors))
        for name in ("timeout", "connect_timeout"):
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):  # others: the transport refuses
                object.__setattr__(self, name, float(value))
