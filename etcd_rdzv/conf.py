"""The one configuration pass: torch's ``RendezvousParameters`` -> client options + backend settings.

Every backend reads ``--rdzv-endpoint``, ``--rdzv-id``, ``--nnodes``, ``--local-addr`` and
``--rdzv-conf`` here, in one call: :func:`parse_dynamic_settings` -> :class:`DynamicSettings`
(``etcd-v2``, ``etcd``), :func:`parse_v3_settings` ->
:class:`~etcd_rdzv.native.settings.V3Settings` and
:class:`~etcd_store.options.EtcdClientOptions` (``etcd-v3``); both start from
:func:`parse_rdzv_config` -> :class:`RdzvConfig`. Each key's parser, default and meaning
are its row of :data:`etcd_rdzv.conf_keys.KEYS`; here is what no single key decides: the
endpoint, the TLS files and credentials with their environment fallbacks
(:mod:`etcd_rdzv.conf_env`), the lease TTL of ``etcd-v3``, the legacy ``etcd`` names.

Nothing here contacts etcd, or imports torch or gRPC at import time. Every invalid value
raises ``ValueError`` naming the rdzv-conf key (or ``--rdzv-endpoint``) and the value.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from dataclasses import dataclass, fields
from typing import Any, Protocol

from etcd_store.options import EtcdClientOptions

from . import conf_keys as K
from .conf_env import Given, read_secret, resolve_connection
from .conf_keys import (
    DEFAULT_KEY_PREFIX,
    DEFAULT_STATE_TTL,
    LEGACY_ALIASES,
    LEGACY_KEY_PREFIX,
    MAX_STATE_TTL,
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    read,
    reads,
    warn_unknown_keys,
)
from .conf_keys import text as _text_value
from .native.settings import V3Settings

log = logging.getLogger(__name__)


__all__ = [
    "DynamicSettings",
    "EtcdClientOptions",
    "HandlerParams",
    "RdzvConfig",
    "RdzvParams",
    "check_run_id",
    "parse_client_options",
    "parse_dynamic_settings",
    "parse_rdzv_config",
    "parse_v3_settings",
    "translate_legacy_params",
]


class RdzvParams(Protocol):
    """The part of ``RendezvousParameters`` read here."""

    endpoint: str
    config: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any: ...


class HandlerParams(RdzvParams, Protocol):
    """All of torch's ``RendezvousParameters`` that a handler reads."""

    backend: str
    run_id: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None: ...


#: Under an etcd-v2 run's state key: its backends' lease anchors
#: (``<state key>/lease/<lease hex>``: :class:`etcd_rdzv.dynamic.backend.EtcdRendezvousBackend`).
V2_ANCHOR_DIR = "lease"
#: Under an etcd-v2 run's state key: its nodes' presence keys (``<state key>/alive/<node>``,
#: :mod:`etcd_rdzv.dynamic.presence`).
V2_PRESENCE_DIR = "alive"


@dataclass(frozen=True)
class RdzvConfig:
    """Client options plus the backend settings of one rendezvous."""

    client: EtcdClientOptions
    key_prefix: str = DEFAULT_KEY_PREFIX
    state_ttl: int = DEFAULT_STATE_TTL

    def state_key(self, run_id: str) -> str:
        """``<key_prefix>/<run_id>`` (just ``run_id`` with an empty prefix)."""
        return f"{self.key_prefix}/{run_id}" if self.key_prefix else run_id

    def store_prefix(self, run_id: str) -> str:
        """Prefix of the run's ``EtcdStore`` keys: ``<state key>/store``."""
        return f"{self.state_key(run_id)}/store"


