"""A real multi-member etcd cluster on loopback, for failover tests.

Members are bootstrapped statically (``--initial-cluster``) on free
``127.0.0.1`` ports and share :class:`~etcd_server.server.EtcdServer`'s
process handling: readiness by real v3 requests, exit detection with log
tails, port-collision retries, SIGTERM-then-SIGKILL stop, ``atexit`` cleanup
and ``PR_SET_PDEATHSIG`` (see :mod:`etcd_server.server` for the thread caveat).
Standard library only.
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
from typing import Any

from . import process
from .binary import check_v2_support, etcd_version, find_etcd_binary
from .client import make_client
from .config import AuthConfig, TLSConfig
from .errors import EtcdStartError, EtcdStartTimeoutError
from .gateway import auth_enabled, setup_auth
from .member import EtcdMember

__all__ = ["EtcdCluster"]

logger = logging.getLogger(__name__)


class EtcdCluster:
    """``size`` etcd members on ``127.0.0.1`` forming one cluster.

    Args:
        size: number of members (>= 1).
        binary: etcd binary (see :func:`etcd_server.binary.find_etcd_binary`).
        data_dir: parent directory of the members' data dirs
            (``<data_dir>/member-<i>``); a temporary one, removed by
            ``stop()``, when None. A caller-given directory is kept.
        enable_v2, extra_args, tls, auth, die_with_parent, stop_grace: as for
            :class:`~etcd_server.server.EtcdServer` (``extra_args`` go to
            every member; auth is set up once through member 0, before any
            member's client port opens: see :meth:`_set_up_auth_privately`).
        heartbeat_ms, election_timeout_ms: raft timing; None (default) keeps
            etcd's 100 / 1000 ms, which tolerate a loaded machine.

    Raises:
        EtcdBinaryNotFoundError: (at construction) no etcd binary found.
        ValueError: ``size`` < 1, or ``enable_v2=True`` with etcd 3.6+ (no v2 API).
    """

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

    # -- accessors ---------------------------------------------------------

    @property
    def version(self) -> str:
        """etcd version of the binary, e.g. ``"3.5.1"``."""
        return etcd_version(self.binary)

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
        """Start all members and block until every one serves v3 requests.

        Members are launched together, then each is polled (status with a
        known leader, then a linearizable range). If a port was taken between
        probing and binding, all members are stopped, their fresh data wiped,
        and the start retried on new ports (``num_retries`` attempts in all).

        Raises:
            RuntimeError: already started.
            EtcdStartError: a member exited during start-up (its exit code
                and log tail); all members are stopped.
            EtcdStartTimeoutError: not ready within ``timeout``.
        """
        with self._lock:
            if any(m.running() for m in self._members):
                raise RuntimeError("etcd cluster already running; call stop() first")
            if self._work_dir is None:
                self._work_dir = process.make_temp_dir("etcd-cluster-")
            first = not self._members
            attempts = max(1, num_retries)
            for attempt in range(1, attempts + 1):
                if first:
                    self._members = self._new_members()
                for m in self._members:  # the log dir is new after a stop()
                    m.work_dir = self._work_dir
                fresh = [not os.path.isdir(os.path.join(m.data_dir, "member")) for m in self._members]
                try:
                    if self.auth is not None and not self._auth_done:
                        self._set_up_auth_privately(timeout)
                    for m in self._members:
                        m.launch()
                    deadline = time.monotonic() + timeout
                    for m in self._members:
                        m.wait_ready(deadline)
                except EtcdStartError as e:
                    self._terminate_all(graceful=False)
                    if first and e.address_in_use and attempt < attempts:
                        logger.warning(
                            "etcd cluster ports taken (attempt %d/%d); retrying on new ports",
                            attempt,
                            attempts,
                        )
                        for m, was_fresh in zip(self._members, fresh, strict=True):
                            if was_fresh:
                                shutil.rmtree(m.data_dir, ignore_errors=True)
                        continue
                    self._fail_cleanup(first)
                    raise
                except BaseException:
                    self._terminate_all(graceful=False)
                    self._fail_cleanup(first)
                    raise
                break
            logger.info("etcd %s cluster ready at %s", self.version, self.endpoint_string)
            if self.auth is not None:
                self._auth_done = True

    def _set_up_auth_privately(self, timeout: float) -> None:
        """Start every member listening for clients only on a unix socket in a private
        directory, set up auth through member 0 (:func:`~etcd_server.gateway.setup_auth`),
        wait until every member has applied ``auth enable``, and stop them all: the real
        client ports open later, on data dirs whose auth is on. Blocks for one start and
        one stop of the cluster.
        """
        assert self.auth is not None
        private = process.make_private_dir(self._work_dir)
        try:
            for m in self._members:
                m.private_dir = private
                m.launch()
            deadline = time.monotonic() + timeout
            for m in self._members:
                m.wait_ready(deadline)
            setup_auth(self._members[0].gateway, self.auth)
            for m in self._members[1:]:  # a member restarts with what it applied: auth on in each
                while not auth_enabled(m.gateway, self.auth, timeout=max(0.1, deadline - time.monotonic())):
                    if time.monotonic() >= deadline:
                        raise EtcdStartTimeoutError(
                            f"etcd {m.name} did not apply 'auth enable' before the start-up deadline",
                            returncode=None, log_tail=m.log_tail(), cmd=m.cmd,
                        )  # fmt: skip
                    time.sleep(0.02)
        finally:
            self._terminate_all(graceful=True)
            for m in self._members:
                m.private_dir = None
            process.remove_temp_dir(private)

    def _new_members(self) -> list[EtcdMember]:
        assert self._work_dir is not None
        base = self._given_data_dir or os.path.join(self._work_dir, "data")
        ports = process.free_ports(2 * self.size)
        token = "etcd-cluster-" + uuid.uuid4().hex[:12]
        members = [
            EtcdMember(
                binary=self.binary,
                name=f"member-{i}",
                data_dir=os.path.join(base, f"member-{i}"),
                work_dir=self._work_dir,
                client_port=ports[2 * i],
                peer_port=ports[2 * i + 1],
                tls=self.tls,
                enable_v2=self.enable_v2,
                extra_args=self.extra_args,
                die_with_parent=self.die_with_parent,
                heartbeat_ms=self.heartbeat_ms,
                election_timeout_ms=self.election_timeout_ms,
            )
            for i in range(self.size)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
        for m in members:
            m.initial_cluster = initial
            m.cluster_token = token
        return members

    def _terminate_all(self, *, graceful: bool) -> None:
        """Stop all members, one at a time, followers first.

        A leader that gets SIGTERM tries to hand leadership to a follower it
        believes alive; when the followers are gone (or going) it waits etcd's
        ~7 s transfer timeout. So members are stopped sequentially, the leader
        last, and the last member gets a short grace before SIGKILL (safe:
        etcd has fsynced everything it acknowledged).
        """
        live = [i for i, m in enumerate(self._members) if m.running()]
        if graceful and len(live) > 1:
            leader = self._leader_once()
            if leader in live:
                live.remove(leader)
                live.append(leader)
        for n, i in enumerate(live):
            last = n == len(live) - 1 and len(live) > 1
            grace = min(self.stop_grace, 1.0) if last else self.stop_grace
            self._members[i].terminate(grace=grace, graceful=graceful, quiet=last)
        for m in self._members:  # reap/unregister any that died on their own
            m.terminate(grace=self.stop_grace, graceful=graceful)

    def _fail_cleanup(self, first: bool) -> None:
        if first:
            self._members = []
            if self._work_dir:
                process.remove_temp_dir(self._work_dir)
                self._work_dir = None

    def stop(self, *, keep_data: bool = False, graceful: bool = True) -> None:
        """Stop every member (SIGTERM, SIGKILL after ``stop_grace``; blocks).

        Removes the temporary data unless ``keep_data``. Idempotent; a later
        ``start()`` reuses the ports (and data, when kept or caller-given).
        """
        with self._lock:
            self._terminate_all(graceful=graceful)
            if not keep_data and self._work_dir:
                process.remove_temp_dir(self._work_dir)
                self._work_dir = None
                if not self._given_data_dir:
                    self._members = []
                    self._auth_done = False

    def stop_member(self, i: int, *, graceful: bool = False) -> None:
        """Stop member ``i`` (SIGKILL by default: a crash; SIGTERM if ``graceful``).

        Blocks until it has exited. Its data dir and ports are kept for
        :meth:`start_member`.
        """
        with self._lock:
            self._members[i].terminate(grace=self.stop_grace, graceful=graceful)

    def start_member(self, i: int, timeout: float = 60) -> None:
        """Start member ``i`` again with its ports and data dir; block until ready.

        Needs a quorum of live members to become ready.

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
        """Index of the current leader, asking live members' ``/metrics``.

        A member is the leader when its ``etcd_server_is_leader`` gauge is 1
        (served by etcd 3.4 to 3.7 without auth, also when the JSON gateway
        would need a token or refuse the client certificate). Polls (blocking)
        until one is found.

        Raises:
            TimeoutError: no leader within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = self._leader_once()
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no etcd leader among {self.endpoint_string} within {timeout}s")
            time.sleep(0.05)

    def _leader_once(self) -> int | None:
        """One round of :meth:`leader`: the live member that says it leads, or None."""
        for i, m in enumerate(self._members):
            if not m.running():
                continue
            try:
                if m.gateway.is_leader(timeout=1.0):
                    return i
            except (OSError, http.client.HTTPException):
                continue
        return None

    def get_client(self, **overrides: Any) -> Any:
        """An ``etcd_store.client.EtcdClient`` over all members' endpoints.

        TLS files and root credentials (with auth) are filled in; ``overrides``
        replace them. Imports etcd_store only when called (in
        :func:`etcd_server.client.make_client`).
        """
        return make_client(self.client_urls, self.tls, self.auth, overrides)

    def __enter__(self) -> EtcdCluster:
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
        return f"EtcdCluster({self.endpoint_string or self.size}, pids={self.pids})"

