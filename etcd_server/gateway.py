"""etcd's JSON gateway and plain HTTP endpoints, its error answers, and the auth set-up.

:class:`Gateway` POSTs JSON to ``/v3/...`` (etcd's gRPC gateway) and GETs ``/health`` and
``/metrics``, never through an HTTP proxy, optionally over a unix socket (the private
set-up listener). Every call blocks for at most its ``timeout``. An error answer becomes
:class:`EtcdGatewayError`; no answer at all is an ``OSError``.

:func:`setup_auth` creates the root user and role, the optional prefix-limited user, and
enables auth; idempotent, on etcd 3.4 to 3.7. Passwords travel in request bodies only,
never in URLs, argv or logs. Standard library only.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import http.client
import json
import logging
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

__all__ = [
    "GRPC_FAILED_PRECONDITION",
    "GRPC_INVALID_ARGUMENT",
    "GRPC_PERMISSION_DENIED",
    "GRPC_UNAUTHENTICATED",
    "NO_CODE",
    "AuthConfig",
    "EtcdGatewayError",
    "Gateway",
    "auth_enabled",
    "keyspace_revision",
    "setup_auth",
]

logger = logging.getLogger(__name__)

# gRPC status codes etcd reports in the gateway's ``code`` field.
GRPC_INVALID_ARGUMENT = 3
GRPC_PERMISSION_DENIED = 7
GRPC_FAILED_PRECONDITION = 9
GRPC_UNAUTHENTICATED = 16
NO_CODE = -1


class EtcdGatewayError(RuntimeError):
    """An error answer from etcd's JSON gateway (``/v3/...``).

    etcd 3.4 to 3.7 all put the gRPC status code in the answer's ``code`` field (the rest of
    the body changed in 3.6), so errors are told apart by :attr:`code` and :attr:`http_status`
    only, never by message text.

    Attributes:
        path: the gateway path requested.
        http_status: HTTP status code of the answer.
        code: the gRPC status code (e.g. 9 FAILED_PRECONDITION), -1 when there was none.
        etcd_message: etcd's error message (for people; do not parse it).
    """

    def __init__(self, path: str, http_status: int, code: int, etcd_message: str):
        self.path = path
        self.http_status = http_status
        self.code = code
        self.etcd_message = etcd_message
        super().__init__(
            f"etcd {path} failed: {etcd_message} (grpc code {code}, HTTP {http_status})"
        )

    @property
    def is_auth_error(self) -> bool:
        """True for PERMISSION_DENIED (7) and UNAUTHENTICATED (16, e.g. a stale token).

        etcd reports a missing token and a wrong password as INVALID_ARGUMENT
        (3), which by code alone cannot be told from a malformed request.
        """
        return self.code in (GRPC_PERMISSION_DENIED, GRPC_UNAUTHENTICATED)

    @property
    def refused_by_gateway(self) -> bool:
        """True when the gateway refused the request before etcd's gRPC API (HTTP 400, no gRPC code).

        In etcd 3.4 to 3.7 the one such refusal is for a TLS client whose certificate has a
        CommonName while auth is enabled, so it also says auth is on.
        """
        return self.http_status == 400 and self.code == NO_CODE


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` of the keys starting with ``prefix`` (``b"\\0"``: all keys).

    Twin of ``etcd_store.client.prefix_range_end``, which standard-library-only etcd_server cannot import.
    """
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\0"


class _UnixConnection(http.client.HTTPConnection):
    """Plain HTTP over a unix socket (the private set-up listener of :mod:`etcd_server.cluster`)."""

    def __init__(self, socket_path: str, host: str, timeout: float | None = None, **_: Any) -> None:
        super().__init__(host, timeout=timeout)
        self._socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class _UnixHandler(urllib.request.HTTPHandler):
    """``http://`` requests sent over one unix socket instead of TCP."""

    def __init__(self, socket_path: str) -> None:
        super().__init__()
        self._socket_path = socket_path

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_UnixConnection, self._socket_path), req)  # type: ignore[arg-type]


