"""One etcd process: its command line (with :class:`TLSConfig`), launch, readiness, log and stop.

:class:`EtcdMember` is what :class:`~etcd_server.EtcdServer` (one member) and
:class:`~etcd_server.EtcdCluster` (several) share. Every flag used exists, undeprecated, in
etcd 3.4 to 3.7 (``--enable-v2`` only when asked, which callers allow on 3.4/3.5 only); the
command line never holds a secret.

Ports
-----
Clients: ``http(s)://127.0.0.1:<client>``. Peers: ``http://127.0.0.1:<peer>`` without TLS
(open to every local user: trusted single-user machines only); with a :class:`TLSConfig`,
``https://`` with ``--peer-client-cert-auth`` (which certificates pass: :class:`TLSConfig`).

A *private set-up start* (``private_dir`` set) serves clients only in plain text on the
unix socket ``<private_dir>/localhost:<client>``: etcd's unix URLs need a ``host:port``,
taken as a file name relative to etcd's working directory, then ``private_dir``. The peer
port is as above. The server and the cluster use it to set up auth before the real client
port exists.

Readiness
---------
Ready means ``GET /health`` on the client URL answers ``{"health": "true"}``. etcd 3.4 to
3.7 all serve it with that body, true only with a leader, no alarm, and a read through
raft (3.4: a quorum read; 3.5+: a linearizable range). The alternatives depend on the
version:

* ``/readyz`` and ``/livez`` exist only from 3.6 on;
* the JSON gateway (``/v3/...``) needs a token once auth is on (3.6+ even for
  ``/v3/maintenance/status``), refuses (plain-text HTTP 400) a TLS client whose
  certificate has a CommonName while auth is on, and changed its error bodies in 3.6
  (only the ``code`` field and the HTTP status are common to all versions);
* gRPC works everywhere but needs grpc, and this package is standard-library only.

``/health`` is not behind the gateway. Leader discovery
(:meth:`etcd_server.EtcdCluster.leader`) likewise reads ``/metrics`` (all versions, no
auth). The auth set-up still uses the gateway, telling answers apart by HTTP status and
gRPC ``code`` only (:func:`etcd_server.gateway.setup_auth`).

Standard library only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import logging
import os
import signal
import ssl
import subprocess
import time
import uuid
from collections.abc import Sequence
from typing import IO, Any

from . import process
from .gateway import Gateway
from .process import HOST

__all__ = ["EtcdMember", "EtcdStartError", "EtcdStartTimeoutError", "TLSConfig"]

logger = logging.getLogger(__name__)

_LOG_TAIL_LINES = 20


class EtcdStartError(RuntimeError):
    """etcd did not come up.

    Attributes:
        returncode: exit status of the etcd process (negative: killed by that
            signal), or None if it was still running (a time-out).
        log_tail: the last lines etcd wrote to its stderr log ("" when the
            caller redirected stderr elsewhere).
        cmd: the command line that was run.
    """

    def __init__(
        self,
        message: str,
        *,
        returncode: int | None = None,
        log_tail: str = "",
        cmd: Sequence[str] = (),
    ) -> None:
        self.returncode = returncode
        self.log_tail = log_tail
        self.cmd = list(cmd)
        full = message
        if log_tail:
            full += "\n--- last lines of the etcd log ---\n" + log_tail
        super().__init__(full)

    @property
    def address_in_use(self) -> bool:
        """True if the log says a listen port was already taken."""
        return "address already in use" in self.log_tail


class EtcdStartTimeoutError(EtcdStartError, TimeoutError):
    """etcd was still running but not ready when the start-up deadline passed."""


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """Serve the client API over https (frozen; ``ValueError`` at construction naming a bad field).

    Attributes:
        cert_file, key_file: the server certificate and key (PEM); the certificate should
            name ``IP:127.0.0.1``. etcd's JSON gateway dials the server with it, so with
            ``client_cert_auth`` it must also allow clientAuth (extendedKeyUsage).
        ca_file: CA bundle that signed the server (and client) certificates
            (``--trusted-ca-file``; our probes and clients trust it).
        client_cert_auth: require a client certificate signed by ``ca_file`` (``--client-cert-auth``).
        client_cert_file, client_key_file: what our probes and :meth:`EtcdServer.get_client`
            present; default: the server certificate and key.
        peer_cert_file, peer_key_file, peer_ca_file: ``--peer-cert-file``, ``--peer-key-file``,
            ``--peer-trusted-ca-file``; default: ``cert_file``, ``key_file``, ``ca_file``. With
            TLS the peer port always serves https and requires a peer certificate of that CA;
            members dial each other with the peer certificate, so in a cluster it must allow
            serverAuth and clientAuth and name ``IP:127.0.0.1``.
        peer_allowed_cn: accept only peer certificates with this CommonName
            (``--peer-cert-allowed-cn``). Without it (and without a separate ``peer_ca_file``)
            every certificate the client CA signed, a client's included, passes as a peer's.
    """

    cert_file: str
    key_file: str
    ca_file: str
    client_cert_auth: bool = True
    client_cert_file: str | None = None
    client_key_file: str | None = None
    peer_cert_file: str | None = None
    peer_key_file: str | None = None
    peer_ca_file: str | None = None
    peer_allowed_cn: str | None = None

    def __post_init__(self) -> None:
        if (self.peer_cert_file is None) != (self.peer_key_file is None):
            raise ValueError("TLSConfig.peer_cert_file and peer_key_file go together")
        if self.peer_allowed_cn is not None and not self.peer_allowed_cn:
            raise ValueError("TLSConfig.peer_allowed_cn must not be empty")

    @property
    def peer_cert(self) -> str:
        """Certificate of the peer port (served and presented to other members)."""
        return self.peer_cert_file or self.cert_file

    @property
    def peer_key(self) -> str:
        """Key of :attr:`peer_cert`."""
        return self.peer_key_file or self.key_file

    @property
    def peer_ca(self) -> str:
        """CA a peer's certificate must be signed by."""
        return self.peer_ca_file or self.ca_file

    @property
    def client_cert(self) -> str:
        """Certificate presented by our own clients."""
        return self.client_cert_file or self.cert_file

    @property
    def client_key(self) -> str:
        """Key of :attr:`client_cert`."""
        return self.client_key_file or self.key_file

    def ssl_context(self) -> ssl.SSLContext:
        """A client-side context trusting ``ca_file`` and presenting the client cert."""
        ctx = ssl.create_default_context(cafile=self.ca_file)
        ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx


