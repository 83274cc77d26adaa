"""Local etcd members on loopback: the lifecycle :class:`EtcdCluster` and ``EtcdServer`` share.

:class:`_LocalEtcd` starts, retries and stops a group of
:class:`~etcd_server.member.EtcdMember` s; its faces are :class:`EtcdCluster` (``size``
members, static ``--initial-cluster`` on free ``127.0.0.1`` ports) and
:class:`~etcd_server.server.EtcdServer` (one member, torch's drop-in API). A start launches
every member, then polls each until ready (``GET /health``, see :mod:`etcd_server.member`);
a port taken between probing and binding is retried on other new ports. Every start or
stop blocks until done and holds the face's lock (exit clean-up: :mod:`etcd_server.process`).

With :class:`~etcd_server.gateway.AuthConfig`, auth is set up before any client port
exists (:meth:`_LocalEtcd._set_up_auth_privately`), at the cost of one more start and stop.

Importing etcd_server never imports etcd_store (or grpc): :func:`make_client`, the one
arrow between them, imports it on the first ``get_client()``. Standard library only.
"""

from __future__ import annotations

import http.client
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Sequence
from types import TracebackType
from typing import Any, TextIO

from . import process
from .binary import check_v2_support, etcd_version, find_etcd_binary
from .gateway import AuthConfig, auth_enabled, setup_auth
from .member import EtcdMember, EtcdStartError, EtcdStartTimeoutError, TLSConfig

__all__ = ["EtcdCluster", "make_client"]

logger = logging.getLogger(__name__)


def make_client(
    urls: list[str],
    tls: TLSConfig | None,
    auth: AuthConfig | None,
    overrides: dict[str, Any],
) -> Any:
    """An ``etcd_store.client.EtcdClient`` for ``urls`` with TLS files and (with ``auth``) root credentials.

    Without TLS the endpoints are "host:port" and auth may go in plain text (the server is on
    this host); ``overrides`` (e.g. ``user=..., timeout=...``) win. Sends no request. Returns
    ``Any`` so that etcd_server's signatures name no etcd_store type.

    Raises:
        ImportError: etcd_store (or grpc) is not installed.
    """
    from etcd_store.client import EtcdClient  # here only: etcd_server stays stdlib-only at import

    kwargs: dict[str, Any] = {}
    if tls is not None:
        kwargs.update(ca_cert=tls.ca_file, cert=tls.client_cert, key=tls.client_key)
    else:
        urls = [u.split("://", 1)[1] for u in urls]
    if auth is not None:
        kwargs.update(user="root", password=auth.root_password)
        kwargs.update(allow_insecure_auth=tls is None)
    kwargs.update(overrides)
    return EtcdClient(urls[0] if len(urls) == 1 else urls, **kwargs)


