"""A local etcd v3 server process for tests, demos and single-node jobs.

:class:`EtcdServer` is a drop-in for
``torch.distributed.elastic.rendezvous.etcd_server.EtcdServer`` (same
``start``/``stop``/``get_host``/``get_port``/``get_endpoint``/``get_client``
methods) with these differences:

* it talks the etcd **v3** API; the v2 API is off unless ``enable_v2=True``
  (etcd 3.4 and 3.5 only: asking for it with etcd 3.6 or later, which removed
  the v2 API, raises ``ValueError`` at construction, before anything runs);
* readiness is polled against a deadline with ``GET /health`` (see
  *Readiness* below); a process that exits during start-up is noticed at once
  and reported with its exit code and the tail of its log
  (:class:`EtcdStartError`);
* it listens on ``127.0.0.1`` only, on free ports; when a port is taken
  between probing and binding the start is retried on new ports;
* ``start()`` may be called again after ``stop()`` (and :meth:`EtcdServer.restart`
  exists): the client and peer ports stay the same, so connected clients can
  reconnect;
* no etcd outlives the Python process that started it: ``stop()`` sends SIGTERM
  then SIGKILL, an ``atexit`` hook stops whatever is still running, and on
  Linux the child is started with ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` so the
  kernel kills it even when Python itself is SIGKILLed;
* optional TLS serving (:class:`TLSConfig`) and auth (:class:`AuthConfig`,
  set up through the JSON gateway; passwords travel in request bodies only).

Readiness
---------
etcd is ready when ``GET /health`` on its client URL answers
``{"health": "true"}``. etcd 3.4 to 3.7 all serve it, with that same body, and
answer true only when the member has a leader, no alarm, and a read through
raft succeeded (3.4: a quorum read; 3.5+: a linearizable range). It was chosen
over the alternatives because it does not depend on what changed between
versions:

* ``/readyz`` and ``/livez`` exist only from 3.6 on;
* requests through the JSON gateway (``/v3/...``) need a token once auth is on
  (3.6+ even for ``/v3/maintenance/status``), are refused outright (plain-text
  HTTP 400) for a TLS client whose certificate has a CommonName while auth is
  on, and their error bodies changed in 3.6 (``{"error", "message", "code"}``
  before, ``{"code", "message"}`` since); only the ``code`` field and the HTTP
  status are common to all versions;
* a gRPC request works everywhere but needs grpc, and this package is
  standard-library only.

``/health`` is not behind the gateway, so none of that applies. Leader
discovery (:meth:`etcd_server.EtcdCluster.leader`) likewise reads the
``etcd_server_is_leader`` gauge from ``/metrics`` (all versions, no auth). The
auth set-up still uses the gateway and tells answers apart by HTTP status and
gRPC ``code`` only (see :func:`setup_auth`).

The process handling (spawner thread, ``atexit`` hook, death signal) is in
:mod:`etcd_server.process`.

This module imports only the standard library (no torch, grpc or etcd_store).
"""

from __future__ import annotations

import contextlib
import http.client
import importlib
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from types import TracebackType
from typing import IO, Any, TextIO

from . import process
from .binary import etcd_version, find_etcd_binary, has_v2_api
from .config import HOST, AuthConfig, TLSConfig
from .errors import EtcdStartError, EtcdStartTimeoutError
from .gateway import Gateway, setup_auth

__all__ = ["EtcdServer"]

logger = logging.getLogger(__name__)

_LOG_TAIL_LINES = 20


# --------------------------------------------------------------------------
# one etcd process (shared by EtcdServer and EtcdCluster)
# --------------------------------------------------------------------------


