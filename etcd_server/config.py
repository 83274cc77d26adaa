"""Settings of a local etcd: TLS serving (:class:`TLSConfig`) and auth (:class:`AuthConfig`).

Frozen dataclasses, validated at construction (``ValueError`` naming the bad
field). Passwords are excluded from ``repr``. Standard library only.
"""

from __future__ import annotations

import dataclasses
import ssl

__all__ = ["HOST", "AuthConfig", "TLSConfig"]

#: The only address local etcd servers listen on.
HOST = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """Serve the client API over https.

    Attributes:
        cert_file, key_file: the server certificate and key (PEM). The
            certificate should name ``IP:127.0.0.1`` in its subjectAltName.
            etcd's JSON gateway dials the server with this same certificate,
            so when ``client_cert_auth`` is on it must also allow
            ``clientAuth`` (extendedKeyUsage serverAuth + clientAuth).
        ca_file: CA bundle that signed the server (and client) certificates;
            passed as ``--trusted-ca-file`` and used by our probes/clients.
        client_cert_auth: require clients to present a certificate signed by
            ``ca_file`` (``--client-cert-auth``).
        client_cert_file, client_key_file: the certificate our readiness
            probes and :meth:`EtcdServer.get_client` present; default to the
            server certificate and key.
        peer_cert_file, peer_key_file, peer_ca_file: the peer port's
            certificate, key and trusted CA (``--peer-cert-file``,
            ``--peer-key-file``, ``--peer-trusted-ca-file``); default to
            ``cert_file``, ``key_file`` and ``ca_file``. With TLS configured
            the peer port always serves https and requires a peer certificate
            signed by that CA (``--peer-client-cert-auth``); members dial each
            other with the peer certificate, so in a cluster it must allow
            both serverAuth and clientAuth and name ``IP:127.0.0.1``.
        peer_allowed_cn: accept only peer certificates with this CommonName
            (``--peer-cert-allowed-cn``). Without it (and without a separate
            ``peer_ca_file``) every certificate the client CA signed, a
            client's included, is a valid peer certificate.
    """

    cert_file: str
    key_file: str
    ca_file: str
    client_cert_auth: bool = True
    client_cert_file: str | None = None
    client_key_file: str | None = None
    peer_cert_file: str | None = None
    peer_key_file: str | None = None
    peer_ca_file: str | None = None
    peer_allowed_cn: str | None = None

    def __post_init__(self) -> None:
        if (self.peer_cert_file is None) != (self.peer_key_file is None):
            raise ValueError("TLSConfig.peer_cert_file and peer_key_file go together")
        if self.peer_allowed_cn is not None and not self.peer_allowed_cn:
            raise ValueError("TLSConfig.peer_allowed_cn must not be empty")

    @property
    def peer_cert(self) -> str:
        """Certificate of the peer port (served and presented to other members)."""
        return self.peer_cert_file or self.cert_file

    @property
    def peer_key(self) -> str:
        """Key of :attr:`peer_cert`."""
        return self.peer_key_file or self.key_file

    @property
    def peer_ca(self) -> str:
        """CA a peer's certificate must be signed by."""
        return self.peer_ca_file or self.ca_file

    @property
    def client_cert(self) -> str:
        """Certificate presented by our own clients."""
        return self.client_cert_file or self.cert_file

    @property
    def client_key(self) -> str:
        """Key of :attr:`client_cert`."""
        return self.client_key_file or self.key_file

    def ssl_context(self) -> ssl.SSLContext:
        """A client-side context trusting ``ca_file`` and presenting the client cert."""
        ctx = ssl.create_default_context(cafile=self.ca_file)
        ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx


@dataclasses.dataclass(frozen=True)
class AuthConfig:
    """Turn on etcd authentication before the server first serves its client port.

    The set-up runs on a first start of etcd that listens for clients only on a
    unix socket in a private directory; etcd then restarts on its real client
    URL with auth on (see :mod:`etcd_server.cluster`). A ``root`` user with ``root_password`` and the ``root`` role is created and
    ``auth enable`` is issued. When ``user`` is set, that user is created with
    ``password`` and a role (``role``, default ``"<user>-rw"``) granting
    READWRITE on the keys starting with ``prefix`` only (all keys when
    ``prefix`` is empty).

    Passwords are excluded from ``repr`` and are only ever sent in request
    bodies to the server's JSON gateway.
    """

    root_password: str = dataclasses.field(repr=False)
    user: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    prefix: bytes | str = b""
    role: str | None = None

    def __post_init__(self) -> None:
        if not self.root_password:
            raise ValueError("AuthConfig.root_password must not be empty")
        if self.user is not None and not self.password:
            raise ValueError("AuthConfig.user needs a password")
        if self.user == "root":
            raise ValueError("AuthConfig.user must not be 'root'")

    @property
    def prefix_bytes(self) -> bytes:
        """``prefix`` as bytes (UTF-8 if given as str)."""
        p = self.prefix
        return p.encode() if isinstance(p, str) else bytes(p)

    @property
    def role_name(self) -> str | None:
        """Name of the limited user's role, or None without a limited user."""
        if self.user is None:
            return None
        return self.role or f"{self.user}-rw"
