"""Exceptions raised by the etcd client layer.

Every error names the endpoints it concerns, so a user reading a log line knows
which etcd was unreachable, refused a certificate or rejected a password.
"""

from __future__ import annotations


class EtcdError(Exception):
    """Base class of every error raised by :mod:`etcd_store.client`."""


class EtcdConnectionError(EtcdError, ConnectionError):
    """No endpoint answered within the deadline (etcd down, wrong address, no quorum)."""


class EtcdTimeoutError(EtcdConnectionError, TimeoutError):
    """An operation did not complete before its deadline."""


class EtcdTLSError(EtcdConnectionError):
    """The TLS handshake failed (unknown CA, bad client certificate, plain text vs TLS)."""


class EtcdAuthError(EtcdError, PermissionError):
    """Authentication failed (wrong user or password) or auth is required."""


class EtcdPermissionDenied(EtcdAuthError):
    """The authenticated user lacks permission for the key or operation."""


class EtcdCompactedError(EtcdError):
    """A watch asked for a revision that etcd has already compacted."""


class EtcdLeaseNotFound(EtcdError):
    """etcd does not know the lease a request names (expired or revoked): raised for a write
    attached to it, and by a :class:`~etcd_store.client.Session` whose lease is gone."""


class EtcdRequestError(EtcdError, ValueError):
    """etcd rejected the request itself (too large, invalid argument, ...)."""


class EtcdLeaseExists(EtcdRequestError):
    """etcd already holds a lease with the id a grant asked for."""
