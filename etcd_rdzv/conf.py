"""The one configuration pass: torch's ``RendezvousParameters`` -> client options + backend settings.

Every backend of the package reads its ``--rdzv-endpoint``, ``--rdzv-id``,
``--nnodes``, ``--local-addr`` and ``--rdzv-conf`` here, in one call:

* :func:`parse_dynamic_settings` -> :class:`DynamicSettings` (``etcd-v2`` and
  ``etcd``: torch's ``DynamicRendezvousHandler`` over our backend);
* :func:`parse_v3_settings` -> :class:`~etcd_rdzv.native.settings.V3Settings`
  and :class:`EtcdClientOptions` (``etcd-v3``);
* both start from :func:`parse_rdzv_config` -> :class:`RdzvConfig` (client
  options, ``key_prefix``, ``state_ttl``), also usable alone.

Nothing here contacts etcd or imports torch or gRPC at import time. Every
invalid value raises ``ValueError`` naming the rdzv-conf key (or
``--rdzv-endpoint``) and the value that was wrong. One parser per kind of value:
:func:`get_seconds_or`, :func:`get_non_negative_seconds`, :func:`get_positive_int`, :func:`get_bool`, and the
private text and readable-file readers.

Connection keys (every backend; torch's ``etcd-v2`` keys keep their meaning):
``read_timeout`` (60 s, the deadline of every etcd call), ``protocol`` (the scheme
of endpoints written without one: ``http``, or ``https`` once a certificate is
given), ``ssl_cert``/``ssl_cert_key``/``ca_cert`` (PEM files; ``ssl_cert`` alone
must also hold the key), ``user``/``password`` (default ``$ETCD_RDZV_USER``/
``$ETCD_RDZV_PASSWORD``; refused over ``http`` unless ``allow_insecure_auth=1``, which logs a
warning), ``key_prefix`` (``/torch/elastic/rendezvous``; the state
key is ``<key_prefix>/<run_id>``), ``state_ttl`` (7200 s the state outlives its
last write). ``--rdzv-endpoint`` is ``host[:port]`` or ``http(s)://host:port``,
several separated by commas, all of one scheme (no ``user:pw@``); empty means ``$ETCDCTL_ENDPOINTS``, else
``localhost:2379``. etcdctl's ``ETCDCTL_CACERT``/``CERT``/``KEY``/``USER``/``PASSWORD``
come last, below the keys and our variables (:mod:`etcd_rdzv.conf_env`). The legacy ``etcd``
keys (``cacert``, ``cert``, ``key``, ``etcd_prefix``, ``timeout``) are renamed by
:func:`translate_legacy_params`. The rendezvous keys of each backend are listed
on :class:`DynamicSettings` and ``V3Settings``; docs/configuration.md has them all.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .conf_env import Given, read_secret, resolve_connection
from .conf_keys import warn_unknown_keys
from .defaults import (
    DEFAULT_CLOSE_TIMEOUT,
    DEFAULT_ENDPOINT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_JOIN_TIMEOUT,
    DEFAULT_KEEP_ALIVE_INTERVAL,
    DEFAULT_KEEP_ALIVE_MAX_ATTEMPT,
    DEFAULT_KEY_PREFIX,
    DEFAULT_LAST_CALL_TIMEOUT,
    DEFAULT_LEASE_TTL,
    DEFAULT_PRESENCE_TTL,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_STATE_TTL,
    LEGACY_KEY_PREFIX,
    MAX_STATE_TTL,
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    USER_ENV,
)
from .native.settings import (
    DEFAULT_EVICT_MISSES,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_RENEW_INTERVAL,
    V3Settings,
)

if TYPE_CHECKING:
    from etcd_store.client import EtcdClient

log = logging.getLogger(__name__)


__all__ = [
    "check_run_id",
    "DEFAULT_CLOSE_TIMEOUT",
    "DEFAULT_ENDPOINT",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_JOIN_TIMEOUT",
    "DEFAULT_KEEP_ALIVE_INTERVAL",
    "DEFAULT_KEEP_ALIVE_MAX_ATTEMPT",
    "DEFAULT_PRESENCE_TTL",
    "DEFAULT_KEY_PREFIX",
    "DEFAULT_LAST_CALL_TIMEOUT",
    "DEFAULT_LEASE_TTL",
    "DEFAULT_READ_TIMEOUT",
    "DEFAULT_STATE_TTL",
    "LEGACY_ALIASES",
    "LEGACY_KEY_PREFIX",
    "MAX_STATE_TTL",
    "PASSWORD_ENV",
    "PASSWORD_FILE_ENV",
    "USER_ENV",
    "DynamicSettings",
    "EtcdClientOptions",
    "HandlerParams",
    "RdzvConfig",
    "RdzvParams",
    "get_bool",
    "get_non_negative_seconds",
    "get_positive_int",
    "get_seconds_or",
    "parse_client_options",
    "parse_dynamic_settings",
    "parse_rdzv_config",
    "parse_v3_settings",
    "translate_legacy_params",
]

LEGACY_ALIASES: Mapping[str, str] = {
    "cacert": "ca_cert",
    "cert": "ssl_cert",
    "key": "ssl_cert_key",
    "etcd_prefix": "key_prefix",
    "timeout": "join_timeout",
}
"""Legacy ``etcd`` conf key -> the key it means here. The new name wins when both are given."""


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


@dataclass(frozen=True)
class EtcdClientOptions:
    """Everything needed to build an :class:`etcd_store.client.EtcdClient`."""

    endpoints: str
    read_timeout: float = DEFAULT_READ_TIMEOUT
    protocol: str | None = None
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    allow_insecure_auth: bool = False

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``EtcdClient`` (endpoints excluded)."""
        return {
            "timeout": self.read_timeout,
            "protocol": self.protocol,
            "ca_cert": self.ca_cert,
            "cert": self.cert,
            "key": self.key,
            "user": self.user,
            "password": self.password,
            "allow_insecure_auth": self.allow_insecure_auth,
        }

    def create_client(self, **extra: Any) -> EtcdClient:
        """A new client (no RPC yet). ``extra`` overrides keyword arguments (e.g. interceptors)."""
        from etcd_store.client import EtcdClient

        return EtcdClient(self.endpoints, **{**self.client_kwargs(), **extra})