class Gateway:
    """Minimal client for etcd's v3 JSON gateway (POST + JSON, no proxies).

    ``unix_socket``: send every request over it (``base_url`` then only names the ``Host``
    header, e.g. ``http://localhost``).
    """

    def __init__(
        self, base_url: str, ssl_context: ssl.SSLContext | None = None, *, unix_socket: str | None = None
    ):
        self.base_url = base_url.rstrip("/")
        self.unix_socket = unix_socket
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if unix_socket is not None:
            handlers.append(_UnixHandler(unix_socket))
        if ssl_context is not None:
            handlers.append(urllib.request.HTTPSHandler(context=ssl_context))
        self._opener = urllib.request.build_opener(*handlers)

    def call(
        self,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        timeout: float = 5.0,
        token: str | None = None,
    ) -> dict[str, Any]:
        """POST ``body`` to ``path``; the decoded JSON answer. Blocks up to ``timeout`` seconds.

        Raises:
            EtcdGatewayError: etcd answered with an error.
            OSError: (incl. ``URLError``, ``ssl.SSLError``, ``TimeoutError``) no answer.
        """
        req = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body or {}).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        if token:
            req.add_header("Authorization", token)
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                raw = resp.read()
                status = int(resp.status)
        except urllib.error.HTTPError as e:
            raw = e.read()
            status = e.code
        try:
            data = json.loads(raw or b"{}")
        except ValueError:
            text = raw[:500].decode("utf-8", "replace").strip() or f"empty answer, HTTP {status}"
            raise EtcdGatewayError(path, status, NO_CODE, text) from None
        if not isinstance(data, dict):
            raise EtcdGatewayError(path, status, NO_CODE, f"unexpected answer {raw[:200]!r}")
        if status >= 400:
            # 3.4/3.5: {"error", "message", "code"}; 3.6+: {"code", "message"}.
            msg = str(data.get("message") or data.get("error") or f"HTTP {status}")
            code = data.get("code", NO_CODE)
            raise EtcdGatewayError(path, status, code if isinstance(code, int) else NO_CODE, msg)
        return data

    def get(self, path: str, *, timeout: float = 5.0) -> tuple[int, bytes]:
        """``GET path`` (outside the gateway): ``(HTTP status, body)``.

        Raises:
            OSError: no answer (refused, TLS failure, time-out).
        """
        try:
            with self._opener.open(self.base_url + path, timeout=timeout) as resp:
                return int(resp.status), resp.read()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read()

    def health(self, *, timeout: float = 5.0) -> str | None:
        """``GET /health``: None when etcd reports ``"health": "true"``, else why not.

        Why this probe: :mod:`etcd_server.member`, *Readiness*. Raises ``OSError``: no answer.
        """
        status, body = self.get("/health", timeout=timeout)
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            data = None
        if status == 200 and isinstance(data, dict) and str(data.get("health")) == "true":
            return None
        return f"/health answered HTTP {status}: {body[:200].decode('utf-8', 'replace').strip()}"

    def is_leader(self, *, timeout: float = 5.0) -> bool:
        """True if this member's ``/metrics`` says ``etcd_server_is_leader 1`` (etcd 3.4 to 3.7, no auth).

        Raises ``OSError``: no answer.
        """
        status, body = self.get("/metrics", timeout=timeout)
        if status != 200:
            return False
        for line in body.splitlines():
            if line.startswith(b"etcd_server_is_leader "):
                return line.split()[1] in (b"1", b"1.0")
        return False