@dataclass(frozen=True)
class DynamicSettings:
    """The settings of an ``etcd-v2``/``etcd`` rendezvous, each field the rdzv-conf key of its name
    (seconds unless the key says otherwise; see :data:`etcd_rdzv.conf_keys.KEYS`); ``config``
    holds the client options, ``key_prefix`` and ``state_ttl``.
    """

    backend: str
    run_id: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None
    config: RdzvConfig
    join_timeout: float = K.DEFAULT_JOIN_TIMEOUT
    last_call_timeout: float = K.DEFAULT_LAST_CALL_TIMEOUT
    close_timeout: float = K.DEFAULT_CLOSE_TIMEOUT
    heartbeat_timeout: float = K.DEFAULT_HEARTBEAT_TIMEOUT
    keep_alive_interval: float = K.DEFAULT_KEEP_ALIVE_INTERVAL
    keep_alive_max_attempt: int = K.DEFAULT_KEEP_ALIVE_MAX_ATTEMPT
    cas_backoff_max_seconds: float = K.DEFAULT_CAS_BACKOFF_MAX_SECONDS
    presence_ttl: int = K.DEFAULT_PRESENCE_TTL
    fast_recovery: bool = False


# --------------------------------------------------------------------------- connection values


def _text(params: RdzvParams, key: str) -> str | None:
    """The string ``key`` holds, stripped; ``None`` when absent or blank."""
    value = params.get(key)
    return None if value is None else (_text_value(key, value) or None)


def _readable_file(params: RdzvParams, key: str) -> str | None:
    path = _text(params, key)
    if path is not None and not os.path.isfile(path):
        raise ValueError(
            f"The rendezvous configuration option {key!r} names {path!r}, which is not a "
            "readable file."
        )
    return path


def _holds_private_key(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return b"PRIVATE KEY-----" in f.read()
    except OSError:
        return False


_password_in_conf_warned = False


def _password(params: RdzvParams) -> str | None:
    """The etcd password of the rdzv-conf: option ``password``, else the file named by
    ``password_file``, else ``None``. The contents never appear in a message."""
    global _password_in_conf_warned
    password = params.get("password")
    if password is not None:
        if not isinstance(password, str):
            raise ValueError("The rendezvous configuration option 'password' must be a string.")
        if not _password_in_conf_warned:
            _password_in_conf_warned = True
            log.warning(
                "The etcd password was given as the rdzv-conf option 'password': torchrun prints its "
                "rdzv-conf in its own log. Prefer 'password_file' (a path to a file holding it), "
                "$%s or $%s.", PASSWORD_FILE_ENV, PASSWORD_ENV,
            )  # fmt: skip
        return password
    path = _text(params, "password_file")
    if path is not None:
        return read_secret(path, "The rendezvous configuration option 'password_file'")
    return None  # then our variables, then etcdctl's (conf_env.resolve_connection)


# --------------------------------------------------------------------------- public


def check_run_id(run_id: object) -> str:
    """``run_id`` (``--rdzv-id``) if every backend can use it; ``ValueError`` saying why not.

    It names the subtree ``<key_prefix>/<run_id>/...``: non-empty, without NUL or ``/``
    (which would nest one run's keys inside another's).
    """
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"The rendezvous run id (--rdzv-id) must be a non-empty string, got {run_id!r}.")
    if "/" in run_id or "\0" in run_id:
        bad = "'/'" if "/" in run_id else "a NUL character"
        raise ValueError(
            f"The rendezvous run id (--rdzv-id) must not contain {bad}, got {run_id!r}: it names a "
            "subtree of etcd keys, and a '/' would nest one run's keys inside another's."
        )
    return run_id


def parse_client_options(params: RdzvParams) -> EtcdClientOptions:
    """Read the endpoint(s), ``read_timeout``, TLS and auth keys; ``ValueError`` naming a bad key or variable.

    ``user``/``password`` fall back to ``$ETCD_RDZV_USER``/``$ETCD_RDZV_PASSWORD`` (secrets
    off command lines); an empty endpoint, the TLS files and the credentials then to etcdctl's
    ``ETCDCTL_*``, and the endpoint to ``localhost:2379``
    (:func:`etcd_rdzv.conf_env.resolve_connection`, the one resolver).
    """
    given = Given(
        endpoints=_endpoint(params), ca_cert=_readable_file(params, "ca_cert"),
        cert=_readable_file(params, "ssl_cert"), key=_readable_file(params, "ssl_cert_key"),
        user=_text(params, "user"), password=_password(params),
        user_option="the option 'user'", password_option="the option 'password_file' (a file holding it) or 'password'",
    )  # fmt: skip
    conn = resolve_connection(given, os.environ)
    options = EtcdClientOptions(
        endpoints=conn.endpoints, timeout=read(params, "read_timeout"),
        protocol=_protocol(params), ca_cert=conn.ca_cert, cert=conn.cert, key=_client_key(conn.cert, conn.key),
        user=conn.user, password=conn.password, allow_insecure_auth=read(params, "allow_insecure_auth"),
    )  # fmt: skip
    _check_transport(options)
    return options