#: Under an etcd-v2 run's state key, the directory of its backends' lease anchors
#: (``<state key>/lease/<lease hex>``: :class:`etcd_rdzv.dynamic.backend.EtcdRendezvousBackend`).
V2_ANCHOR_DIR = "lease"
#: Under an etcd-v2 run's state key, the directory of its nodes' presence keys
#: (``<state key>/alive/<node>``: :mod:`etcd_rdzv.dynamic.presence`).
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
    """The settings of an ``etcd-v2``/``etcd`` rendezvous (seconds unless said otherwise).

    torch's ``DynamicRendezvousHandler`` keys and defaults: ``join_timeout`` (600:
    how long a round may take to complete), ``last_call_timeout`` (30: extra wait
    once ``min_nodes`` joined), ``close_timeout`` (30: deadline of ``set_closed``
    / ``shutdown``), ``heartbeat_timeout`` (5: deadline of one heartbeat write),
    ``keep_alive_interval`` (5: seconds between heartbeats) and
    ``keep_alive_max_attempt`` (3: missed heartbeats after which a node is dropped),
    ``cas_backoff_max_seconds`` (0: no delay; torch 2.15 and later sleep a random 0 to that many
    seconds after a lost compare-and-swap of the state; an older torch has no such setting and
    ignores a non-zero value with a warning, :func:`etcd_rdzv.dynamic.handler.create_handler`).
    Ours: ``presence_ttl`` (3: whole seconds a node's presence key outlives its last renewal, so a
    hung member of a running round is dropped that long after it stopped, :mod:`etcd_rdzv.dynamic.presence`;
    0: off, members judged by their heartbeats only; else at least 2) and ``fast_recovery`` (False:
    torch's last call; True: a forming round completes once ``min_nodes`` and every node with a
    heartbeat in the state and a live presence key joined, a deviation from torch).
    ``config`` holds the client options, ``key_prefix`` and ``state_ttl``.
    """

    backend: str
    run_id: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None
    config: RdzvConfig
    join_timeout: float = DEFAULT_JOIN_TIMEOUT
    last_call_timeout: float = DEFAULT_LAST_CALL_TIMEOUT
    close_timeout: float = DEFAULT_CLOSE_TIMEOUT
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    keep_alive_interval: float = DEFAULT_KEEP_ALIVE_INTERVAL
    keep_alive_max_attempt: int = DEFAULT_KEEP_ALIVE_MAX_ATTEMPT
    cas_backoff_max_seconds: float = 0.0
    presence_ttl: int = DEFAULT_PRESENCE_TTL
    fast_recovery: bool = False


