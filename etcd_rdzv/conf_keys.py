"""Which rdzv-conf keys each backend reads, and the one warning about the others.

torch hands a rendezvous every ``--rdzv-conf`` key unchecked (``RendezvousParameters``
keeps them in ``config``), so a misspelt key (``join_timout=60``) would silently leave
its setting at the default. :func:`warn_unknown_keys` logs one WARNING naming the keys
no backend of this package nor torch reads, with a close match when there is one, and
the keys of this package that the chosen backend does not read (``fast_recovery`` on
``etcd-v2``; the legacy ``etcd`` names such as ``cacert`` on ``etcd-v2``/``etcd-v3``, which
read ``ca_cert``). Keys that torch itself passes or that torch's own backends read
(:data:`TORCH_KEYS`: ``timeout``, which torchrun always adds, ``rank``, ``is_host``,
``store_type``, ...) are never flagged: a job switched from ``c10d`` keeps working.

Once per process per (backend, set of flagged keys): every agent creates one handler
per run, and tests create many. Nothing raises; nothing here imports torch.
"""

from __future__ import annotations

import difflib
import logging
import threading
from collections.abc import Iterable

log = logging.getLogger(__name__)

__all__ = [
    "CONNECTION_KEYS",
    "DYNAMIC_KEYS",
    "LEGACY_KEYS",
    "TORCH_KEYS",
    "V3_KEYS",
    "known_keys",
    "unknown_keys",
    "warn_unknown_keys",
]

CONNECTION_KEYS = frozenset({
    "read_timeout", "protocol", "ssl_cert", "ssl_cert_key", "ca_cert",
    "user", "password", "password_file", "allow_insecure_auth", "key_prefix", "state_ttl",
    "metrics_port", "metrics_addr",
})  # fmt: skip
"""Read by every backend (etcd_rdzv/conf.py ``parse_rdzv_config``; the metrics keys by
etcd_rdzv/prometheus.py)."""

DYNAMIC_KEYS = frozenset({
    "join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
    "keep_alive_interval", "keep_alive_max_attempt", "cas_backoff_max_seconds", "presence_ttl",
    "fast_recovery",
})  # fmt: skip
"""``etcd-v2`` and ``etcd``: torch's ``DynamicRendezvousHandler`` keys (``cas_backoff_max_seconds``
since torch 2.15) and ours, ``presence_ttl`` and ``fast_recovery``."""

V3_KEYS = frozenset({
    "join_timeout", "last_call_timeout", "close_timeout", "heartbeat", "heartbeat_timeout",
    "keep_alive_interval", "keep_alive_max_attempt", "fast_recovery", "max_request_bytes",
    "renew_interval", "evict_misses",
})  # fmt: skip
"""``etcd-v3`` (``heartbeat_timeout`` is accepted and ignored: keep-alives are streamed)."""

_LEGACY_NAMES = {"cacert": "ca_cert", "cert": "ssl_cert", "key": "ssl_cert_key", "etcd_prefix": "key_prefix",
                 "timeout": "join_timeout"}  # fmt: skip
LEGACY_KEYS = frozenset(_LEGACY_NAMES)
"""The legacy ``etcd`` backend's names (the keys of ``conf.LEGACY_ALIASES``)."""

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


def known_keys(kind: str) -> frozenset[str]:
    """The keys a backend of ``kind`` (``etcd-v2``, ``etcd`` or ``etcd-v3``) accepts without a warning."""
    return _OWN[kind] | TORCH_KEYS


def unknown_keys(kind: str, keys: Iterable[object]) -> list[str]:
    """The keys of ``keys`` that ``kind`` would ignore unexpectedly, sorted."""
    known = known_keys(kind)
    return sorted({str(k) for k in keys} - known)


def _hint(kind: str, key: str) -> str:
    if key in LEGACY_KEYS:
        return f" (the legacy 'etcd' backend's name of {_LEGACY_NAMES[key]!r}, which this backend reads)"
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