class _EtcdMember:
    """One etcd process: command line, launch, readiness, stop, log.

    Not thread-safe; owned by an :class:`EtcdServer` or ``EtcdCluster``.
    """

    def __init__(
        self,
        *,
        binary: str,
        name: str,
        data_dir: str,
        work_dir: str,
        client_port: int,
        peer_port: int,
        tls: TLSConfig | None,
        enable_v2: bool,
        extra_args: Sequence[str],
        die_with_parent: bool,
        heartbeat_ms: int | None = None,
        election_timeout_ms: int | None = None,
    ) -> None:
        self.binary = binary
        self.name = name
        self.data_dir = data_dir
        self.work_dir = work_dir
        self.client_port = client_port
        self.peer_port = peer_port
        self.tls = tls
        self.enable_v2 = enable_v2
        self.extra_args = list(extra_args)
        self.die_with_parent = die_with_parent
        self.heartbeat_ms = heartbeat_ms
        self.election_timeout_ms = election_timeout_ms
        self.initial_cluster = ""
        self.cluster_token = "etcd-server-" + uuid.uuid4().hex[:12]
        self.proc: subprocess.Popen[bytes] | None = None
        self.cmd: list[str] = []
        self.log_path: str | None = None
        self._log_offset = 0
        self._gateway: Gateway | None = None

    # -- addresses --------------------------------------------------------

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{HOST}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{HOST}:{self.peer_port}"

    @property
    def gateway(self) -> Gateway:
        if self._gateway is None or self._gateway.base_url != self.client_url:
            ctx = self.tls.ssl_context() if self.tls else None
            self._gateway = Gateway(self.client_url, ctx)
        return self._gateway

    # -- process ----------------------------------------------------------

    def command(self) -> list[str]:
        """The etcd command line (contains no secrets)."""
        cmd = [
            self.binary,
            "--name", self.name,
            "--data-dir", self.data_dir,
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster or f"{self.name}={self.peer_url}",
            "--initial-cluster-state", "new",
            "--initial-cluster-token", self.cluster_token,
        ]  # fmt: skip
        given = {a.split("=", 1)[0] for a in self.extra_args}
        # zap is etcd 3.5+'s only logger; 3.4 defaults to capnslog and warns that it is
        # deprecated. Same JSON log lines on every version, always to stderr (our log file).
        if "--logger" not in given:
            cmd.append("--logger=zap")
        if "--log-outputs" not in given:
            cmd.append("--log-outputs=stderr")
        if self.heartbeat_ms is not None and "--heartbeat-interval" not in given:
            cmd.append(f"--heartbeat-interval={self.heartbeat_ms}")
        if self.election_timeout_ms is not None and "--election-timeout" not in given:
            cmd.append(f"--election-timeout={self.election_timeout_ms}")
        if self.enable_v2:
            cmd.append("--enable-v2=true")
        if self.tls:
            cmd += [
                "--cert-file", self.tls.cert_file,
                "--key-file", self.tls.key_file,
                "--trusted-ca-file", self.tls.ca_file,
            ]  # fmt: skip
            if self.tls.client_cert_auth:
                cmd.append("--client-cert-auth=true")
        cmd += self.extra_args
        return cmd

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.running() and self.proc else None

    def launch(self, stderr: int | IO[Any] | None = None) -> None:
        """Start the process (does not wait for readiness).

        etcd's stdout and stderr go to ``<work_dir>/<name>.log`` (appended)
        unless ``stderr`` is given, in which case both go there.
        """
        if self.running():
            raise RuntimeError(f"etcd member {self.name} is already running")
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        self.cmd = self.command()
        preexec = process.make_preexec(self.die_with_parent)
        logger.info("starting etcd: %s", " ".join(self.cmd))
        with contextlib.ExitStack() as stack:
            out: int | IO[Any]
            if stderr is None:
                self.log_path = os.path.join(self.work_dir, f"{self.name}.log")
                log = stack.enter_context(open(self.log_path, "ab"))
                self._log_offset = log.tell()
                out = log
            else:
                self.log_path = None
                out = stderr
            cmd = self.cmd

            def popen() -> subprocess.Popen[bytes]:
                # preexec_fn only makes the prctl system call (see make_preexec).
                return subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    close_fds=True,
                    start_new_session=True,
                    preexec_fn=preexec,
                )

            self.proc = process.in_spawner_thread(popen) if preexec is not None else popen()
        process.register_live(self)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines etcd logged since the latest launch.

        When lines were cut, the first line is kept too, above a ``...``: a
        flag error is etcd's first line, followed by a usage text that is
        longer than the tail in etcd 3.7.
        """
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                data = f.read()
        except OSError:
            return ""
        all_lines = data.decode("utf-8", "replace").rstrip("\n").splitlines()
        if len(all_lines) <= lines + 1:
            return "\n".join(all_lines)
        return "\n".join([all_lines[0], "...", *all_lines[-lines:]])

    def terminate(self, *, grace: float = 10.0, graceful: bool = True, quiet: bool = False) -> int | None:
        """Stop the process: SIGTERM, then SIGKILL after ``grace`` seconds.

        With ``graceful=False`` sends SIGKILL at once; ``quiet`` logs the
        escalation to SIGKILL at INFO instead of WARNING. Blocks until the
        process has exited (and is reaped). Returns its exit status, or None
        if no process was started. Idempotent.
        """
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            sig = signal.SIGTERM if graceful else signal.SIGKILL
            logger.info("stopping etcd %s (pid %d) with %s", self.name, proc.pid, sig.name)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                proc.wait(timeout=grace if graceful else 30.0)
            except subprocess.TimeoutExpired:
                logger.log(
                    logging.INFO if quiet else logging.WARNING,
                    "etcd %s (pid %d) ignored SIGTERM for %.1fs; sending SIGKILL",
                    self.name, proc.pid, grace,
                )  # fmt: skip
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        process.unregister_live(self)
        return proc.returncode

    # -- readiness --------------------------------------------------------

    def _probe(self, timeout: float) -> str | None:
        """One readiness probe (``GET /health``): None when ready, else why not.

        See the module docstring (*Readiness*) for why ``/health``.
        """
        try:
            return self.gateway.health(timeout=timeout)
        except (OSError, http.client.HTTPException) as e:
            return f"{type(e).__name__}: {e}"

    def wait_ready(self, deadline: float) -> None:
        """Poll until the member serves v3 requests or ``deadline`` (monotonic).

        Between probes it waits on the process (``proc.wait(timeout=...)``) so
        an exit is noticed at once.

        Raises:
            EtcdStartError: the process exited (exit code and log tail).
            EtcdStartTimeoutError: still not ready at ``deadline``.
        """
        proc = self.proc
        if proc is None:
            raise RuntimeError("wait_ready() before launch()")
        delay = 0.02
        why_not: str | None = "none made"
        while True:
            rc = proc.poll()
            if rc is not None:
                process.unregister_live(self)
                raise EtcdStartError(
                    f"etcd {self.name} exited during start-up with code {rc} "
                    f"(command: {' '.join(self.cmd)})",
                    returncode=rc,
                    log_tail=self.log_tail(),
                    cmd=self.cmd,
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                tail = self.log_tail()
                raise EtcdStartTimeoutError(
                    f"etcd {self.name} (pid {proc.pid}) not ready at {self.client_url} "
                    f"before the start-up deadline (last probe: {why_not})",
                    returncode=None,
                    log_tail=tail,
                    cmd=self.cmd,
                )
            why_not = self._probe(min(remaining, 1.0))
            if why_not is None:
                return
            remaining = deadline - time.monotonic()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, min(delay, remaining)))
            delay = min(delay * 2, 0.2)


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
        auth: enable authentication after the first start (:class:`AuthConfig`).
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
        self._member: _EtcdMember | None = None
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
        ``stop()``) reuse the same ports. When ``auth`` is set it is set up
        after the first readiness.

        Args:
            timeout: seconds to wait for readiness, per attempt.
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
            attempts = max(1, num_retries)
            for attempt in range(1, attempts + 1):
                had_data = os.path.isdir(os.path.join(data_dir, "member"))
                repick = self._ports is None
                if repick:
                    self._ports = self._pick_ports()
                member = self._new_member(data_dir)
                try:
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
                break
            self._member = member
            logger.info(
                "etcd %s ready at %s (pid %d, data dir %s)",
                self.version, member.client_url, member.proc.pid if member.proc else -1, data_dir,
            )  # fmt: skip
            if self.auth is not None and not self._auth_done:
                try:
                    setup_auth(member.gateway, self.auth)
                except BaseException:
                    self.stop()
                    raise
                self._auth_done = True

    def _pick_ports(self) -> tuple[int, int]:
        need = [p is None for p in (self._given_port, self._given_peer_port)]
        free = iter(process.free_ports(sum(need)))
        client = self._given_port if self._given_port is not None else next(free)
        peer = self._given_peer_port if self._given_peer_port is not None else next(free)
        return client, peer

    def _new_member(self, data_dir: str) -> _EtcdMember:
        assert self._ports is not None and self._work_dir is not None
        member = _EtcdMember(
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

        (Typed ``Any`` so that type-checking etcd_server does not pull in
        etcd_store.)

        TLS files and (with auth) the root credentials are filled in;
        ``overrides`` (e.g. ``user=..., password=..., timeout=...``) replace
        them. Imports ``etcd_store`` (and grpc) only when called.
        """
        return _make_client([self.get_client_url()], self.tls, self.auth, overrides)

    def gateway_call(
        self, path: str, body: dict[str, Any] | None = None, *, timeout: float = 5.0,
        token: str | None = None,
    ) -> dict[str, Any]:
        """POST to this server's JSON gateway (``/v3/...``); see ``Gateway.call``."""
        if self._member is None:
            raise RuntimeError("etcd server not started")
        return self._member.gateway.call(path, body, timeout=timeout, token=token)