# --------------------------------------------------------------------------- value parsing


def _text(params: RdzvParams, key: str) -> str | None:
    value = params.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(
            f"The rendezvous configuration option {key!r} must be a string, got {value!r}."
        )
    value = value.strip()
    return value or None


def _seconds(params: RdzvParams, key: str, default: float, *, zero: bool, wanted: str) -> float:
    """The finite number of seconds ``key`` holds, positive (or 0 too with ``zero``); ``default``
    when absent or blank. Raises ``ValueError`` naming the key and ``wanted``."""
    value = params.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        return default
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero):
        raise ValueError(f"The rendezvous configuration option {key!r} must be {wanted}, got {value!r}.")
    return seconds


def get_seconds_or(params: RdzvParams, key: str, default: float) -> float:
    """The positive number of seconds ``key`` holds (``default`` when absent or blank).

    Raises ``ValueError`` naming the key (also for booleans, NaN and infinities).
    """
    return _seconds(params, key, default, zero=False, wanted="a positive number of seconds")


def get_non_negative_seconds(params: RdzvParams, key: str, default: float) -> float:
    """The finite number of seconds of 0 or more ``key`` holds (``default`` when absent or blank).

    Raises ``ValueError`` naming the key (also for booleans, NaN, infinities and negatives).
    """
    return _seconds(params, key, default, zero=True, wanted="a finite number of seconds of 0 or more")


def get_positive_int(params: RdzvParams, key: str, default: int, *, unit: str = "") -> int:
    """The conf value ``key`` as a positive integer (``default`` when absent or blank).

    Raises ``ValueError`` naming the key; ``unit`` (e.g. ``"seconds"``) is shown in it.
    """
    value = params.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        return default
    try:
        number = int(str(value).strip()) if not isinstance(value, bool) else 0
    except ValueError:
        number = 0
    if number <= 0:
        raise ValueError(
            f"The rendezvous configuration option {key!r} must be a positive integer"
            f"{f' ({unit})' if unit else ''}, got {value!r}."
        )
    return number


def get_count(params: RdzvParams, key: str, default: int) -> int:
    """The conf value ``key`` as an integer of 0 or more (``default`` when absent or blank).

    Raises ``ValueError`` naming the key.
    """
    value = params.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        return default
    try:
        number = int(str(value).strip()) if not isinstance(value, bool) else -1
    except ValueError:
        number = -1
    if number < 0:
        raise ValueError(
            f"The rendezvous configuration option {key!r} must be an integer of 0 or more, got {value!r}."
        )
    return number


