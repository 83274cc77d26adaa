"""A local etcd v3 server process for tests, demos and single-node jobs.

:class:`EtcdServer` is a drop-in for
``torch.distributed.elastic.rendezvous.etcd_server.EtcdServer`` (same
``start``/``stop``/``get_host``/``get_port``/``get_endpoint``/``get_client``) and the
one-member face of :mod:`etcd_server.cluster`'s lifecycle. Unlike torch's:

* it talks the etcd **v3** API; v2 is off unless ``enable_v2=True`` (etcd 3.4 and 3.5
  only: with 3.6+, which removed v2, that raises ``ValueError`` at construction);
* readiness is polled against a deadline with ``GET /health`` (why:
  :mod:`etcd_server.member`); a process that exits during start-up is reported at once
  with its exit code and log tail (:class:`~etcd_server.member.EtcdStartError`);
* it listens on ``127.0.0.1`` only, on free ports; a port taken between probing and
  binding is retried on new ports;
* ``start()`` may follow ``stop()`` (and :meth:`EtcdServer.restart` exists) on the same
  client and peer ports, so connected clients can reconnect;
* no etcd outlives the Python process that started it: ``stop()``, an ``atexit`` hook, and on
  Linux ``PR_SET_PDEATHSIG`` even when Python is SIGKILLed (:mod:`etcd_server.process`);
* optional TLS (:class:`~etcd_server.member.TLSConfig`; the peer port then serves TLS and
  requires a peer certificate) and auth (:class:`~etcd_server.gateway.AuthConfig`), set up
  before the client port exists (one more start and stop, measured in docs/server.md).

This module imports only the standard library (no torch, grpc or etcd_store).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from .cluster import _LocalEtcd, make_client
from .gateway import AuthConfig
from .member import TLSConfig
from .process import HOST

__all__ = ["EtcdServer"]

logger = logging.getLogger(__name__)


class EtcdServer(_LocalEtcd):
    """A single-member etcd v3 server on ``127.0.0.1`` (drop-in for torch's).

    Args:
        data_dir: etcd data directory, kept; None: a temporary one, created at ``start()``
            and removed by ``stop()``.
        binary: etcd binary; None: see :func:`etcd_server.binary.find_etcd_binary`.
        enable_v2: also serve the v2 API (``--enable-v2=true``), for side-by-side
            benchmarks with torch's ``etcd`` backend; etcd 3.4 and 3.5 only.
        extra_args: extra etcd flags, appended last.
        tls: serve https with these certificates (:class:`TLSConfig`).
        auth: enable authentication before the client port first opens (:class:`AuthConfig`).
        port, peer_port: fixed client/peer ports; free ports when None.
        die_with_parent: (Linux) the kernel SIGKILLs etcd when this Python process dies,
            even by SIGKILL.
        stop_grace: seconds ``stop()`` waits after SIGTERM before SIGKILL.
        name: the etcd member name.
        heartbeat_ms, election_timeout_ms: raft timing. The defaults (20 / 100 ms, not
            etcd's 100 / 1000) are safe for a single member, which always wins its own
            election, and make a start ~0.2 s instead of ~1 s. None keeps etcd's; the same
            flags in ``extra_args`` win.

    ``start``, ``stop`` and ``with`` are the shared lifecycle's (:mod:`etcd_server.cluster`).

    Raises:
        EtcdBinaryNotFoundError: (at construction) no etcd binary was found.
        ValueError: (at construction) ``enable_v2=True`` with etcd 3.6+ (no v2 API); the
            message names the version.
    """

    _KIND = "server"
    _READY_LOG = "etcd %(version)s ready at %(url)s (pid %(pid)d, data dir %(data_dir)s)"
    _RETRY_LOG = "etcd could not bind its ports %(ports)s (attempt %(attempt)d/%(attempts)d); retrying on new ports"
    _logger = logger

    def __init__(
        self,
        data_dir: str | None = None,
        *,
        binary: str | None = None,
        enable_v2: bool = False,
        extra_args: Sequence[str] = (),
        tls: TLSConfig | None = None,
        auth: AuthConfig | None = None,
        port: int | None = None,
        peer_port: int | None = None,
        die_with_parent: bool = True,
        stop_grace: float = 10.0,
        name: str = "default",
        heartbeat_ms: int | None = 20,
        election_timeout_ms: int | None = 100,
    ) -> None:
        super().__init__(
            binary=binary, data_dir=data_dir, enable_v2=enable_v2, extra_args=extra_args, tls=tls,
            auth=auth, die_with_parent=die_with_parent, stop_grace=stop_grace,
            heartbeat_ms=heartbeat_ms, election_timeout_ms=election_timeout_ms,
        )  # fmt: skip
        self.name = name
        self._given_ports = (port, peer_port)

    def _layout(self) -> list[tuple[str, str, int | None, int | None]]:
        data_dir = self.data_dir
        assert data_dir is not None
        return [(self.name, data_dir, *self._given_ports)]

    # -- torch-compatible accessors ----------------------------------------

    @property
    def data_dir(self) -> str | None:
        """The data directory in use (None before the first start of a temp one)."""
        if self._given_data_dir:
            return self._given_data_dir
        if self._work_dir:
            return os.path.join(self._work_dir, "data")
        return None

    @property
    def pid(self) -> int | None:
        """PID of the running etcd, or None."""
        return self._members[0].pid if self._members else None

    @property
    def log_path(self) -> str | None:
        """File etcd logs to (removed by ``stop()``), None if redirected."""
        return self._members[0].log_path if self._members else None

    def is_running(self) -> bool:
        """True while the etcd process is alive."""
        return any(m.running() for m in self._members)

    def get_host(self) -> str:
        """Host the server listens on: always ``"127.0.0.1"``."""
        return HOST

    def get_port(self) -> int:
        """Client port; -1 before the first ``start()`` (as in torch)."""
        return self._port(0)

    def get_peer_port(self) -> int:
        """Peer port; -1 before the first ``start()``."""
        return self._port(1)

    def _port(self, which: int) -> int:
        return (self._ports[0][which] if self._ports else self._given_ports[which]) or -1

    def get_endpoint(self) -> str:
        """``"127.0.0.1:PORT"`` (no scheme, also with TLS)."""
        return f"{HOST}:{self.get_port()}"

    def get_client_url(self) -> str:
        """``"http://127.0.0.1:PORT"`` or ``"https://..."`` with TLS."""
        return f"{'https' if self.tls else 'http'}://{HOST}:{self.get_port()}"

    def restart(self, timeout: float = 60, *, graceful: bool = True) -> None:
        """Stop etcd keeping its data and start it again on the same ports; blocks as :meth:`start`."""
        self.stop(keep_data=True, graceful=graceful)
        self.start(timeout=timeout, num_retries=1)

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.is_running() else "stopped"
        return f"EtcdServer({self.get_client_url()}, {state}, binary={self.binary!r})"

    # -- clients -----------------------------------------------------------

    def get_client(self, **overrides: Any) -> Any:
        """An ``etcd_store.client.EtcdClient`` connected to this server, TLS files and (with auth) root
        credentials filled in, ``overrides`` (e.g. ``user=..., timeout=...``) replacing them; imports
        etcd_store (and grpc) on the first call (:func:`etcd_server.cluster.make_client`).
        """
        return make_client([self.get_client_url()], self.tls, self.auth, overrides)

    def gateway_call(
        self, path: str, body: dict[str, Any] | None = None, *, timeout: float = 5.0,
        token: str | None = None,
    ) -> dict[str, Any]:
        """POST to this server's JSON gateway (``/v3/...``); see ``Gateway.call``."""
        if not self._members:
            raise RuntimeError("etcd server not started")
        return self._members[0].gateway.call(path, body, timeout=timeout, token=token)