def check_v2_support(binary: str) -> None:
    """Raise ``ValueError`` naming the version if ``binary`` has no v2 API (3.6+).

    Runs ``binary --version`` once (cached).
    """
    version = etcd_version(binary)
    if not has_v2_api(version):
        raise ValueError(
            f"enable_v2=True needs etcd 3.5 or older, but {binary} is etcd {version}: "
            "etcd 3.6 removed the v2 API and its --enable-v2 flag"
        )


def _client_target(urls: list[str], tls: TLSConfig | None) -> str | list[str]:
    """Endpoints for EtcdClient: "host:port" without TLS, https URLs with it."""
    if tls is None:
        urls = [u.split("://", 1)[1] for u in urls]
    return urls[0] if len(urls) == 1 else urls


def _make_client(
    urls: list[str],
    tls: TLSConfig | None,
    auth: AuthConfig | None,
    overrides: dict[str, Any],
) -> Any:
    """``etcd_store.client.EtcdClient`` for ``urls`` with TLS/auth filled in.

    Imported with importlib at call time: etcd_server itself must not import
    etcd_store (or grpc), nor make type checkers follow it.
    """
    kwargs: dict[str, Any] = {}
    if tls is not None:
        kwargs.update(ca_cert=tls.ca_file, cert=tls.client_cert, key=tls.client_key)
    if auth is not None:
        kwargs.update(user="root", password=auth.root_password)
    kwargs.update(overrides)
    client_cls = importlib.import_module("etcd_store.client").EtcdClient
    return client_cls(_client_target(urls, tls), **kwargs)