def get_bool(params: HandlerParams, key: str, default: bool) -> bool:
    """The conf value ``key`` as a boolean (torch's spellings: ``1/true/yes/...``).

    Raises torch's ``ValueError`` naming the key.
    """
    return bool(params.get_as_bool(key, default))


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

    A run id names a subtree of keys (``<key_prefix>/<run_id>/...``): it must be a non-empty string
    without ``/`` (which would nest one run's keys inside another's) or NUL.
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
    """Read the endpoint(s), ``read_timeout``, TLS and auth keys. See the module docstring.

    ``user``/``password`` fall back to ``$ETCD_RDZV_USER``/``$ETCD_RDZV_PASSWORD`` so
    secrets can stay off command lines; an empty endpoint, the TLS files and the
    credentials then fall back to etcdctl's ``ETCDCTL_*`` variables, and the endpoint to
    ``localhost:2379`` (the one resolver, :func:`etcd_rdzv.conf_env.resolve_connection`).
    Raises ``ValueError`` naming the bad key or variable.
    """
    given = Given(
        endpoints=_endpoint(params), ca_cert=_readable_file(params, "ca_cert"),
        cert=_readable_file(params, "ssl_cert"), key=_readable_file(params, "ssl_cert_key"),
        user=_text(params, "user"), password=_password(params),
        user_option="the option 'user'", password_option="the option 'password_file' (a file holding it) or 'password'",
    )  # fmt: skip
    conn = resolve_connection(given, os.environ)
    options = EtcdClientOptions(
        endpoints=conn.endpoints, read_timeout=get_seconds_or(params, "read_timeout", DEFAULT_READ_TIMEOUT),
        protocol=_protocol(params), ca_cert=conn.ca_cert, cert=conn.cert, key=_client_key(conn.cert, conn.key),
        user=conn.user, password=conn.password, allow_insecure_auth=_flag(params, "allow_insecure_auth"),
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


def _flag(params: RdzvParams, key: str) -> bool:
    """The conf value ``key`` as a boolean (``1/true/yes/y/on``, ``0/false/no/n/off``; default false)."""
    value = params.get(key)
    if value is None or isinstance(value, bool):
        return bool(value)
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "y", "on"):
        return True
    if text in ("", "0", "false", "no", "n", "off"):
        return False
    raise ValueError(f"The rendezvous configuration option {key!r} must be a boolean, got {value!r}.")