class _LocalEtcd:
    """What :class:`EtcdCluster` and ``EtcdServer`` share: settings, start, auth set-up, stop.

    A face supplies the members of each start attempt (:meth:`_members_for_attempt`),
    what a retry on new ports wipes and logs, how a failed attempt is stopped, and
    its ready log line. Thread-safe: every lifecycle call holds ``_lock``.
    """

    _KIND = ""  # "server" or "cluster": in messages and the temporary directory's name

    def __init__(
        self,
        *,
        binary: str | None,
        data_dir: str | None,
        enable_v2: bool,
        extra_args: Sequence[str],
        tls: TLSConfig | None,
        auth: AuthConfig | None,
        die_with_parent: bool,
        stop_grace: float,
        heartbeat_ms: int | None,
        election_timeout_ms: int | None,
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
        self.heartbeat_ms = heartbeat_ms
        self.election_timeout_ms = election_timeout_ms
        self._given_data_dir = os.path.abspath(data_dir) if data_dir else None
        self._work_dir: str | None = None
        self._members: list[EtcdMember] = []
        self._auth_done = False
        self._lock = threading.RLock()

    @property
    def version(self) -> str:
        """etcd version of the binary, e.g. ``"3.5.1"`` (from ``etcd --version``, cached)."""
        return etcd_version(self.binary)

    # -- what a face supplies ----------------------------------------------

    def _members_for_attempt(self) -> tuple[list[EtcdMember], bool]:
        """The members to launch, and whether their ports are new (then a collision is retried)."""
        raise NotImplementedError

    def _retry_on_new_ports(self, members: list[EtcdMember], fresh: list[bool], attempt: int, attempts: int) -> None:
        """Log the retry and wipe what the failed attempt left in data dirs that had none."""
        raise NotImplementedError

    def _abort(self, members: list[EtcdMember]) -> None:
        """Stop the members of a failed attempt."""
        raise NotImplementedError

    def _log_ready(self) -> None:
        raise NotImplementedError

    # -- the shared lifecycle ----------------------------------------------

    def _new_member(self, name: str, data_dir: str, client_port: int, peer_port: int) -> EtcdMember:
        assert self._work_dir is not None
        return EtcdMember(
            binary=self.binary, name=name, data_dir=data_dir, work_dir=self._work_dir,
            client_port=client_port, peer_port=peer_port, tls=self.tls, enable_v2=self.enable_v2,
            extra_args=self.extra_args, die_with_parent=self.die_with_parent,
            heartbeat_ms=self.heartbeat_ms, election_timeout_ms=self.election_timeout_ms,
        )  # fmt: skip

    def _start_members(self, timeout: float, num_retries: int, stderr: int | TextIO | None = None) -> None:
        """Launch the members and block until each serves v3 (see the faces' ``start``).

        A collision (etcd's "address already in use", or with ``stderr`` given any exit) on
        new ports is retried on other new ports, ``num_retries`` attempts in all.
        """
        with self._lock:
            if any(m.running() for m in self._members):
                raise RuntimeError(f"etcd {self._KIND} already running; call stop() first")
            if self._work_dir is None:
                self._work_dir = process.make_temp_dir(f"etcd-{self._KIND}-")
            attempts = max(1, num_retries)
            for attempt in range(1, attempts + 1):
                members, new_ports = self._members_for_attempt()
                fresh = [not os.path.isdir(os.path.join(m.data_dir, "member")) for m in members]
                try:
                    if self.auth is not None and not self._auth_done:
                        self._set_up_auth_privately(members, timeout, stderr)
                    for m in members:
                        m.launch(stderr)
                    deadline = time.monotonic() + timeout
                    for m in members:
                        m.wait_ready(deadline)
                except EtcdStartError as e:
                    self._abort(members)
                    collision = e.address_in_use or (stderr is not None and e.returncode is not None)
                    if new_ports and collision and attempt < attempts:
                        self._retry_on_new_ports(members, fresh, attempt, attempts)
                        continue
                    self._fail_cleanup(new_ports)
                    raise
                except BaseException:
                    self._abort(members)
                    self._fail_cleanup(new_ports)
                    raise
                self._members = members
                self._log_ready()
                if self.auth is not None:
                    self._auth_done = True
                return

    def _set_up_auth_privately(self, members: list[EtcdMember], timeout: float, stderr: int | TextIO | None) -> None:
        """Set up auth before any client port opens; blocks for one start and one stop.

        Starts every member with clients only on a unix socket in a private (0700) directory
        (peer ports real, TLS when configured), runs :func:`~etcd_server.gateway.setup_auth`
        through member 0 (it also checks that the keyspace revision did not move), waits until
        every member applied ``auth enable``, and stops them all. Auth state lives in the data
        dirs, which the real start reuses.

        Raises what :meth:`EtcdMember.wait_ready` and ``setup_auth`` raise; etcd is stopped.
        """
        assert self.auth is not None
        private = process.make_private_dir(self._work_dir)
        try:
            for m in members:
                m.private_dir = private
                m.launch(stderr)
            deadline = time.monotonic() + timeout
            for m in members:
                m.wait_ready(deadline)
            setup_auth(members[0].gateway, self.auth)
            for m in members[1:]:  # a member restarts with what it applied: auth on in each
                while not auth_enabled(m.gateway, self.auth, timeout=max(0.1, deadline - time.monotonic())):
                    if time.monotonic() >= deadline:
                        raise EtcdStartTimeoutError(
                            f"etcd {m.name} did not apply 'auth enable' before the start-up deadline",
                            returncode=None, log_tail=m.log_tail(), cmd=m.cmd,
                        )  # fmt: skip
                    time.sleep(0.02)
        finally:
            self._terminate_all(members, graceful=True)
            for m in members:
                m.private_dir = None
            process.remove_temp_dir(private)

    def _fail_cleanup(self, new_ports: bool) -> None:
        """After a failed start: drop the temporary directory unless earlier members use it."""
        if not self._members and self._work_dir:
            self._drop_work_dir()

    def _drop_work_dir(self) -> None:
        if self._work_dir:
            process.remove_temp_dir(self._work_dir)
            self._work_dir = None

    def _terminate_all(self, members: list[EtcdMember], *, graceful: bool) -> None:
        """Stop all members one at a time, the leader last.

        A leader that gets SIGTERM tries to hand leadership to a follower it believes alive and
        waits etcd's ~7 s transfer timeout when none answers. The last of several members gets
        at most 1 s before SIGKILL (safe: etcd fsynced all it acknowledged); others ``stop_grace``.
        """
        live = [m for m in members if m.running()]
        if graceful and len(live) > 1:
            leader = self._leader_once(members)
            if leader is not None and members[leader] in live:
                live.remove(members[leader])
                live.append(members[leader])
        for n, m in enumerate(live):
            last = n == len(live) - 1 and len(live) > 1
            grace = min(self.stop_grace, 1.0) if last else self.stop_grace
            m.terminate(grace=grace, graceful=graceful, quiet=last)
        for m in members:  # reap/unregister any that died on their own
            m.terminate(grace=self.stop_grace, graceful=graceful)

    @staticmethod
    def _leader_once(members: list[EtcdMember]) -> int | None:
        """The index of the live member whose ``/metrics`` says it leads, or None."""
        for i, m in enumerate(members):
            if not m.running():
                continue
            try:
                if m.gateway.is_leader(timeout=1.0):
                    return i
            except (OSError, http.client.HTTPException):
                continue
        return None

    def stop(self, *, keep_data: bool = False, graceful: bool = True) -> None:
        raise NotImplementedError

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class EtcdCluster(_LocalEtcd):
    """``size`` etcd members on ``127.0.0.1`` forming one cluster.

    Args:
        size: number of members (>= 1).
        data_dir: parent of the members' data dirs (``<data_dir>/member-<i>``), kept;
            None: a temporary one, removed by ``stop()``.
        binary, enable_v2, extra_args, tls, auth, die_with_parent, stop_grace: as for
            :class:`~etcd_server.server.EtcdServer`; ``extra_args`` go to every member.
        heartbeat_ms, election_timeout_ms: raft timing; None keeps etcd's 100 / 1000 ms,
            which tolerate a loaded machine.

    Raises:
        EtcdBinaryNotFoundError: no etcd binary found.
        ValueError: ``size`` < 1, or ``enable_v2=True`` with etcd 3.6+ (no v2 API).
    """

    _KIND = "cluster"

    def __init__(
        self,
        size: int = 3,
        binary: str | None = None,
        *,
        data_dir: str | None = None,
        enable_v2: bool = False,
        extra_args: Sequence[str] = (),
        tls: TLSConfig | None = None,
        auth: AuthConfig | None = None,
        die_with_parent: bool = True,
        stop_grace: float = 10.0,
        heartbeat_ms: int | None = None,
        election_timeout_ms: int | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"cluster size must be >= 1, got {size}")
        self.size = size
        super().__init__(
            binary=binary, data_dir=data_dir, enable_v2=enable_v2, extra_args=extra_args, tls=tls,
            auth=auth, die_with_parent=die_with_parent, stop_grace=stop_grace,
            heartbeat_ms=heartbeat_ms, election_timeout_ms=election_timeout_ms,
        )  # fmt: skip

    # -- accessors ---------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """``["127.0.0.1:PORT", ...]`` of all members (also stopped ones)."""
        return [m.endpoint for m in self._members]

    @property
    def endpoint_string(self) -> str:
        """:attr:`endpoints` joined with commas (``--rdzv-endpoint`` format)."""
        return ",".join(self.endpoints)

    @property
    def client_urls(self) -> list[str]:
        """``http(s)://127.0.0.1:PORT`` of all members."""
        return [m.client_url for m in self._members]

    @property
    def peer_urls(self) -> list[str]:
        """``http(s)://127.0.0.1:PORT`` of all members' peer ports (https with TLS)."""
        return [m.peer_url for m in self._members]

    @property
    def pids(self) -> list[int | None]:
        """PID per member, None for a stopped one."""
        return [m.pid for m in self._members]

    @property
    def data_dirs(self) -> list[str]:
        """Data directory per member."""
        return [m.data_dir for m in self._members]

    def is_running(self, i: int) -> bool:
        """True while member ``i``'s process is alive."""
        return self._members[i].running()

    # -- lifecycle ---------------------------------------------------------

    def start(self, timeout: float = 60, num_retries: int = 3) -> None:
        """Start all members; block until every one serves v3 (a leader and a read through raft).

        On the first start, a port taken between probing and binding stops all members, wipes
        their fresh data and retries on new ports (``num_retries`` attempts in all).

        Raises:
            RuntimeError: already started.
            EtcdStartError: a member exited during start-up (exit code, log tail); all are stopped.
            EtcdStartTimeoutError: not ready within ``timeout``.
        """
        self._start_members(timeout, num_retries)

    def _members_for_attempt(self) -> tuple[list[EtcdMember], bool]:
        assert self._work_dir is not None
        new_ports = not self._members
        members = self._new_members() if new_ports else self._members
        for m in members:  # the log dir is new after a stop()
            m.work_dir = self._work_dir
        return members, new_ports

    def _new_members(self) -> list[EtcdMember]:
        assert self._work_dir is not None
        base = self._given_data_dir or os.path.join(self._work_dir, "data")
        ports = process.free_ports(2 * self.size)
        members = [
            self._new_member(f"member-{i}", os.path.join(base, f"member-{i}"), ports[2 * i], ports[2 * i + 1])
            for i in range(self.size)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
        token = "etcd-cluster-" + uuid.uuid4().hex[:12]
        for m in members:
            m.initial_cluster = initial
            m.cluster_token = token
        return members

    def _retry_on_new_ports(self, members: list[EtcdMember], fresh: list[bool], attempt: int, attempts: int) -> None:
        logger.warning("etcd cluster ports taken (attempt %d/%d); retrying on new ports", attempt, attempts)
        for m, was_fresh in zip(members, fresh, strict=True):
            if was_fresh:
                shutil.rmtree(m.data_dir, ignore_errors=True)

    def _abort(self, members: list[EtcdMember]) -> None:
        self._terminate_all(members, graceful=False)

    def _log_ready(self) -> None:
        logger.info("etcd %s cluster ready at %s", self.version, self.endpoint_string)

    def stop(self, *, keep_data: bool = False, graceful: bool = True) -> None:
        """Stop every member (SIGTERM, SIGKILL after ``stop_grace``; blocks).

        Removes the temporary data unless ``keep_data``. Idempotent; a later
        ``start()`` reuses the ports (and data, when kept or caller-given).
        """
        with self._lock:
            self._terminate_all(self._members, graceful=graceful)
            if not keep_data and self._work_dir:
                self._drop_work_dir()
                if not self._given_data_dir:
                    self._members = []
                    self._auth_done = False

    def stop_member(self, i: int, *, graceful: bool = False) -> None:
        """Stop member ``i``; block until it exited (SIGKILL by default: a crash; SIGTERM if ``graceful``).

        Its data dir and ports are kept for :meth:`start_member`.
        """
        with self._lock:
            self._members[i].terminate(grace=self.stop_grace, graceful=graceful)

    def start_member(self, i: int, timeout: float = 60) -> None:
        """Start member ``i`` again on its ports and data dir; block until ready (needs a live quorum).

        Raises:
            RuntimeError: the member is running.
            EtcdStartError / EtcdStartTimeoutError: as for :meth:`start`.
        """
        with self._lock:
            m = self._members[i]
            m.launch()
            try:
                m.wait_ready(time.monotonic() + timeout)
            except BaseException:
                m.terminate(grace=2.0)
                raise

    def leader(self, timeout: float = 10.0) -> int:
        """Index of the leader: the live member whose ``/metrics`` has ``etcd_server_is_leader`` 1.

        etcd 3.4 to 3.7 serve ``/metrics`` without auth, also where the JSON gateway would need a
        token or refuse the client certificate. Polls until a leader is found.

        Raises:
            TimeoutError: no leader within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = self._leader_once(self._members)
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no etcd leader among {self.endpoint_string} within {timeout}s")
            time.sleep(0.05)

    def get_client(self, **overrides: Any) -> Any:
        """An ``EtcdClient`` over all members' endpoints, TLS and credentials set (:func:`make_client`)."""
        return make_client(self.client_urls, self.tls, self.auth, overrides)

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __repr__(self) -> str:
        return f"EtcdCluster({self.endpoint_string or self.size}, pids={self.pids})"
