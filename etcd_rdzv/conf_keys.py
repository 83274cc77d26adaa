"""Every ``--rdzv-conf`` key, declared once: its parser, default, backends and documentation.

:data:`KEYS` drives the configuration pass (:mod:`etcd_rdzv.conf` reads each value with
:func:`read`: the key's parser and default), the warning about keys a backend would ignore
(:func:`warn_unknown_keys`) and the key tables of docs/configuration.md (:func:`doc_table`; a
test fails when they disagree). Adding a key is one row here plus the field of its name in the
settings class that holds it.

torch hands a rendezvous every ``--rdzv-conf`` key unchecked, so a misspelt key
(``join_timout=60``) would silently leave its setting at the default: :func:`warn_unknown_keys`
logs one WARNING (once per process per backend and key set) naming, with a hint, the keys
neither this package nor torch (:data:`TORCH_KEYS`) reads.

A leaf module: no imports from this package, no torch, no etcd. Parsers raise ``ValueError``
naming the key and the value.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

__all__ = [
    "CONNECTION_KEYS", "DYNAMIC_KEYS", "KEYS", "LEGACY_ALIASES", "LEGACY_KEYS", "TORCH_KEYS", "V3_KEYS",
    "Key", "doc_table", "known_keys", "lookup", "read", "reads", "unknown_keys", "warn_unknown_keys",
]  # fmt: skip

# --------------------------------------------------------------------------- defaults beside no key

DEFAULT_ENDPOINT = "localhost:2379"
#: The bound of the ``etcd-rdzv`` command's etcd work (``--timeout``), retries included.
DEFAULT_CLI_TIMEOUT = 10.0
LEGACY_KEY_PREFIX = "/torchelastic/p2p"
MAX_STATE_TTL = 6_000_000_000  # the state's lease lasts 1.5 x state_ttl; etcd allows 9e9 s
USER_ENV = "ETCD_RDZV_USER"
PASSWORD_ENV = "ETCD_RDZV_PASSWORD"
PASSWORD_FILE_ENV = "ETCD_RDZV_PASSWORD_FILE"
METRICS_PORT_ENV = "ETCD_RDZV_METRICS_PORT"
METRICS_ADDR_ENV = "ETCD_RDZV_METRICS_ADDR"

# The rendezvous defaults are torch's ``DynamicRendezvousHandler``'s; the table's rows use them.
DEFAULT_READ_TIMEOUT = 60.0
DEFAULT_KEY_PREFIX = "/torch/elastic/rendezvous"
DEFAULT_STATE_TTL = 7200
DEFAULT_JOIN_TIMEOUT = 600.0
DEFAULT_LAST_CALL_TIMEOUT = 30.0
DEFAULT_CLOSE_TIMEOUT = 30.0
DEFAULT_HEARTBEAT_TIMEOUT = 5.0
DEFAULT_KEEP_ALIVE_INTERVAL = 5
DEFAULT_KEEP_ALIVE_MAX_ATTEMPT = 3
DEFAULT_LEASE_TTL = DEFAULT_KEEP_ALIVE_INTERVAL * DEFAULT_KEEP_ALIVE_MAX_ATTEMPT
DEFAULT_PRESENCE_TTL = 3
DEFAULT_CAS_BACKOFF_MAX_SECONDS = 0.0  # torch 2.15's default: no delay after a lost compare-and-swap
DEFAULT_MAX_REQUEST_BYTES = 1_572_864  # etcd's own --max-request-bytes (1.5 MiB)
DEFAULT_RENEW_INTERVAL = 1.0
DEFAULT_EVICT_MISSES = 2
DEFAULT_METRICS_ADDR = "127.0.0.1"  # loopback: the endpoint names runs and nodes and has no auth


# --------------------------------------------------------------------------- parsers


class Params(Protocol):
    """The part of torch's ``RendezvousParameters`` a parser reads."""

    def get(self, key: str, default: Any = None) -> Any: ...


def _blank(value: object) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _number(key: str, value: object, *, integer: bool, zero: bool, unit: str = "") -> float:
    """``value`` as a finite number (an exact ``int`` with ``integer``, however large: the caller
    bounds it), above 0 (or 0 too with ``zero``)."""
    number: float
    try:
        if isinstance(value, bool):
            raise ValueError
        number = int(str(value).strip()) if integer else float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = math.nan
    if (integer or math.isfinite(number)) and (number > 0 or (zero and number == 0)):
        return number
    if integer:
        wanted = "an integer of 0 or more" if zero else f"a positive integer{f' ({unit})' if unit else ''}"
    else:
        wanted = "a finite number of seconds of 0 or more" if zero else "a positive number of seconds"
    raise ValueError(f"The rendezvous configuration option {key!r} must be {wanted}, got {value!r}.")


