"""Connection options of the ``etcd-rdzv`` command, as the rendezvous takes them, and its deadline.

The options (before or after the sub-command) and their defaults: docs/cli.md. ``--timeout``
bounds the whole command's etcd work, retries included; a password over ``http`` is refused
without ``--allow-insecure-auth``. User and password come from the environment only, never
the command line, where other users could read them (the rendezvous' variables and
precedence: :mod:`etcd_rdzv.conf_env`). Nothing here contacts etcd; bad values raise
:class:`CliError`.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from etcd_store.options import EtcdClientOptions

from ..conf_env import ETCDCTL_CACERT, ETCDCTL_CERT, ETCDCTL_ENDPOINTS, ETCDCTL_KEY, Given, resolve_connection
from ..conf_keys import DEFAULT_CLI_TIMEOUT, DEFAULT_ENDPOINT, DEFAULT_KEY_PREFIX

if TYPE_CHECKING:
    from etcd_store.client import EtcdClient

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "DEFAULT_TIMEOUT",
    "CliError",
    "ConnectOptions",
    "Deadline",
    "add_connect_arguments",
    "connect_options",
]

DEFAULT_TIMEOUT = DEFAULT_CLI_TIMEOUT
ENDPOINTS_ENV = ETCDCTL_ENDPOINTS


class CliError(Exception):
    """Bad input or an etcd failure, reported as one line and exit code 2."""


class Deadline:
    """The command's time budget: :meth:`left` is the timeout of the next etcd call."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def left(self) -> float:
        remaining = self._end - time.monotonic()
        if remaining <= 0:
            raise CliError(f"etcd did not answer within --timeout={self.seconds:g} s")
        return remaining


@dataclass(frozen=True)
class ConnectOptions:
    """The command's etcd client (the one options object the rendezvous uses too) and key prefix."""

    client: EtcdClientOptions
    key_prefix: str

    @property
    def timeout(self) -> float:
        return float(self.client.timeout)

    def create_client(self) -> EtcdClient:
        """A client of :attr:`client`; an option the client refuses is a :class:`CliError`."""
        from etcd_store.client import EtcdClient

        try:
            return EtcdClient.from_options(self.client)
        except ValueError as e:
            raise CliError(str(e)) from None


def add_connect_arguments(parser: argparse.ArgumentParser) -> None:
    """The connection options; defaults are resolved by :func:`connect_options` (SUPPRESS here,
    so that the same options may stand before and after the sub-command)."""
    group = parser.add_argument_group("etcd connection")
    s = argparse.SUPPRESS
    group.add_argument("--endpoints", default=s, metavar="H:P,...",
                       help=f"etcd endpoints (default ${ENDPOINTS_ENV}, else {DEFAULT_ENDPOINT})")
    group.add_argument("--cacert", default=s, metavar="FILE",
                       help=f"CA bundle that signed etcd's certificate (default ${ETCDCTL_CACERT})")
    group.add_argument("--cert", default=s, metavar="FILE", help=f"client certificate (PEM; default ${ETCDCTL_CERT})")
    group.add_argument("--key", default=s, metavar="FILE", help=f"private key of --cert (default ${ETCDCTL_KEY})")
    group.add_argument("--key-prefix", default=s, metavar="PREFIX",
                       help=f"the rendezvous' key_prefix (default {DEFAULT_KEY_PREFIX})")
    group.add_argument("--allow-insecure-auth", default=s, action="store_true",
                       help="send the etcd password over http (plain text) anyway; refused otherwise")
    group.add_argument("--timeout", default=s, type=float, metavar="S",
                       help=f"bound of the command's etcd calls in seconds (default {DEFAULT_TIMEOUT:g})")


def connect_options(ns: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ConnectOptions:
    """Resolve the parsed options and the environment into :class:`ConnectOptions`."""
    env = os.environ if environ is None else environ
    try:
        return _resolve(ns, env)
    except ValueError as e:  # a bad ETCDCTL_* / ETCD_RDZV_* value, named in the message
        raise CliError(str(e)) from None


def _resolve(ns: argparse.Namespace, env: Mapping[str, str]) -> ConnectOptions:
    """The flags checked, then the rendezvous' fallback chain (:func:`~etcd_rdzv.conf_env.resolve_connection`)."""
    timeout = getattr(ns, "timeout", DEFAULT_TIMEOUT)
    if not timeout > 0:
        raise CliError(f"--timeout must be positive, got {timeout:g}")
    prefix = getattr(ns, "key_prefix", DEFAULT_KEY_PREFIX)
    if prefix and not prefix.startswith("/"):
        raise CliError(f"--key-prefix must start with '/', got {prefix!r}")
    cert, key = getattr(ns, "cert", None), getattr(ns, "key", None)
    if (cert is None) != (key is None):
        raise CliError("--cert and --key must be given together")
    files = {"--cacert": getattr(ns, "cacert", None), "--cert": cert, "--key": key}
    for flag, path in files.items():
        if path is not None and not os.path.isfile(path):
            raise CliError(f"{flag} {path!r}: no such file")
    given = Given(endpoints=getattr(ns, "endpoints", None) or None, ca_cert=files["--cacert"], cert=cert, key=key)
    conn = resolve_connection(given, env)  # the user and password come from the environment only
    client = EtcdClientOptions(
        conn.endpoints, timeout=float(timeout), ca_cert=conn.ca_cert, cert=conn.cert, key=conn.key, user=conn.user,
        password=conn.password, allow_insecure_auth=bool(getattr(ns, "allow_insecure_auth", False)),
    )  # fmt: skip
    return ConnectOptions(client, prefix.rstrip("/") if prefix != "/" else "")
