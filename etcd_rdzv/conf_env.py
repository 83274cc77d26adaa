"""Connection settings from the environment: our ``ETCD_RDZV_*`` variables, then etcdctl's ``ETCDCTL_*``.

One precedence for the rendezvous (:mod:`etcd_rdzv.conf`) and the ``etcd-rdzv`` command
(:mod:`etcd_rdzv.cli.connect`), highest first:

1. explicit options: rdzv-conf keys and ``--rdzv-endpoint`` (the command's flags);
2. our variables: ``ETCD_RDZV_USER``, ``ETCD_RDZV_PASSWORD``, ``ETCD_RDZV_PASSWORD_FILE``;
3. etcdctl's ``ETCDCTL_*``, so a shell set up for ``etcdctl`` works unchanged, each only where
   what it stands for is missing: the endpoint when empty (torchrun passes
   ``--rdzv-endpoint=''``), never merged; ``CERT`` and ``KEY`` both or neither; ``USER`` and
   ``PASSWORD`` only when neither a user nor a password came from 1 or 2 (a user is never
   paired with another source's password). Table: docs/configuration.md, *etcdctl's variables*;
4. defaults (``localhost:2379``, :data:`~etcd_rdzv.conf_keys.DEFAULT_ENDPOINT`; no TLS, no auth).

:func:`resolve_connection` is that chain for both callers: they check their explicit options
(:class:`Given`) and get a :class:`Connection`. Each other function is one option's fallback
and reads its variables only when called, so a bad ``ETCDCTL_*`` value that an explicit option
overrides is never an error. A bad value raises ``ValueError`` naming the variable (and a path
or user name, never a password). The ``ETCDCTL_*`` names used (never values) are logged at INFO
once per process per set. Nothing here contacts etcd or imports gRPC.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .conf_keys import DEFAULT_ENDPOINT, PASSWORD_ENV, PASSWORD_FILE_ENV, USER_ENV

log = logging.getLogger(__name__)

__all__ = [
    "Connection",
    "Given",
    "ETCDCTL_CACERT",
    "ETCDCTL_CERT",
    "ETCDCTL_ENDPOINTS",
    "ETCDCTL_KEY",
    "ETCDCTL_PASSWORD",
    "ETCDCTL_USER",
    "etcdctl_ca_cert",
    "etcdctl_cert_pair",
    "etcdctl_credentials",
    "etcdctl_endpoints",
    "note_etcdctl_used",
    "own_env_password",
    "read_secret",
    "resolve_connection",
]

ETCDCTL_ENDPOINTS = "ETCDCTL_ENDPOINTS"
ETCDCTL_CACERT = "ETCDCTL_CACERT"
ETCDCTL_CERT = "ETCDCTL_CERT"
ETCDCTL_KEY = "ETCDCTL_KEY"
ETCDCTL_USER = "ETCDCTL_USER"
ETCDCTL_PASSWORD = "ETCDCTL_PASSWORD"

Environ = Mapping[str, str]


def _value(environ: Environ, name: str) -> str | None:
    """The variable's value, stripped; ``None`` when unset or blank (as etcdctl treats an empty flag)."""
    return (environ.get(name) or "").strip() or None


def read_secret(path: str, what: str) -> str:
    """The contents of a secret file (one trailing newline dropped, as Kubernetes/Docker secrets have).

    Raises ``ValueError`` naming ``what`` and the path, never the contents.
    """
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise ValueError(f"{what} ({path!r}) cannot be read: {reason}.") from None
    return text[:-1] if text.endswith("\n") else text


def own_env_password(environ: Environ) -> str | None:
    """``$ETCD_RDZV_PASSWORD`` (even empty), else the file ``$ETCD_RDZV_PASSWORD_FILE`` names."""
    if PASSWORD_ENV in environ:
        return environ[PASSWORD_ENV]
    path = environ.get(PASSWORD_FILE_ENV) or None
    if path is not None:
        return read_secret(path, f"${PASSWORD_FILE_ENV}")
    return None


def etcdctl_endpoints(environ: Environ) -> str | None:
    """``$ETCDCTL_ENDPOINTS`` if set (checked: ``ValueError`` naming it), else ``None``."""
    from etcd_store.client import parse_endpoints

    spec = _value(environ, ETCDCTL_ENDPOINTS)
    if spec is None:
        return None
    try:
        if not parse_endpoints(spec, check_schemes=False):
            raise ValueError("no endpoint in it")
    except ValueError as e:
        raise ValueError(f"Invalid ${ETCDCTL_ENDPOINTS}: {e}") from None  # e names the part; no password
    return spec


def _file(environ: Environ, name: str) -> str | None:
    path = _value(environ, name)
    if path is not None and not os.path.isfile(path):
        raise ValueError(f"${name} names {path!r}, which is not a readable file.")
    return path


def etcdctl_ca_cert(environ: Environ) -> str | None:
    """``$ETCDCTL_CACERT`` (a file; ``ValueError`` naming the variable otherwise), else ``None``."""
    return _file(environ, ETCDCTL_CACERT)