def seconds(key: str, value: object) -> float:
    """A positive, finite number of seconds."""
    return _number(key, value, integer=False, zero=False)


def seconds_or_zero(key: str, value: object) -> float:
    """A finite number of seconds of 0 or more."""
    return _number(key, value, integer=False, zero=True)


def positive_int(key: str, value: object) -> int:
    return int(_number(key, value, integer=True, zero=False))


def whole_seconds(key: str, value: object) -> int:
    return int(_number(key, value, integer=True, zero=False, unit="seconds"))


def byte_count(key: str, value: object) -> int:
    return int(_number(key, value, integer=True, zero=False, unit="bytes"))


def count(key: str, value: object) -> int:
    """An integer of 0 or more."""
    return int(_number(key, value, integer=True, zero=True))


_TRUE = ("1", "true", "t", "yes", "y", "on")
_FALSE = ("0", "false", "f", "no", "n", "off")


def boolean(key: str, value: object) -> bool:
    """torch's spellings (``1/true/t/yes/y``, ``0/false/f/no/n``, any case) and ``on``/``off``."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"The rendezvous configuration option {key!r} must be a boolean, got {value!r}.")


def text(key: str, value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"The rendezvous configuration option {key!r} must be a string, got {value!r}.")
    return value.strip()


def port(key: str, value: object) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        number = 0
    if not 1 <= number <= 65535:
        raise ValueError(f"The rendezvous configuration option {key!r} must be a TCP port (1-65535), got {value!r}.")
    return number


# --------------------------------------------------------------------------- the table

ALL = frozenset({"etcd-v2", "etcd", "etcd-v3"})
DYNAMIC = frozenset({"etcd-v2", "etcd"})
V3 = frozenset({"etcd-v3"})


@dataclass(frozen=True)
class Key:
    """One rdzv-conf key as one group of backends reads it.

    ``parse(key, value)`` turns a non-blank value into the setting; ``default`` stands for a blank
    or absent one (``None``: unset, or worked out by the reader); ``env``: a variable read when the
    key is absent. For docs/configuration.md: ``section`` (its table; ``""``: the page's prose),
    ``shown`` (the default as written there), ``doc`` (the meaning), ``also`` (``(section, doc)`` of
    another table that lists the key, after its own rows, with the plain default and a meaning of its own).
    """

    name: str
    parse: Callable[[str, object], Any]
    default: Any
    backends: frozenset[str]
    section: str
    doc: str
    shown: str = ""
    env: str | None = None
    also: tuple[tuple[str, str], ...] = ()

    @property
    def shown_default(self) -> str:
        return self.shown or self.plain_default

    @property
    def plain_default(self) -> str:
        value = self.default
        if isinstance(value, bool):
            return f"`{str(value).lower()}`"
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return f"`{value}`"


_C, _D, _V = "connection", "dynamic", "v3"

KEYS: tuple[Key, ...] = (
    # connection keys, every backend (torch's etcd-v2 keys keep their meaning)
    Key("read_timeout", seconds, DEFAULT_READ_TIMEOUT, ALL, _C,
        "seconds; deadline of every etcd call, failover to the next endpoint included. An unreachable etcd "
        "raises `RendezvousConnectionError` within it."),
    Key("protocol", text, None, ALL, _C,
        "scheme for endpoints written without one (`https://host:port` in `--rdzv-endpoint` also works); "
        "`http` or `https`", shown="`http` (`https` when `ca_cert`/`ssl_cert` is given)"),
    Key("ssl_cert", text, None, ALL, _C,
        "client certificate (PEM). Alone, the file must also hold the private key (as torch's `etcd-v2` "
        "allows).", shown="none"),
    Key("ssl_cert_key", text, None, ALL, _C, "private key of `ssl_cert` (not allowed without `ssl_cert`)",
        shown="none"),
    Key("ca_cert", text, None, ALL, _C, "CA bundle that signed etcd's server certificate", shown="none"),
    Key("user", text, None, ALL, _C, "etcd user (auth enabled); the conf key wins over the variable",
        shown=f"`${USER_ENV}`"),
    Key("password_file", text, None, ALL, _C,
        "a file holding the password (one trailing newline is dropped, as in a Kubernetes Secret volume): "
        "the safe way to pass it", shown=f"`${PASSWORD_FILE_ENV}`"),
    Key("password", text, None, ALL, _C,
        "the password itself; **avoid it in `--rdzv-conf`**: torchrun prints its rdzv-conf in its own INFO "
        "log and command lines are visible in `ps` (a warning says so once). Precedence: `password`, "
        "`password_file`, `$ETCD_RDZV_PASSWORD`, `$ETCD_RDZV_PASSWORD_FILE`",
        shown=f"`${PASSWORD_ENV}`"),  # its variables: conf_env.resolve_connection's precedence
    Key("allow_insecure_auth", boolean, False, ALL, _C,
        "send the password over `http` anyway (a trusted network, or etcd on this host): without it a "
        "password with an `http` endpoint is refused when the configuration is read; with it a warning is "
        "logged ([security.md](security.md))", shown="`0`"),
    Key("key_prefix", text, DEFAULT_KEY_PREFIX, ALL, _C,
        "where keys live (layout per backend: "
        "[operations.md](operations.md#what-is-stored-in-etcd-and-when-it-expires))",
        shown=f"`{DEFAULT_KEY_PREFIX}` (`{LEGACY_KEY_PREFIX}` for `etcd`)",
        also=((_V, "as for `etcd-v2`; keys live under `<key_prefix>/<run_id>/v3/`"),)),
    Key("state_ttl", whole_seconds, DEFAULT_STATE_TTL, ALL, _C,
        "seconds the rendezvous state outlives its last write (`etcd-v2`/`etcd`) or its last live node "
        "(`etcd-v3`'s run lease)",
        also=((_V, "TTL (s) of the run lease holding the round records, counted from the last live node; at "
                   "least `heartbeat`"),)),
    Key("metrics_port", port, None, ALL, _C,
        "serve the [metrics](operations.md#events-and-metrics) for Prometheus on this port (1-65535); needs "
        "`pip install 'etcd-rdzv[prometheus]'` (a clear error says so otherwise). One endpoint per process.",
        shown=f"`${METRICS_PORT_ENV}`, else off", env=METRICS_PORT_ENV),
    Key("metrics_addr", text, DEFAULT_METRICS_ADDR, ALL, _C,
        "the address that endpoint binds (loopback by default: it has no TLS or auth; `0.0.0.0` for a "
        "Prometheus on another host)", shown=f"`${METRICS_ADDR_ENV}`, else `{DEFAULT_METRICS_ADDR}`",
        env=METRICS_ADDR_ENV),
    # etcd-v2 and etcd: torch's DynamicRendezvousHandler keys and defaults, then ours
    Key("join_timeout", seconds, DEFAULT_JOIN_TIMEOUT, DYNAMIC, _D,
        "seconds within which a rendezvous round must complete"),
    Key("last_call_timeout", seconds, DEFAULT_LAST_CALL_TIMEOUT, DYNAMIC, _D,
        "extra wait once `min` nodes joined (no wait when `min == max`, or once `max` joined)"),
    Key("close_timeout", seconds, DEFAULT_CLOSE_TIMEOUT, DYNAMIC, _D,
        "seconds within which `set_closed`/`shutdown` must succeed"),
    Key("heartbeat_timeout", seconds, DEFAULT_HEARTBEAT_TIMEOUT, DYNAMIC, _D,
        "seconds within which a keep-alive write must succeed"),
    Key("keep_alive_interval", seconds, float(DEFAULT_KEEP_ALIVE_INTERVAL), DYNAMIC, _D,
        "seconds between a node's heartbeats"),
    Key("keep_alive_max_attempt", positive_int, DEFAULT_KEEP_ALIVE_MAX_ATTEMPT, DYNAMIC, _D,
        "missed heartbeats after which a node is dropped"),
    Key("cas_backoff_max_seconds", seconds_or_zero, DEFAULT_CAS_BACKOFF_MAX_SECONDS, DYNAMIC, _D,
        "torch 2.15 and later: after a lost compare-and-swap of the state, wait a random 0 to this many "
        "seconds before retrying (spreads the retries of many nodes); finite, 0 or more; an older torch has "
        "no such setting and logs that it ignores a non-zero value"),
    Key("presence_ttl", count, DEFAULT_PRESENCE_TTL, DYNAMIC, _D,
        "ours: whole seconds a node's presence key (`<state key>/alive/<node>`, on a lease the client's "
        "keep-alive stream renews every sixth of it) outlives its last renewal; etcd's leader expires it, "
        "and a member of a running round whose key is gone is dropped ([below](#how-a-hung-member-is-found)); "
        "`0`: off (members judged by their heartbeats only); else at least 2"),
    Key("fast_recovery", boolean, False, DYNAMIC, _D,
        "ours, a deviation from torch: `true` ends the last call of a re-forming round (any but the job's "
        "first) once `min` nodes and every node it knows (a heartbeat in the state: the members of the round "
        "that ended, the wait list) whose presence key is alive have joined; a dead member is not waited "
        "for, a node that arrives later joins the next round; needs `presence_ttl` > 0"),
    # etcd-v3: torch's names for the rendezvous, then ours
    Key("join_timeout", seconds, DEFAULT_JOIN_TIMEOUT, V3, _V,
        "seconds `next_rendezvous` may take (not counted while a full group keeps the node out, as torch "
        "does)"),
    Key("last_call_timeout", seconds, DEFAULT_LAST_CALL_TIMEOUT, V3, _V,
        "extra wait once `min_nodes` joined and the previous group has left"),
    Key("fast_recovery", boolean, True, V3, _V,
        "skip the last call when the round only re-forms the previous group "
        "([design](etcd-v3-design.md#transitions-each-one-transaction))"),
    Key("close_timeout", seconds, DEFAULT_CLOSE_TIMEOUT, V3, _V, "deadline of `set_closed` / `shutdown`"),
    Key("heartbeat", seconds, None, V3, _V,
        "TTL (s, rounded up to whole seconds, at least 1) of each node's lease: a node that stops refreshing "
        "it is gone after at most that long",
        shown=f"`keep_alive_interval × keep_alive_max_attempt` = {DEFAULT_LEASE_TTL}"),
    Key("renew_interval", seconds, DEFAULT_RENEW_INTERVAL, V3, _V,
        "seconds between two keep-alives of a node's lease (at most a third of `heartbeat`); renewals are "
        "not raft writes"),
    Key("evict_misses", count, DEFAULT_EVICT_MISSES, V3, _V,
        "after a group failed, a survivor evicts a member whose lease missed this many renewals (at the "
        "member's own `renew_interval`, named in its join value) and at least its client's failover plus "
        "1 s (4 s of silence with the defaults) while the survivor's own were answered, instead of waiting "
        "out `heartbeat`; `0`: no eviction ([design](etcd-v3-design.md#eviction-a-dead-member-leaves-in-seconds))"),
    Key("max_request_bytes", byte_count, DEFAULT_MAX_REQUEST_BYTES, V3, _V,
        "etcd's `--max-request-bytes` (1.5 MiB by default). Sealing a round is one etcd request naming every "
        "member, about 64 bytes a node (a node id is its address plus about 19 bytes), so a `max_nodes` whose "
        "round could not be sealed within it is refused at start-up with an error saying how many nodes fit: "
        "about 23,000 for 30-byte host names, 30,000 for IPv4 addresses. Set it to etcd's own value when you "
        "raise etcd's limit"),
    # etcd-v3 reads torch's keep-alive keys as whole seconds for its lease TTL (without ``heartbeat``)
    Key("keep_alive_interval", positive_int, DEFAULT_KEEP_ALIVE_INTERVAL, V3, "", ""),
    Key("keep_alive_max_attempt", positive_int, DEFAULT_KEEP_ALIVE_MAX_ATTEMPT, V3, "", ""),
    Key("heartbeat_timeout", seconds, DEFAULT_HEARTBEAT_TIMEOUT, V3, "", ""),  # accepted and ignored
)  # fmt: skip

LEGACY_ALIASES: Mapping[str, str] = {
    "cacert": "ca_cert", "cert": "ssl_cert", "key": "ssl_cert_key", "etcd_prefix": "key_prefix",
    "timeout": "join_timeout",
}  # fmt: skip
"""The legacy ``etcd`` backend's names -> the keys they mean here (the new name wins when both are given)."""


def lookup(name: str, backend: str = "") -> Key:
    """The row of ``name`` as ``backend`` (``etcd-v2``, ``etcd`` or ``etcd-v3``; empty: the connection
    keys) reads it; ``KeyError`` for a key it does not read."""
    for k in KEYS:
        if k.name == name and (backend in k.backends if backend else k.section == _C):
            return k
    raise KeyError(f"{backend or 'no backend'} reads no rdzv-conf key {name!r}")


def reads(name: str, backend: str) -> bool:
    """Whether ``backend`` reads the rdzv-conf key ``name``."""
    return any(k.name == name and backend in k.backends for k in KEYS)


def read(params: Params, name: str, backend: str = "") -> Any:
    """The value of ``name`` (:func:`lookup`): its parser's result, else (absent or blank) its variable's
    when it has one, else the table's default. Raises ``ValueError`` naming the key."""
    key = lookup(name, backend)
    value = params.get(name)
    if _blank(value) and key.env is not None:
        value = os.environ.get(key.env)
    return key.default if _blank(value) else key.parse(name, value)


def _names(backends: frozenset[str]) -> frozenset[str]:
    return frozenset(k.name for k in KEYS if k.backends == backends)


CONNECTION_KEYS = _names(ALL)
DYNAMIC_KEYS = _names(DYNAMIC)
V3_KEYS = _names(V3)
LEGACY_KEYS = frozenset(LEGACY_ALIASES)

TORCH_KEYS = frozenset({
    # torchrun / torch.distributed.launcher: always ``timeout``; ``rank`` for ``static``
    "timeout", "rank",
    # torch's c10d / etcd-v2 / static backends and create_handler (dynamic_rendezvous.py)
    "is_host", "store_type", "read_timeout", "protocol", "ssl_cert", "ssl_cert_key", "ca_cert",
    "join_timeout", "last_call_timeout", "close_timeout", "heartbeat", "heartbeat_timeout",
    "keep_alive_interval", "keep_alive_max_attempt", "cas_backoff_max_seconds",  # the last since torch 2.15
    # RendezvousParameters' own argument, sometimes passed as a key by hand
    "local_addr",
})  # fmt: skip
"""Keys torch passes or its own backends read: accepted (and, if not ours, ignored) by every backend."""

_OWN = {
    "etcd-v2": CONNECTION_KEYS | DYNAMIC_KEYS,
    "etcd": CONNECTION_KEYS | DYNAMIC_KEYS | LEGACY_KEYS,
    "etcd-v3": CONNECTION_KEYS | V3_KEYS,
}


def doc_table(section: str) -> str:
    """The markdown table of docs/configuration.md for ``section`` (``connection``, ``dynamic``, ``v3``)."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{k.name}` | {k.shown_default} | {k.doc} |" for k in KEYS if k.section == section]
    rows += [f"| `{k.name}` | {k.plain_default} | {doc} |" for k in KEYS for s, doc in k.also if s == section]
    return "\n".join(rows)


# --------------------------------------------------------------------------- unknown keys


def known_keys(kind: str) -> frozenset[str]:
    """The keys a backend of ``kind`` (``etcd-v2``, ``etcd`` or ``etcd-v3``) accepts without a warning."""
    return _OWN[kind] | TORCH_KEYS


def unknown_keys(kind: str, keys: Iterable[object]) -> list[str]:
    """The keys of ``keys`` that ``kind`` would ignore unexpectedly, sorted."""
    return sorted({str(k) for k in keys} - known_keys(kind))


def _hint(kind: str, key: str) -> str:
    if key in LEGACY_KEYS:
        return f" (the legacy 'etcd' backend's name of {LEGACY_ALIASES[key]!r}, which this backend reads)"
    others = [other for other, own in _OWN.items() if other != kind and key in own and other != "etcd"]
    if others:
        return f" (read by {', '.join(others)} only)"
    close = difflib.get_close_matches(key, sorted(known_keys(kind)), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


_warned: set[tuple[str, frozenset[str]]] = set()
_warned_lock = threading.Lock()


def warn_unknown_keys(backend: str, kind: str, keys: Iterable[object]) -> list[str]:
    """Log one WARNING (once per process per ``kind`` and key set) naming the keys ``kind`` ignores.

    ``backend`` is the name shown (torchrun's ``--rdzv-backend``). Returns the flagged keys.
    """
    unknown = unknown_keys(kind, keys)
    if not unknown:
        return []
    seen = (kind, frozenset(unknown))
    with _warned_lock:
        if seen in _warned:
            return unknown
        _warned.add(seen)
    log.warning(
        "etcd-rdzv: the %s rendezvous ignores the rdzv-conf key%s %s; its keys are listed in "
        "docs/configuration.md.",
        backend, "s" if len(unknown) > 1 else "", ", ".join(f"{k!r}{_hint(kind, k)}" for k in unknown),
    )  # fmt: skip
    return unknown
