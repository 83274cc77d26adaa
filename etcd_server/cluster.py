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
from typing import Any, TextIO, TypeVar

from . import process
from .binary import check_v2_support, etcd_version, find_etcd_binary
from .gateway import AuthConfig, auth_enabled, setup_auth
from .member import EtcdMember, EtcdStartError, TLSConfig

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


_Face = TypeVar("_Face", bound="_LocalEtcd")


class _LocalEtcd:
    """What :class:`EtcdCluster` and ``EtcdServer`` share: settings, start, auth set-up, stop.

    A face names its members (:meth:`_layout`) and words its ready and retry log lines
    (``_READY_LOG``, ``_RETRY_LOG``: ``%``-mappings of :meth:`_log`'s facts). Ports chosen at the
    first start are kept until a failed first start or a retry: a later ``start()`` (after
    ``stop()``) reuses them, so connected clients can reconnect. Thread-safe: every lifecycle
    call holds ``_lock``.
    """

    _KIND = ""  # "server" or "cluster": in messages, the temporary directory's and the cluster token's names
    _READY_LOG = ""
    _RETRY_LOG = ""
    _logger = logger

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
        self._ports: list[tuple[int, int]] | None = None  # (client, peer) per member, kept across stop()
        self._auth_done = False
        self._lock = threading.RLock()

    @property
    def version(self) -> str:
        """etcd version of the binary, e.g. ``"3.5.1"`` (from ``etcd --version``, cached)."""
        return etcd_version(self.binary)

    def _layout(self) -> list[tuple[str, str, int | None, int | None]]:
        """Per member: its name, data dir, and the client and peer ports the caller fixed (None: free)."""
        raise NotImplementedError

    # -- start -------------------------------------------------------------

    def start(self, timeout: float = 60, num_retries: int = 3, stderr: int | TextIO | None = None) -> None:
        """Start etcd and block until every member serves v3 (a leader and a read through raft).

        The first start picks free ports for those the caller did not fix; a collision there
        (etcd's "address already in use", or with ``stderr`` given any exit) stops the members,
        wipes what they wrote in data dirs that had no data and retries on new ports,
        ``num_retries`` attempts in all. A later start (after ``stop()``) reuses the ports: a
        kept port that is taken fails. With ``auth``, the first start sets it up first
        (:meth:`_set_up_auth_privately`).

        Args:
            timeout: seconds to wait for readiness, per attempt (and once more for the
                private auth set-up start).
            num_retries: attempts in all when a port collision happens.
            stderr: where etcd's stdout/stderr go; default a log file per member (whose tail goes
                into errors).

        Raises:
            RuntimeError: already running.
            EtcdStartError: a member exited during start-up (``returncode``, ``log_tail``).
            EtcdStartTimeoutError: not ready within ``timeout`` (also a ``TimeoutError``).
            EtcdGatewayError: the auth set-up was refused.

        On any error the attempt's members are stopped (:meth:`_abort`).
        """
        with self._lock:
            if any(m.running() for m in self._members):
                raise RuntimeError(f"etcd {self._KIND} already running; call stop() first")
            if self._work_dir is None:
                self._work_dir = process.make_temp_dir(f"etcd-{self._KIND}-")
            attempts = max(1, num_retries)
            for attempt in range(1, attempts + 1):
                new_ports = self._ports is None
                members = self._members_for_attempt()
                fresh = [not os.path.isdir(os.path.join(m.data_dir, "member")) for m in members]
                try:
                    if self.auth is not None and not self._auth_done:
                        self._set_up_auth_privately(members, timeout, stderr)
                    self._launch(members, timeout, stderr)
                except BaseException as e:
                    self._abort(members)
                    collision = isinstance(e, EtcdStartError) and (
                        e.address_in_use or (stderr is not None and e.returncode is not None)
                    )
                    if new_ports:
                        self._ports = None
                    if new_ports and collision and attempt < attempts:
                        self._log(logging.WARNING, self._RETRY_LOG, members, attempt=attempt, attempts=attempts)
                        for m, was_fresh in zip(members, fresh, strict=True):
                            if was_fresh:
                                shutil.rmtree(os.path.join(m.data_dir, "member"), ignore_errors=True)
                        continue
                    if not self._members:
                        self._drop_work_dir()
                    raise
                self._members = members
                self._log(logging.INFO, self._READY_LOG, members, version=self.version, pid=members[0].pid or -1)
                self._auth_done = self.auth is not None
                return

    def _members_for_attempt(self) -> list[EtcdMember]:
        """The members on the kept ports (and cluster token), or on new ones when none are kept."""
        assert self._work_dir is not None
        layout = self._layout()
        if self._ports is None:
            free = iter(process.free_ports(sum((c, p).count(None) for _, _, c, p in layout)))
            self._ports = [(c if c is not None else next(free), p if p is not None else next(free))
                           for _, _, c, p in layout]  # fmt: skip
        members = [
            EtcdMember(
                binary=self.binary, name=name, data_dir=data_dir, work_dir=self._work_dir,
                client_port=client, peer_port=peer, tls=self.tls, enable_v2=self.enable_v2,
                extra_args=self.extra_args, die_with_parent=self.die_with_parent,
                heartbeat_ms=self.heartbeat_ms, election_timeout_ms=self.election_timeout_ms,
            )
            for (name, data_dir, _, _), (client, peer) in zip(layout, self._ports, strict=True)
        ]  # fmt: skip
        initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
        token = self._members[0].cluster_token if self._members else f"etcd-{self._KIND}-{uuid.uuid4().hex[:12]}"
        for m in members:
            m.initial_cluster, m.cluster_token = initial, token
        return members

    @staticmethod
    def _launch(members: list[EtcdMember], timeout: float, stderr: int | TextIO | None = None) -> float:
        """Launch every member, then block until each is ready; returns the (monotonic) deadline.

        Raises what :meth:`EtcdMember.wait_ready` raises; the members are left as they are.
        """
        for m in members:
            m.launch(stderr)
        deadline = time.monotonic() + timeout
        for m in members:
            m.wait_ready(deadline)
        return deadline

    @staticmethod
    def _abort(members: list[EtcdMember]) -> None:
        """Stop the members of a failed start: SIGTERM, SIGKILL after 2 s; blocks until each exited."""
        for m in members:
            m.terminate(grace=2.0)

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
            deadline = self._launch(members, timeout, stderr)
            setup_auth(members[0].gateway, self.auth)
            for m in members[1:]:  # a member restarts with what it applied: auth on in each
                while not auth_enabled(m.gateway, self.auth, timeout=max(0.1, deadline - time.monotonic())):
                    if time.monotonic() >= deadline:
                        raise m.start_error(f"etcd {m.name} did not apply 'auth enable' before the start-up deadline")
                    time.sleep(0.02)
        finally:
            self._terminate_all(members, graceful=True)
            for m in members:
                m.private_dir = None
            process.remove_temp_dir(private)

    def _log(self, level: int, message: str, members: list[EtcdMember], **facts: Any) -> None:
        """Log the face's ``message`` with the facts of ``members`` (and ``facts``) as its mapping."""
        first = members[0]
        self._logger.log(level, message, {
            "endpoints": ",".join(m.endpoint for m in members), "url": first.client_url,
            "ports": (first.client_port, first.peer_port), "data_dir": first.data_dir, **facts,
        })  # fmt: skip

    # -- stop --------------------------------------------------------------

    def stop(self, *, keep_data: bool = False, graceful: bool = True) -> None:
        """Stop every member and block until all exited (SIGTERM, SIGKILL after ``stop_grace``;
        ``graceful=False``: SIGKILL at once).

        Removes the temporary data dir and logs unless ``keep_data`` (a caller-given ``data_dir``
        is never removed). Idempotent; a later ``start()`` reuses the ports (and kept data).
        """
        with self._lock:
            self._terminate_all(self._members, graceful=graceful)
            if not keep_data and self._work_dir:
                self._logger.info("removing etcd work dir %s", self._work_dir)
                self._drop_work_dir()
                self._members = []
                if not self._given_data_dir:
                    self._auth_done = False

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

    def __enter__(self: _Face) -> _Face:
        self.start()
        return self

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
    _READY_LOG = "etcd %(version)s cluster ready at %(endpoints)s"
    _RETRY_LOG = "etcd cluster ports taken (attempt %(attempt)d/%(attempts)d); retrying on new ports"

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

    def _layout(self) -> list[tuple[str, str, int | None, int | None]]:
        assert self._work_dir is not None
        base = self._given_data_dir or os.path.join(self._work_dir, "data")
        return [(f"member-{i}", os.path.join(base, f"member-{i}"), None, None) for i in range(self.size)]

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

    # -- one member --------------------------------------------------------

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
            try:
                self._launch([m], timeout)
            except BaseException:
                self._abort([m])
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

    def __repr__(self) -> str:
        return f"EtcdCluster({self.endpoint_string or self.size}, pids={self.pids})"