class EtcdMember:
    """One etcd process. Not thread-safe; owned by an :class:`EtcdServer` or ``EtcdCluster``."""

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
        #: When set, the next launch is a private set-up start (module docstring, *Ports*).
        self.private_dir: str | None = None

    # -- addresses --------------------------------------------------------

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.client_port}"

    @property
    def client_url(self) -> str:
        if self.private_dir is not None:
            # host:port is the socket's file name, relative to etcd's cwd (module docstring, *Ports*).
            return f"unix://{self.private_socket_name}"
        return f"{self.scheme}://{HOST}:{self.client_port}"

    @property
    def private_socket_name(self) -> str:
        return f"localhost:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"{self.scheme}://{HOST}:{self.peer_port}"

    @property
    def gateway(self) -> Gateway:
        socket_path = (
            os.path.join(self.private_dir, self.private_socket_name) if self.private_dir is not None else None
        )
        gw = self._gateway
        if gw is None or gw.base_url != self.client_url or gw.unix_socket != socket_path:
            if socket_path is not None:
                gw = Gateway("http://localhost", unix_socket=socket_path)
            else:
                gw = Gateway(self.client_url, self.tls.ssl_context() if self.tls else None)
            self._gateway = gw
        return gw

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
        if self.tls and self.private_dir is None:
            cmd += [
                "--cert-file", os.path.abspath(self.tls.cert_file),
                "--key-file", os.path.abspath(self.tls.key_file),
                "--trusted-ca-file", os.path.abspath(self.tls.ca_file),
            ]  # fmt: skip
            if self.tls.client_cert_auth:
                cmd.append("--client-cert-auth=true")
        if self.tls:  # the peer port: https, and only members with a certificate of the peer CA
            cmd += [
                "--peer-cert-file", os.path.abspath(self.tls.peer_cert),
                "--peer-key-file", os.path.abspath(self.tls.peer_key),
                "--peer-trusted-ca-file", os.path.abspath(self.tls.peer_ca),
                "--peer-client-cert-auth=true",
            ]  # fmt: skip
            if self.tls.peer_allowed_cn:
                cmd.append(f"--peer-cert-allowed-cn={self.tls.peer_allowed_cn}")
        cmd += self.extra_args
        return cmd

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.running() and self.proc else None

    def launch(self, stderr: int | IO[Any] | None = None) -> None:
        """Start the process; does not wait for readiness.

        etcd's stdout and stderr go to ``<work_dir>/<name>.log`` (appended), or to ``stderr`` when given.
        """
        if self.running():
            raise RuntimeError(f"etcd member {self.name} is already running")
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        self.cmd = self.command()
        prefix = process.death_signal_prefix(self.die_with_parent)
        preexec = None if prefix else process.make_preexec(self.die_with_parent)
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
            cmd = [*(prefix or []), *self.cmd]

            def popen() -> subprocess.Popen[bytes]:
                # Without preexec_fn Python spawns with vfork (no atfork handlers in the child); the
                # fallback preexec_fn only makes the prctl system call (see make_preexec).
                return subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    close_fds=True,
                    start_new_session=True,
                    cwd=self.private_dir,
                    preexec_fn=preexec,
                )

            dies_with_parent = prefix is not None or preexec is not None
            self.proc = process.in_spawner_thread(popen) if dies_with_parent else popen()
        process.register_live(self)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines etcd logged since the latest launch.

        When lines were cut, the first is kept too, above a ``...``: a flag error is etcd's
        first line, followed (etcd 3.7) by a usage text longer than the tail.
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
        """Stop the process: SIGTERM, SIGKILL after ``grace`` s (at once when not ``graceful``).

        Blocks until it is reaped; ``quiet`` logs the SIGKILL at INFO, not WARNING. Returns the
        exit status, None if none was started. Idempotent.
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
        """One readiness probe (``GET /health``, see *Readiness*): None when ready, else why not."""
        try:
            return self.gateway.health(timeout=timeout)
        except (OSError, http.client.HTTPException) as e:
            return f"{type(e).__name__}: {e}"

    def start_error(self, message: str, returncode: int | None = None) -> EtcdStartError:
        """The error of a start that failed with ``message``, carrying the log tail and command line:
        an :class:`EtcdStartError` for an exit (``returncode``), else an :class:`EtcdStartTimeoutError`."""
        cls = EtcdStartTimeoutError if returncode is None else EtcdStartError
        return cls(message, returncode=returncode, log_tail=self.log_tail(), cmd=self.cmd)

    def wait_ready(self, deadline: float) -> None:
        """Poll until the member serves v3 requests or ``deadline`` (monotonic).

        Between probes it waits on the process, so an exit is noticed at once.

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
                raise self.start_error(
                    f"etcd {self.name} exited during start-up with code {rc} (command: {' '.join(self.cmd)})", rc
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self.start_error(
                    f"etcd {self.name} (pid {proc.pid}) not ready at {self.client_url} "
                    f"before the start-up deadline (last probe: {why_not})"
                )
            why_not = self._probe(min(remaining, 1.0))
            if why_not is None:
                return
            remaining = deadline - time.monotonic()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, min(delay, remaining)))
            delay = min(delay * 2, 0.2)