def _endpoint(params: RdzvParams) -> str | None:
    """``--rdzv-endpoint`` checked (``ValueError`` naming the bad part), or ``None`` when empty."""
    from etcd_store.client import parse_endpoints

    spec = (params.endpoint or "").strip()
    if not spec:
        return None
    try:
        parse_endpoints(spec, check_schemes=False)
    except ValueError as e:  # e names the bad part; spec may hold a password
        raise ValueError(f"Invalid --rdzv-endpoint: {e}") from None
    return spec


def _protocol(params: RdzvParams) -> str | None:
    """The option ``protocol`` (``http`` or ``https``, any case), or ``None``."""
    protocol = _text(params, "protocol")
    if protocol is not None and protocol.lower() not in ("http", "https"):
        raise ValueError(
            f"The rendezvous configuration option 'protocol' must be 'http' or 'https', "
            f"got {params.get('protocol')!r}."
        )
    return None if protocol is None else protocol.lower()


def _client_key(cert: str | None, key: str | None) -> str | None:
    """The client key: ``key``, or ``cert`` itself when it holds the key too (torch's etcd-v2
    accepts one PEM file holding both); ``ValueError`` for a key without a certificate."""
    if key is not None and cert is None:
        raise ValueError("The rendezvous configuration option 'ssl_cert_key' was given without 'ssl_cert'.")
    if cert is not None and key is None:
        if not _holds_private_key(cert):
            raise ValueError(
                f"The rendezvous configuration option 'ssl_cert' ({cert!r}) holds no private "
                "key: give the key file as 'ssl_cert_key'."
            )
        return cert
    return key


def _check_transport(options: EtcdClientOptions) -> None:
    """The client's own checks of endpoints against TLS and credentials, run at parse time.

    ``ValueError`` naming the option to change for mixed schemes, a scheme contradicting
    ``protocol``/the TLS files, or a password bound for plain text without ``allow_insecure_auth``.
    """
    from etcd_store.client import client_endpoints

    try:
        client_endpoints(
            options.endpoints, protocol=options.protocol, tls=bool(options.ca_cert or options.cert),
            user=options.user, password=options.password, allow_insecure_auth=options.allow_insecure_auth,
        )
    except ValueError as e:
        raise ValueError(f"Invalid etcd connection options: {e}") from None


def parse_rdzv_config(
    params: RdzvParams, *, default_key_prefix: str = DEFAULT_KEY_PREFIX
) -> RdzvConfig:
    """Client options plus ``key_prefix`` and ``state_ttl``. Raises ``ValueError`` naming the key."""
    client = parse_client_options(params)
    raw_prefix = params.get("key_prefix")
    if raw_prefix is None:
        key_prefix = default_key_prefix
    elif not isinstance(raw_prefix, str):
        raise ValueError(
            f"The rendezvous configuration option 'key_prefix' must be a string, got {raw_prefix!r}."
        )
    else:
        key_prefix = raw_prefix.strip()
        if any(c.isspace() for c in key_prefix):
            raise ValueError(
                f"The rendezvous configuration option 'key_prefix' must not contain blanks, "
                f"got {raw_prefix!r}."
            )
    key_prefix = key_prefix.rstrip("/")
    state_ttl = read(params, "state_ttl")
    if state_ttl > MAX_STATE_TTL:
        raise ValueError(
            f"The rendezvous configuration option 'state_ttl' must be at most {MAX_STATE_TTL} "
            f"seconds (etcd's longest lease is 1.5 times that), got {state_ttl}."
        )
    return RdzvConfig(client=client, key_prefix=key_prefix, state_ttl=state_ttl)


