"""etcd endpoint addresses: :func:`parse_endpoints` and :class:`Endpoint`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_PORT", "Endpoint", "parse_endpoints"]

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


def parse_endpoints(
    spec: str | Sequence[str], *, secure: bool | None = None, default_port: int = DEFAULT_PORT
) -> list[Endpoint]:
    """Parse ``"h1:2379,h2:2379"``, ``http://`` / ``https://`` URLs, or a list of those.

    ``secure`` forces the scheme of endpoints written without one (``None``: plain
    text unless a URL says ``https``). Raises ``ValueError`` naming the bad part.
    """
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    endpoints: list[Endpoint] = []
    for raw in parts:
        text = raw.strip()
        if not text:
            continue
        is_secure = bool(secure)
        if "://" in text:
            scheme, _, text = text.partition("://")
            if scheme not in ("http", "https"):
                raise ValueError(
                    f"Invalid etcd endpoint {raw.strip()!r}: scheme must be http or https."
                )
            is_secure = scheme == "https"
        text = text.rstrip("/")
        host, port_text = text, ""
        if text.startswith("["):
            host, _, rest = text[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
        elif text.count(":") == 1:
            host, _, port_text = text.partition(":")
        if not host or "/" in host:
            raise ValueError(f"Invalid etcd endpoint {raw.strip()!r}: no host.")
        try:
            port = int(port_text) if port_text else default_port
        except ValueError:
            raise ValueError(
                f"Invalid etcd endpoint {raw.strip()!r}: port {port_text!r} is not a number."
            ) from None
        if not 0 < port < 65536:
            raise ValueError(f"Invalid etcd endpoint {raw.strip()!r}: port out of range.")
        endpoints.append(Endpoint(host, port, is_secure))
    if not endpoints:
        raise ValueError(f"No etcd endpoint given in {spec!r}.")
    return endpoints
