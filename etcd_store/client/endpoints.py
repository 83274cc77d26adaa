"""etcd endpoint addresses: :func:`parse_endpoints` and :class:`Endpoint`.

Refused with a ``ValueError`` (which never repeats a password): credentials in an
endpoint (``http://user:pw@host``: they would be sent as a host name and printed in
errors), endpoints mixing ``http`` and ``https`` (a member reached in plain text would
get the password and the data TLS protects elsewhere), and an explicit scheme that
contradicts the one the client was configured for (``protocol``, TLS files), as does
``protocol="http"`` with TLS files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_PORT", "Endpoint", "client_endpoints", "parse_endpoints", "redact_endpoint"]

DEFAULT_PORT = 2379


@dataclass(frozen=True)
class Endpoint:
    """One etcd member address."""

    host: str
    port: int
    secure: bool = False

    @property
    def target(self) -> str:
        """The gRPC target, ``host:port`` (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"{'https' if self.secure else 'http'}://{self.target}"


def redact_endpoint(text: str) -> str:
    """``text`` with whatever precedes an ``@`` in its authority replaced by ``***``."""
    scheme, sep, rest = text.partition("://") if "://" in text else ("", "", text)
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "***@" + authority.rpartition("@")[2]
    return f"{scheme}{sep}{authority}{slash}{path}"


def parse_endpoints(
    spec: str | Sequence[str],
    *,
    secure: bool | None = None,
    default_port: int = DEFAULT_PORT,
    check_schemes: bool = True,
) -> list[Endpoint]:
    """Parse ``"h1:2379,h2:2379"``, ``http://`` / ``https://`` URLs, or a list of those.

    ``secure``: the client's configured scheme, taken by endpoints without one (``None``: plain
    unless a URL says ``https``); a URL saying the other is refused. Raises ``ValueError`` naming
    the bad part (module docstring), never a password. ``check_schemes=False`` checks syntax
    only (the caller checks the rest later with :func:`client_endpoints`).
    """
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    endpoints: list[Endpoint] = []
    for raw in parts:
        text = raw.strip()
        if not text:
            continue
        if "@" in text.partition("://")[2 if "://" in text else 0].partition("/")[0]:
            raise ValueError(
                f"Invalid etcd endpoint {redact_endpoint(text)!r}: credentials in an endpoint URL are "
                "not accepted (they would be taken as a host name and shown in errors); give the "
                "user and password as options (a password file) instead."
            )
        is_secure = bool(secure)
        if "://" in text:
            scheme, _, text = text.partition("://")
            if scheme not in ("http", "https"):
                raise ValueError(
                    f"Invalid etcd endpoint {raw.strip()!r}: scheme must be http or https."
                )
            is_secure = scheme == "https"
            if check_schemes and secure is not None and is_secure != secure:
                raise ValueError(
                    f"Invalid etcd endpoint {raw.strip()!r}: it says {scheme} but the client is "
                    f"configured for {'https' if secure else 'http'} (option protocol, or TLS "
                    "certificate files given); write the endpoints with the scheme meant."
                )
        host, port = _host_port(text.rstrip("/"), raw.strip(), default_port)
        endpoints.append(Endpoint(host, port, is_secure))
    if not endpoints:
        raise ValueError(f"No etcd endpoint given in {spec!r}.")
    if check_schemes and len({ep.secure for ep in endpoints}) > 1:
        raise ValueError(
            f"The etcd endpoints mix https and http ({', '.join(map(str, endpoints))}): a member "
            "reached in plain text would receive the password and the data TLS protects on the "
            "others; use https (or http) for every endpoint."
        )
    return endpoints


def _host_port(text: str, shown: str, default_port: int) -> tuple[str, int]:
    """Host and port of ``text`` (no scheme); errors name the endpoint as ``shown``."""
    host, port_text = text, ""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    if not host or "/" in host:
        raise ValueError(f"Invalid etcd endpoint {shown!r}: no host.")
    try:
        port = int(port_text) if port_text else default_port
    except ValueError:
        raise ValueError(f"Invalid etcd endpoint {shown!r}: port {port_text!r} is not a number.") from None
    if not 0 < port < 65536:
        raise ValueError(f"Invalid etcd endpoint {shown!r}: port out of range.")
    return host, port


def client_endpoints(
    spec: str | Sequence[str],
    *,
    protocol: str | None = None,
    tls: bool = False,
    user: str | None = None,
    password: str | None = None,
    allow_insecure_auth: bool = False,
) -> list[Endpoint]:
    """The endpoints of a client with ``protocol`` (``http``/``https``/``None``), TLS files
    (``tls``) and credentials, checked as the module says: no scheme takes ``protocol``, else
    https with ``tls``; a password for a plain-text endpoint needs ``allow_insecure_auth`` (the
    caller warns). Raises ``ValueError`` naming what was wrong (never the password)."""
    if protocol not in (None, "http", "https"):
        raise ValueError(f"Invalid etcd protocol {protocol!r}: use 'http' or 'https'.")
    if tls and protocol == "http":
        raise ValueError(
            "Invalid etcd protocol 'http' with TLS certificate files (ca_cert, cert): the client would "
            "ignore them and talk plain text; use protocol https (or none), or drop the TLS files."
        )
    secure = (protocol == "https") if protocol is not None else (True if tls else None)
    endpoints = parse_endpoints(spec, secure=secure)
    plain = ", ".join(str(ep) for ep in endpoints if not ep.secure)
    if password and plain and not allow_insecure_auth:
        raise ValueError(
            f"etcd user {user!r} would send its password in plain text to {plain}: use https "
            "endpoints (TLS: protocol=https, ca_cert), or accept the risk explicitly (a trusted "
            "network, or etcd on this host) with allow_insecure_auth (the rdzv-conf key; "
            "--allow-insecure-auth of the etcd-rdzv command)."
        )
    return endpoints
