"""A local etcd v3 server process for tests, demos and single-node jobs.

:class:`EtcdServer` is a drop-in for
``torch.distributed.elastic.rendezvous.etcd_server.EtcdServer`` (same
``start``/``stop``/``get_host``/``get_port``/``get_endpoint``/``get_client``
methods) with these differences:

* it talks the etcd **v3** API; the v2 API is off unless ``enable_v2=True``
  (etcd 3.4 and 3.5 only: asking for it with etcd 3.6 or later, which removed
  the v2 API, raises ``ValueError`` at construction, before anything runs);
* readiness is polled against a deadline with ``GET /health`` (see
  :mod:`etcd_server.member` for why); a process that exits during start-up
  is noticed at once and reported with its exit code and the tail of its
  log (:class:`~etcd_server.errors.EtcdStartError`);
* it listens on ``127.0.0.1`` only, on free ports; when a port is taken
  between probing and binding the start is retried on new ports;
* ``start()`` may be called again after ``stop()`` (and :meth:`EtcdServer.restart`
  exists): the client and peer ports stay the same, so connected clients can
  reconnect;
* no etcd outlives the Python process that started it: ``stop()`` sends SIGTERM
  then SIGKILL, an ``atexit`` hook stops whatever is still running, and on
  Linux the child is started with ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` so the
  kernel kills it even when Python itself is SIGKILLed;
* optional TLS serving (:class:`~etcd_server.config.TLSConfig`; the peer port
  then serves TLS and requires a peer certificate) and auth
  (:class:`~etcd_server.config.AuthConfig`, set up through the JSON gateway;
  passwords travel in request bodies only). Auth is set up before the client
  port exists: the first start listens for clients only on a unix socket in a
  private (0700) directory, sets up users, roles and ``auth enable`` over it,
  checks that the keyspace revision did not move, stops, and starts again on
  the real client URL with the same data dir (auth state lives there). That
  costs one more start and stop of etcd (measured in docs/server.md).

The process handling (spawner thread, ``atexit`` hook, death signal) is in
:mod:`etcd_server.process`.

This module imports only the standard library (no torch, grpc or etcd_store).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, TextIO

from . import process
from .binary import check_v2_support, etcd_version, find_etcd_binary
from .client import make_client
from .config import HOST, AuthConfig, TLSConfig
from .errors import EtcdStartError
from .gateway import setup_auth
from .member import EtcdMember

__all__ = ["EtcdServer"]

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------
# EtcdServer
# --------------------------------------------------------------------------


class EtcdServer:
    """A single-member etcd v3 server on ``127.0.0.1`` (drop-in for torch's).

    Args:
        data_dir: etcd data directory. When None a temporary directory is
            created at ``start()`` and removed by ``stop()``; a directory given
            by the caller is kept.
        binary: etcd binary; see :func:`etcd_server.binary.find_etcd_binary`
            for the search order when None.
        enable_v2: also serve the v2 API (``--enable-v2=true``); only for
            side-by-side benchmarks with torch's built-in ``etcd`` backend.
            etcd 3.4 and 3.5 only (3.6 removed the v2 API).
        extra_args: extra etcd command-line flags, appended last.
        tls: serve https with these certificates (see :class:`TLSConfig`).
        auth: enable authentication before the client port first opens
            (:class:`AuthConfig`; see the module docstring).
        port, peer_port: fixed client/peer ports; free ports when None.
        die_with_parent: (Linux) have the kernel SIGKILL etcd when this
            Python process dies, even by SIGKILL (see the module docstring).
        stop_grace: seconds ``stop()`` waits after SIGTERM before SIGKILL.
        name: the etcd member name.
        heartbeat_ms, election_timeout_ms: raft timing flags. The defaults
            (20 / 100 ms instead of etcd's 100 / 1000) are safe for a single
            member, which always wins its own election, and make start and
            restart take ~0.2 s instead of ~1 s. None keeps etcd's default;
            the same flags in ``extra_args`` win.

    Raises:
        EtcdBinaryNotFoundError: (at construction) no etcd binary was found.
        ValueError: (at construction) ``enable_v2=True`` with etcd 3.6 or
            later, which has no v2 API; the message names the version.
    """

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
        self.binary = find_etcd_binary(binary)
        if enable_v2:
            check_v2_support(self.binary)
        self.enable_v2 = enable_v2
        self.extra_args = tuple(extra_args)
        self.tls = tls
        self.auth = auth
        self.die_with_parent = die_with_parent
        self.stop_grace = stop_grace
        self.name = name
        self.heartbeat_ms = heartbeat_ms
        self.election_timeout_ms = election_timeout_ms
        self._given_data_dir = os.path.abspath(data_dir) if data_dir else None
        self._given_port = port
        self._given_peer_port = peer_port
        self._ports: tuple[int, int] | None = None
        self._work_dir: str | None = None
        self._member: EtcdMember | None = None
        self._auth_done = False
        self._lock = threading.RLock()

    # -- torch-compatible accessors ----------------------------------------

    @property
    def version(self) -> str:
        """etcd version, e.g. ``"3.5.1"`` (from ``etcd --version``, cached)."""
        return etcd_version(self.binary)

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
        return self._member.pid if self._member else None

    @property
    def log_path(self) -> str | None:
        """File etcd logs to (removed by ``stop()``), None if redirected."""
        return self._member.log_path if self._member else None

    def is_running(self) -> bool:
        """True while the etcd process is alive."""
        return self._member is not None and self._member.running()

    def get_host(self) -> str:
        """Host the server listens on: always ``"127.0.0.1"``."""
        return HOST

    def get_port(self) -> int:
        """Client port; -1 before the first ``start()`` (as in torch)."""
        if self._ports:
            return self._ports[0]
        return self._given_port if self._given_port else -1

    def get_peer_port(self) -> int:
        """Peer port; -1 before the first ``start()``."""
        if self._ports:
            return self._ports[1]
        return self._given_peer_port if self._given_peer_port else -1

    def get_endpoint(self) -> str:
        """``"127.0.0.1:PORT"`` (no scheme, also with TLS)."""
        return f"{HOST}:{self.get_port()}"

    def get_client_url(self) -> str:
        """``"http://127.0.0.1:PORT"`` or ``"https://..."`` with TLS."""
        return f"{'https' if self.tls else 'http'}://{HOST}:{self.get_port()}"

    # -- lifecycle ---------------------------------------------------------

    def start(
        self,
        timeout: float = 60,
        num_retries: int = 3,
        stderr: int | TextIO | None = None,
    ) -> None:
        """Start etcd and block until it serves v3 requests.

        On the first start, ports not fixed by the caller are chosen free; if
        etcd then reports "address already in use" the start is retried (up to
        ``num_retries`` attempts in all) on new ports. Later starts (after
        ``stop()``) reuse the same ports. When ``auth`` is set, the first start
        sets it up over a private unix socket before the client port opens
        (one more start and stop of etcd).

        Args:
            timeout: seconds to wait for readiness, per attempt (and, for the
                private auth set-up start, once more for that start).
            num_retries: attempts in all when a port collision happens.
            stderr: where etcd's stdout/stderr go; default a log file (whose
                tail goes into errors). When given, any exit during the first
                start counts as a possible port collision and is retried.

        A later start that finds one of its (kept) ports taken fails with
        :class:`EtcdStartError` instead of moving to another port.

        Raises:
            RuntimeError: already running.
            EtcdStartError: etcd exited during start-up (``returncode``,
                ``log_tail``).
            EtcdStartTimeoutError: not ready within ``timeout`` (also a
                ``TimeoutError``); the process is killed.
            EtcdGatewayError: the auth setup was refused.
        """
        with self._lock:
            if self.is_running():
                raise RuntimeError("etcd server already running; call stop() first")
            if self._work_dir is None:
                self._work_dir = process.make_temp_dir("etcd-server-")
            data_dir = self.data_dir
            assert data_dir is not None
            member = self._launch(data_dir, timeout, max(1, num_retries), stderr)
            self._member = member
            logger.info(
                "etcd %s ready at %s (pid %d, data dir %s)",
                self.version, member.client_url, member.proc.pid if member.proc else -1, data_dir,
            )  # fmt: skip
            if self.auth is not None:
                self._auth_done = True

    def _launch(self, data_dir: str, timeout: float, attempts: int, stderr: int | TextIO | None) -> EtcdMember:
        """Launch a member and wait until it is ready, on new ports after a port collision
        (``attempts`` in all, see :meth:`start`); the ready member, or the start's error."""
        for attempt in range(1, attempts + 1):
            had_data = os.path.isdir(os.path.join(data_dir, "member"))
            repick = self._ports is None
            if repick:
                self._ports = self._pick_ports()
            member = self._new_member(data_dir)
            try:
                if self.auth is not None and not self._auth_done:
                    self._set_up_auth_privately(member, timeout, stderr)
                member.launch(stderr)
                member.wait_ready(time.monotonic() + timeout)
            except EtcdStartError as e:
                member.terminate(grace=2.0)
                collision = e.address_in_use or (stderr is not None and e.returncode is not None)
                if repick and collision and attempt < attempts:
                    logger.warning(
                        "etcd could not bind its ports %s (attempt %d/%d); retrying on new ports",
                        self._ports, attempt, attempts,
                    )  # fmt: skip
                    self._ports = None
                    if not had_data:
                        shutil.rmtree(os.path.join(data_dir, "member"), ignore_errors=True)
                    continue
                self._fail_cleanup(repick)
                raise
            except BaseException:
                member.terminate(grace=2.0)
                self._fail_cleanup(repick)
                raise
            return member
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _set_up_auth_privately(self, member: EtcdMember, timeout: float, stderr: int | TextIO | None) -> None:
        """Start ``member`` listening for clients only on a private unix socket, set up auth
        through it (:func:`~etcd_server.gateway.setup_auth`, which also checks that the
        keyspace revision did not move), and stop it: the real client port opens later, on
        a data dir whose auth is on. The peer port is the real one throughout (TLS when
        configured). Blocks for one start and one stop of etcd.

        Raises what :meth:`EtcdMember.wait_ready` and ``setup_auth`` raise; etcd is stopped.
        """
        assert self.auth is not None
        private = process.make_private_dir(self._work_dir)
        member.private_dir = private
        try:
            member.launch(stderr)
            member.wait_ready(time.monotonic() + timeout)
            setup_auth(member.gateway, self.auth)
        finally:
            member.terminate(grace=self.stop_grace)
            member.private_dir = None
            process.remove_temp_dir(private)

    def _pick_ports(self) -> tuple[int, int]:
        need = [p is None for p in (self._given_port, self._given_peer_port)]
        free = iter(process.free_ports(sum(need)))
        client = self._given_port if self._given_port is not None else next(free)
        peer = self._given_peer_port if self._given_peer_port is not None else next(free)
        return client, peer

    def _new_member(self, data_dir: str) -> EtcdMember:
        assert self._ports is not None and self._work_dir is not None
        member = EtcdMember(
            binary=self.binary,
            name=self.name,
            data_dir=data_dir,
            work_dir=self._work_dir,
            client_port=self._ports[0],
            peer_port=self._ports[1],
            tls=self.tls,
            enable_v2=self.enable_v2,
            extra_args=self.extra_args,
            die_with_parent=self.die_with_parent,
            heartbeat_ms=self.heartbeat_ms,
            election_timeout_ms=self.election_timeout_ms,
        )
        if self._member is not None:  # keep the cluster token across restarts
            member.cluster_token = self._member.cluster_token
        return member

    def _fail_cleanup(self, first_start: bool) -> None:
        """After a failed first start, forget the ports and drop the temp dir."""
        if first_start:
            self._ports = None
        if self._member is None and self._work_dir:
            process.remove_temp_dir(self._work_dir)
            self._work_dir = None

    def stop(self, *, keep_data: bool = False, graceful: bool = True) -> None:
        """Stop etcd and block until it has exited.

        Sends SIGTERM and, after ``stop_grace`` seconds, SIGKILL
        (``graceful=False``: SIGKILL at once). Then removes the temporary
        data dir and log unless ``keep_data`` (a caller-given ``data_dir`` is
        never removed). Idempotent; a later ``start()`` reuses the ports (and
        the data when kept or caller-given).
        """
        with self._lock:
            member = self._member
            if member is not None:
                member.terminate(grace=self.stop_grace, graceful=graceful)
            if not keep_data and self._work_dir:
                logger.info("removing etcd work dir %s", self._work_dir)
                process.remove_temp_dir(self._work_dir)
                self._work_dir = None
                self._member = None
                if not self._given_data_dir:
                    self._auth_done = False

    def restart(self, timeout: float = 60, *, graceful: bool = True) -> None:
        """Stop etcd keeping its data, and start it again on the same ports.

        Blocks until the new process is ready (see :meth:`start`).
        """
        self.stop(keep_data=True, graceful=graceful)
        self.start(timeout=timeout, num_retries=1)

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.is_running() else "stopped"
        return f"EtcdServer({self.get_client_url()}, {state}, binary={self.binary!r})"

    # -- clients -----------------------------------------------------------

    def get_client(self, **overrides: Any) -> Any:
        """Return an ``etcd_store.client.EtcdClient`` connected to this server.

        TLS files and (with auth) the root credentials are filled in;
        ``overrides`` (e.g. ``user=..., password=..., timeout=...``) replace
        them. Imports ``etcd_store`` (and grpc) on the first call, in
        :func:`etcd_server.client.make_client`, the one place etcd_server
        depends on etcd_store.
        """
        return make_client([self.get_client_url()], self.tls, self.auth, overrides)

    def gateway_call(
        self, path: str, body: dict[str, Any] | None = None, *, timeout: float = 5.0,
        token: str | None = None,
    ) -> dict[str, Any]:
        """POST to this server's JSON gateway (``/v3/...``); see ``Gateway.call``."""
        if self._member is None:
            raise RuntimeError("etcd server not started")
        return self._member.gateway.call(path, body, timeout=timeout, token=token)