def parse_dynamic_settings(params: HandlerParams, *, legacy: bool = False) -> DynamicSettings:
    """The settings of an ``etcd-v2`` (with ``legacy``, ``etcd``: :func:`translate_legacy_params`) rendezvous.

    Raises ``ValueError`` naming the bad key; warns once about keys it would ignore
    (:func:`etcd_rdzv.conf_keys.warn_unknown_keys`).
    """
    warn_unknown_keys(params.backend, "etcd" if legacy else "etcd-v2", params.config)
    if legacy:
        params = translate_legacy_params(params)
    presence_ttl = _presence_ttl(params)
    fast = read(params, "fast_recovery", "etcd-v2")
    if fast and not presence_ttl:
        raise ValueError("The rendezvous configuration option 'fast_recovery' needs presence (it waits for "
                         "every node whose presence key is alive): it cannot be used with presence_ttl=0.")
    values = _key_fields(params, DynamicSettings, "etcd" if legacy else "etcd-v2", "presence_ttl", "fast_recovery")
    return DynamicSettings(
        backend=params.backend, run_id=check_run_id(params.run_id), min_nodes=params.min_nodes,
        max_nodes=params.max_nodes, local_addr=params.local_addr, config=parse_rdzv_config(params),
        presence_ttl=presence_ttl, fast_recovery=fast, **values,
    )  # fmt: skip


def _key_fields(params: RdzvParams, settings: type, backend: str, *besides: str) -> dict[str, Any]:
    """The fields of ``settings`` that are rdzv-conf keys ``backend`` reads, each parsed by its
    key-table row (except those in ``besides``, which the caller works out).
    """
    return {f.name: read(params, f.name, backend) for f in fields(settings)
            if f.name not in besides and reads(f.name, backend)}  # fmt: skip


def _presence_ttl(params: HandlerParams) -> int:
    """``presence_ttl``: 0 (off) or whole seconds of at least 2 (etcd's shortest lease is ~1.5 s)."""
    ttl: int = read(params, "presence_ttl", "etcd-v2")
    if ttl == 1:
        raise ValueError("The rendezvous configuration option 'presence_ttl' must be 0 (off) or at least 2 "
                         "seconds (etcd's shortest lease is about 1.5 s), got 1.")
    return ttl


def parse_v3_settings(params: HandlerParams) -> tuple[V3Settings, EtcdClientOptions]:
    """The settings and the client options of an ``etcd-v3`` rendezvous.

    Raises ``ValueError`` naming the invalid key; warns once about keys it would ignore. The
    lease TTL is ``heartbeat`` (rounded up to whole seconds) when given, else
    ``keep_alive_interval * keep_alive_max_attempt`` (whole seconds each), as torch's handlers count.
    """
    warn_unknown_keys(params.backend, "etcd-v3", params.config)
    config = parse_rdzv_config(params)
    heartbeat = read(params, "heartbeat", "etcd-v3")
    if heartbeat is not None:
        lease_ttl = math.ceil(heartbeat)
    else:
        lease_ttl = read(params, "keep_alive_interval", "etcd-v3") * read(params, "keep_alive_max_attempt", "etcd-v3")
    values = _key_fields(params, V3Settings, "etcd-v3", "state_ttl", "key_prefix")
    settings = V3Settings(
        run_id=check_run_id(params.run_id), min_nodes=params.min_nodes, max_nodes=params.max_nodes,
        local_addr=params.local_addr, lease_ttl=lease_ttl, state_ttl=config.state_ttl,
        key_prefix=config.key_prefix, **values,
    )  # fmt: skip
    return settings, config.client


def translate_legacy_params(params: Any) -> Any:
    """A copy of ``params`` with the legacy ``etcd`` keys renamed (:data:`LEGACY_ALIASES`).

    The new name wins when both are given (torchrun always adds ``timeout``); ``key_prefix``
    defaults to the legacy ``/torchelastic/p2p``.
    """
    config = dict(params.config)
    for old, new in LEGACY_ALIASES.items():
        if old in config:
            value = config.pop(old)
            config.setdefault(new, value)
    config.setdefault("key_prefix", LEGACY_KEY_PREFIX)
    translated = copy.copy(params)
    translated.config = config
    return translated