@dataclasses.dataclass(frozen=True)
class AuthConfig:
    """Turn on etcd authentication before the server first serves its client port.

    Creates a ``root`` user (``root_password``, ``root`` role) and issues ``auth enable``;
    with ``user``, also that user (``password``) and a role (``role``, default
    ``"<user>-rw"``) granting READWRITE on the keys starting with ``prefix`` only (all keys
    when ``prefix`` is empty). How and when: :mod:`etcd_server.cluster`.

    Validated at construction (``ValueError`` naming the field). Passwords are left out of
    ``repr`` and only ever sent in request bodies to the server's JSON gateway.
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


def auth_enabled(gateway: Gateway, auth: AuthConfig, *, timeout: float = 10.0) -> bool:
    """Whether auth is on, asked with ``Authenticate`` as root (one round trip).

    By gRPC code, the same in etcd 3.4 to 3.7: success means on; FAILED_PRECONDITION is
    ``Authenticate``'s answer when auth is off (its only use of that code); a gateway
    refusal without a code happens only with auth on (:attr:`EtcdGatewayError.refused_by_gateway`).
    Anything else, e.g. INVALID_ARGUMENT for another root password, is raised.
    """
    try:
        gateway.call(
            "/v3/auth/authenticate",
            {"name": "root", "password": auth.root_password},
            timeout=timeout,
        )
        return True
    except EtcdGatewayError as e:
        if e.code == GRPC_FAILED_PRECONDITION:
            return False
        if e.refused_by_gateway:
            return True
        raise


def setup_auth(gateway: Gateway, auth: AuthConfig, *, timeout: float = 10.0) -> None:
    """Create the root user/role (and the limited user), enable auth, and check that etcd holds
    exactly those users and roles.

    Called over the private unix socket, before the client port exists
    (:mod:`etcd_server.cluster`). Idempotent: if the root password already authenticates,
    nothing changes. Users and roles an interrupted set-up left are kept (listed first, never
    re-added, so no error text is matched) but their passwords are set again: a client that
    reached the port before auth was on may have created them. Anything else found before
    the enable or after it (:func:`_verify_auth`), or a keyspace revision that moved
    meanwhile, raises. Blocks for about fifteen gateway round trips, each up to ``timeout``.

    Raises:
        EtcdGatewayError: etcd refused a step (e.g. auth already enabled with another root
            password: INVALID_ARGUMENT), or holds users, roles, grants or writes this set-up did
            not make.
        OSError: the gateway did not answer.
    """
    if auth_enabled(gateway, auth, timeout=timeout):
        logger.info("etcd auth is already enabled; leaving users and roles as they are")
        return
    revision = keyspace_revision(gateway, timeout=timeout)
    _add_users_and_roles(gateway, auth, timeout)
    _verify_auth(gateway, auth, timeout, token=None)  # before: nothing of anyone else's gets enabled
    gateway.call("/v3/auth/enable", {}, timeout=timeout)
    try:  # after: nothing added between that check and the enable, nothing written meanwhile
        token = gateway.call(
            "/v3/auth/authenticate", {"name": "root", "password": auth.root_password}, timeout=timeout
        ).get("token")
        _verify_auth(gateway, auth, timeout, token=str(token))
        after = keyspace_revision(gateway, timeout=timeout, token=str(token))
        if after != revision:
            raise EtcdGatewayError(
                "/v3/kv/range", 0, NO_CODE,
                f"the keyspace revision moved from {revision} to {after} while auth was being set up "
                "(a client wrote before auth was enabled?); refusing to serve it",
            )
    except EtcdGatewayError as e:
        if not e.refused_by_gateway:
            raise
        # With auth on, the gateway refuses a client certificate naming a user (its CN); never on
        # the private socket (no TLS).
        logger.info("etcd auth enabled; the gateway refuses the re-check with this client certificate")
    logger.info(
        "etcd auth enabled (root%s)",
        f", user {auth.user!r} limited to prefix {auth.prefix_bytes!r}" if auth.user else "",
    )


def _users_and_roles(call: Callable[[str, dict[str, Any]], dict[str, Any]]) -> tuple[set[str], set[str]]:
    """The names of the users and of the roles etcd holds (two gateway calls)."""
    return (set(call("/v3/auth/user/list", {}).get("users") or ()),
            set(call("/v3/auth/role/list", {}).get("roles") or ()))  # fmt: skip


def _add_users_and_roles(gateway: Gateway, auth: AuthConfig, timeout: float) -> None:
    """Create (or set the password of) root and the limited user, their roles and grants."""
    call = functools.partial(gateway.call, timeout=timeout)
    users, roles = _users_and_roles(call)
    wanted = [("root", auth.root_password)] + ([(auth.user, auth.password)] if auth.user else [])
    for name, password in wanted:
        verb = "changepw" if name in users else "add"
        call(f"/v3/auth/user/{verb}", {"name": name, "password": password})
    if "root" not in roles:
        call("/v3/auth/role/add", {"name": "root"})
    call("/v3/auth/user/grant", {"user": "root", "role": "root"})  # no-op when granted
    if auth.user is not None and auth.role_name is not None:
        if auth.role_name not in roles:
            call("/v3/auth/role/add", {"name": auth.role_name})
        call("/v3/auth/role/grant", {"name": auth.role_name, "perm": _perm(auth.prefix_bytes)})
        call("/v3/auth/user/grant", {"user": auth.user, "role": auth.role_name})


def keyspace_revision(gateway: Gateway, *, timeout: float = 10.0, token: str | None = None) -> int:
    """The keyspace's current revision (the header of a linearizable one-key range; etcd 3.4 to 3.7).

    Raises:
        EtcdGatewayError: refused (e.g. auth on and no ``token``), or no revision in the answer.
        OSError: the gateway did not answer.
    """
    header = gateway.call(
        "/v3/kv/range", {"key": _b64(b"\0"), "range_end": _b64(b"\0"), "limit": 1, "keys_only": True},
        timeout=timeout, token=token,
    ).get("header") or {}
    try:
        return int(header.get("revision") or 0)
    except (TypeError, ValueError):
        raise EtcdGatewayError("/v3/kv/range", 0, NO_CODE, f"no revision in {header!r}") from None


def _perm(prefix: bytes) -> dict[str, str]:
    return {"permType": "READWRITE", "key": _b64(prefix or b"\0"), "range_end": _b64(_prefix_end(prefix))}


def _verify_auth(gateway: Gateway, auth: AuthConfig, timeout: float, token: str | None) -> None:
    """Read back (as root with ``token`` once auth is on) that etcd has exactly the users, roles
    and grants of ``auth``. Raises ``EtcdGatewayError`` (status 0) naming what else it found."""
    call = functools.partial(gateway.call, timeout=timeout, token=token)
    users, roles = _users_and_roles(call)
    want_users = {"root"} | ({auth.user} if auth.user else set())
    want_roles = {"root"} | ({auth.role_name} if auth.role_name else set())
    problems = [f"users {sorted(users - want_users)}" if users - want_users else "",
                f"roles {sorted(roles - want_roles)}" if roles - want_roles else ""]
    for user in want_users:
        granted = set(call("/v3/auth/user/get", {"name": user}).get("roles") or ())
        expected = {"root"} if user == "root" else {auth.role_name}
        if granted != expected:
            problems.append(f"user {user!r} with roles {sorted(granted)}")
    if auth.role_name:
        perms = call("/v3/auth/role/get", {"role": auth.role_name}).get("perm") or []
        mine = _perm(auth.prefix_bytes)
        if [(p.get("key"), p.get("range_end")) for p in perms] != [(mine["key"], mine["range_end"])]:
            problems.append(f"role {auth.role_name!r} with {len(perms)} permissions, not the one of its prefix")
    problems = [p for p in problems if p]
    if problems:
        raise EtcdGatewayError(
            "/v3/auth", 0, NO_CODE,
            "etcd holds auth entries this set-up did not create (a client reached it before auth was "
            f"enabled?): {'; '.join(problems)}; refusing to serve it",
        )