def etcdctl_cert_pair(environ: Environ) -> tuple[str | None, str | None]:
    """``($ETCDCTL_CERT, $ETCDCTL_KEY)``: both files, or ``(None, None)``; one alone is a ``ValueError``."""
    cert, key = _file(environ, ETCDCTL_CERT), _file(environ, ETCDCTL_KEY)
    if (cert is None) != (key is None):
        given, missing = (ETCDCTL_CERT, ETCDCTL_KEY) if key is None else (ETCDCTL_KEY, ETCDCTL_CERT)
        raise ValueError(f"${given} is set but ${missing} is not: etcdctl's client certificate needs both.")
    return cert, key


def etcdctl_credentials(environ: Environ) -> tuple[str | None, str | None]:
    """``(user, password)`` from ``$ETCDCTL_USER``/``$ETCDCTL_PASSWORD``, or ``(None, None)``.

    With ``$ETCDCTL_PASSWORD`` set, ``$ETCDCTL_USER`` is the whole user name; without it,
    ``$ETCDCTL_USER`` is ``name:password`` (split at the first ``:``). A user without a
    password (etcdctl would prompt for one) or a password without a user is a ``ValueError``.
    """
    raw = environ.get(ETCDCTL_USER) or ""
    password = environ.get(ETCDCTL_PASSWORD) or None
    if not raw.strip():
        if password is not None:
            raise ValueError(f"${ETCDCTL_PASSWORD} is set but ${ETCDCTL_USER} is not.")
        return None, None
    if password is None:
        name, sep, password = raw.partition(":")
        if not sep:
            raise ValueError(
                f"${ETCDCTL_USER} names the etcd user {raw.strip()!r} without a password: write it "
                f"as name:password or set ${ETCDCTL_PASSWORD} (or use ${PASSWORD_FILE_ENV})."
            )
    else:
        name = raw
    name = name.strip()
    if not name:
        raise ValueError(f"${ETCDCTL_USER} gives an empty user name.")
    return name, password


_noted: set[frozenset[str]] = set()
_noted_lock = threading.Lock()


def note_etcdctl_used(names: Iterable[str]) -> None:
    """Log at INFO, once per process per set of names, which ``ETCDCTL_*`` variables were used."""
    used = frozenset(names)
    if not used:
        return
    with _noted_lock:
        if used in _noted:
            return
        _noted.add(used)
    log.info("etcd-rdzv: using etcdctl's environment variables %s", ", ".join(f"${n}" for n in sorted(used)))


# --------------------------------------------------------------------------- the one resolver


@dataclass(frozen=True)
class Given:
    """The connection options a caller was given explicitly (rdzv-conf keys, the command's flags),
    each already checked by the caller; ``None``: not given. ``user_option``/``password_option``
    name where the caller takes them, for errors ("" when it takes none: the command)."""

    endpoints: str | None = None
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    user_option: str = ""
    password_option: str = ""


@dataclass(frozen=True)
class Connection:
    """Where and as whom to connect, every fallback applied (:func:`resolve_connection`)."""

    endpoints: str
    ca_cert: str | None
    cert: str | None
    key: str | None
    user: str | None
    password: str | None = field(repr=False)


def resolve_connection(given: Given, environ: Environ) -> Connection:
    """The module docstring's precedence applied to ``given``. Raises ``ValueError`` naming the
    variable or option (never a password): a bad ``ETCDCTL_*`` value, a user without a password
    or a password without a user.
    """
    used: list[str] = []  # the ETCDCTL_* variables taken
    endpoints = given.endpoints
    if not endpoints and (endpoints := etcdctl_endpoints(environ)) is not None:
        used.append(ETCDCTL_ENDPOINTS)
    ca_cert = given.ca_cert
    if ca_cert is None and (ca_cert := etcdctl_ca_cert(environ)) is not None:
        used.append(ETCDCTL_CACERT)
    cert, key = given.cert, given.key
    if cert is None and key is None and (pair := etcdctl_cert_pair(environ))[0] is not None:
        cert, key = pair
        used += [ETCDCTL_CERT, ETCDCTL_KEY]
    user, password = _credentials(given, environ, used)
    note_etcdctl_used(used)
    return Connection(endpoints or DEFAULT_ENDPOINT, ca_cert, cert, key, user, password)


def _credentials(given: Given, environ: Environ, used: list[str]) -> tuple[str | None, str | None]:
    """``(user, password)``: given, else ours (``$ETCD_RDZV_USER`` and the password variables), else
    etcdctl's when neither came from those (a user is never paired with another source's password)."""
    user = given.user or environ.get(USER_ENV) or None
    password = given.password if given.password is not None else own_env_password(environ)
    if user is None and password is None:
        user, password = etcdctl_credentials(environ)
        used += [ETCDCTL_USER] if user is not None else []
        return user, password
    user_hint = " or ".join(x for x in (given.user_option, f"${USER_ENV}") if x)
    password_hint = ", ".join(x for x in (given.password_option, f"${PASSWORD_FILE_ENV} or ${PASSWORD_ENV}") if x)
    if user is None:
        if password:
            raise ValueError(f"An etcd password was given ({password_hint}) but no user: set {user_hint}.")
        return None, None
    if password is None:
        source = given.user_option if given.user else f"${USER_ENV}"
        raise ValueError(
            f"The etcd user {user!r} was given without a password ({source} is set): set {password_hint}."
        )
    return user, password