def _check_transport(options: EtcdClientOptions) -> None:
    """The client's own checks of endpoints against TLS and credentials, at parse time.

    Mixed schemes, a scheme contradicting ``protocol``/the TLS files, or a password bound for
    plain text without ``allow_insecure_auth``: ``ValueError`` naming the option to change.
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
    state_ttl = get_positive_int(params, "state_ttl", DEFAULT_STATE_TTL, unit="seconds")
    if state_ttl > MAX_STATE_TTL:
        raise ValueError(
            f"The rendezvous configuration option 'state_ttl' must be at most {MAX_STATE_TTL} "
            f"seconds (etcd's longest lease is 1.5 times that), got {state_ttl}."
        )
    return RdzvConfig(client=client, key_prefix=key_prefix, state_ttl=state_ttl)


def parse_dynamic_settings(params: HandlerParams, *, legacy: bool = False) -> DynamicSettings:
    """The settings of an ``etcd-v2`` (or, with ``legacy``, ``etcd``) rendezvous.

    ``legacy`` reads torch's legacy ``etcd`` keys too (:func:`translate_legacy_params`).
    Raises ``ValueError`` naming the bad key; warns once about keys it would ignore
    (:func:`etcd_rdzv.conf_keys.warn_unknown_keys`).
    """
    warn_unknown_keys(params.backend, "etcd" if legacy else "etcd-v2", params.config)
    if legacy:
        params = translate_legacy_params(params)
    presence_ttl = _presence_ttl(params)
    fast = get_bool(params, "fast_recovery", False)
    if fast and not presence_ttl:
        raise ValueError("The rendezvous configuration option 'fast_recovery' needs presence (it waits for "
                         "every node whose presence key is alive): it cannot be used with presence_ttl=0.")
    return DynamicSettings(
        backend=params.backend,
        run_id=check_run_id(params.run_id),
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        config=parse_rdzv_config(params),
        join_timeout=get_seconds_or(params, "join_timeout", DEFAULT_JOIN_TIMEOUT),
        last_call_timeout=get_seconds_or(params, "last_call_timeout", DEFAULT_LAST_CALL_TIMEOUT),
        close_timeout=get_seconds_or(params, "close_timeout", DEFAULT_CLOSE_TIMEOUT),
        heartbeat_timeout=get_seconds_or(params, "heartbeat_timeout", DEFAULT_HEARTBEAT_TIMEOUT),
        keep_alive_interval=get_seconds_or(params, "keep_alive_interval", DEFAULT_KEEP_ALIVE_INTERVAL),
        keep_alive_max_attempt=get_positive_int(
            params, "keep_alive_max_attempt", DEFAULT_KEEP_ALIVE_MAX_ATTEMPT
        ),
        cas_backoff_max_seconds=get_non_negative_seconds(params, "cas_backoff_max_seconds", 0.0),
        presence_ttl=presence_ttl,
        fast_recovery=fast,
    )


def _presence_ttl(params: HandlerParams) -> int:
    """``presence_ttl``: 0 (off) or whole seconds of at least 2 (etcd's shortest lease is ~1.5 s)."""
    ttl = get_count(params, "presence_ttl", DEFAULT_PRESENCE_TTL)
    if ttl == 1:
        raise ValueError("The rendezvous configuration option 'presence_ttl' must be 0 (off) or at least 2 "
                         "seconds (etcd's shortest lease is about 1.5 s), got 1.")
    return ttl


def parse_v3_settings(params: HandlerParams) -> tuple[V3Settings, EtcdClientOptions]:
    """The settings and the client options of an ``etcd-v3`` rendezvous.

    Raises ``ValueError`` naming the rdzv-conf key whose value is invalid; warns once
    about keys it would ignore (:mod:`etcd_rdzv.conf_keys`). The lease TTL is ``heartbeat`` (rounded up to whole seconds) when given, else
    ``keep_alive_interval * keep_alive_max_attempt`` (whole seconds each).
    """
    warn_unknown_keys(params.backend, "etcd-v3", params.config)
    config = parse_rdzv_config(params)
    if "heartbeat" in params.config and params.get("heartbeat") is not None:
        lease_ttl = math.ceil(get_seconds_or(params, "heartbeat", DEFAULT_LEASE_TTL))
    else:
        interval = get_positive_int(params, "keep_alive_interval", DEFAULT_KEEP_ALIVE_INTERVAL)
        attempts = get_positive_int(params, "keep_alive_max_attempt", DEFAULT_KEEP_ALIVE_MAX_ATTEMPT)
        lease_ttl = interval * attempts
    settings = V3Settings(
        run_id=check_run_id(params.run_id),
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        join_timeout=get_seconds_or(params, "join_timeout", DEFAULT_JOIN_TIMEOUT),
        last_call_timeout=get_seconds_or(params, "last_call_timeout", DEFAULT_LAST_CALL_TIMEOUT),
        close_timeout=get_seconds_or(params, "close_timeout", DEFAULT_CLOSE_TIMEOUT),
        lease_ttl=lease_ttl,
        state_ttl=config.state_ttl,
        key_prefix=config.key_prefix,
        fast_recovery=get_bool(params, "fast_recovery", True),
        max_request_bytes=get_positive_int(params, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES,
                                           unit="bytes"),
        renew_interval=get_seconds_or(params, "renew_interval", DEFAULT_RENEW_INTERVAL),
        evict_misses=get_count(params, "evict_misses", DEFAULT_EVICT_MISSES),
    )
    return settings, config.client


def translate_legacy_params(params: Any) -> Any:
    """A copy of ``params`` with the legacy ``etcd`` keys renamed (:data:`LEGACY_ALIASES`).

    The new name wins when both are given (torchrun always adds ``timeout``), and
    ``key_prefix`` defaults to the legacy ``/torchelastic/p2p``.
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
