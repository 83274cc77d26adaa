"""A multi-host test bed made of Linux network namespaces, and the faults to inject into it.

:class:`NetBed` makes a hub namespace holding a bridge, and one namespace per host, each with
its own address on that bridge (``10.213.N.x/24``; ``N`` is unique per bed, these addresses
exist only inside the bed). The test process itself reaches the hosts over one veth pair from
its own namespace to the bridge (``10.213.N.254``): that pair is the only thing the bed adds
outside its namespaces, and it disappears with the hub namespace.

Faults (all reversible by :meth:`Host.heal`): :meth:`Host.block` drops packets to and from
given addresses (iptables inside the host's namespace), :meth:`Host.link_down` takes the
host's interface down, :meth:`Host.netem` adds latency and loss (``tc netem``; raises
:class:`NetemUnavailable` where the kernel lacks it). Where netem is missing,
:meth:`Host.random_loss` drops a share of the packets (iptables ``statistic``) and
:meth:`Host.start_delay_proxy` runs :mod:`tests.helpers.delay_proxy` in the host's
namespace: a TCP forwarder adding a latency to each direction of one port.

Etcd members run on hosts (:class:`NetEtcd`: ``ip netns exec HOST etcd ...`` with the flags
of :class:`etcd_server.member.EtcdMember`), and so do torchrun agents (:meth:`Host.argv`).

Every name starts with ``rdzvt-<pid>-``; :func:`remove_leftovers` deletes the namespaces of
beds whose process is gone (a crashed run), killing what still runs inside them.
:func:`netns_unavailable` says why namespaces cannot be made here (or None).

Blocking: every method runs ``ip``/``iptables``/``tc`` commands (milliseconds);
:meth:`NetEtcd.start` waits until every member is ready. No torch import.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence

from etcd_server.binary import find_etcd_binary
from etcd_server.member import EtcdMember

PREFIX = "rdzvt-"
CLIENT_PORT = 2379
PEER_PORT = 2380


class NetemUnavailable(RuntimeError):
    """The kernel has no ``netem`` queueing discipline (``sch_netem``)."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be created here, or None when they can."""
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is missing (apt-get install iproute2 iptables)"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    probe = f"{PREFIX}{os.getpid()}-probe-{uuid.uuid4().hex[:4]}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    try:
        veth = _run("ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb", check=False)
        if veth.returncode != 0:
            return f"cannot create veth pairs: {veth.stderr.strip()}"
        ipt = _run("ip", "netns", "exec", probe, "iptables", "-S", check=False)
        if ipt.returncode != 0:
            return f"iptables does not work in a namespace: {ipt.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(name: str) -> None:
    """Kill what runs in namespace ``name`` (our own processes, by pid), then delete it."""
    pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
        if pids:
            time.sleep(0.05)  # waiting for the kernel to reap killed processes
    _run("ip", "netns", "del", name, check=False)


def remove_leftovers() -> list[str]:
    """Delete the namespaces of beds whose process is gone; the names deleted."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            _delete_namespace(name)
            removed.append(name)
    return removed


class Host:
    """One host: a namespace with interface ``eth0`` at :attr:`address`."""

    def __init__(self, bed: NetBed, name: str, address: str) -> None:
        self.bed = bed
        self.name = name
        self.ns = f"{bed.prefix}{name}"
        self.address = address
        self._proxies: list[subprocess.Popen[str]] = []

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address})"

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *cmd]

    def exec(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run(*self.argv(cmd), check=check)

    def block(self, *peers: Host | str) -> None:
        """Drop every packet between this host and ``peers`` (both directions)."""
        for peer in peers:
            addr = peer.address if isinstance(peer, Host) else peer
            self.exec("iptables", "-w", "-A", "INPUT", "-s", addr, "-j", "DROP")
            self.exec("iptables", "-w", "-A", "OUTPUT", "-d", addr, "-j", "DROP")

    def link_down(self) -> None:
        self.exec("ip", "link", "set", "eth0", "down")

    def netem(self, delay_ms: int, loss_percent: float = 0.0) -> None:
        """Delay (and drop a share of) every packet this host sends."""
        args = ["tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", f"{delay_ms}ms"]
        if loss_percent:
            args += ["loss", f"{loss_percent}%"]
        proc = self.exec(*args, check=False)
        if proc.returncode != 0:
            if "unknown" in proc.stderr.lower() or "not found" in proc.stderr.lower():
                raise NetemUnavailable(f"tc netem is not available here: {proc.stderr.strip()}")
            raise RuntimeError(f"tc netem failed: {proc.stderr.strip()}")

    def random_loss(self, percent: float, *peers: Host | str) -> None:
        """Drop ``percent`` % of the packets between this host and ``peers``, each direction
        (iptables ``statistic --mode random``: a netem-free packet loss)."""
        share = f"{percent / 100:.4f}"
        for peer in peers:
            addr = peer.address if isinstance(peer, Host) else peer
            for chain, side in (("INPUT", "-s"), ("OUTPUT", "-d")):
                self.exec("iptables", "-w", "-A", chain, side, addr, "-m", "statistic", "--mode", "random",
                          "--probability", share, "-j", "DROP")  # fmt: skip

    def start_delay_proxy(self, listen_port: int, target_port: int, delay_ms: int, timeout: float = 10.0) -> str:
        """Forward ``listen_port`` of this host to ``target_port`` with ``delay_ms`` added to
        each direction (:mod:`tests.helpers.delay_proxy`); the address to connect to.

        Blocks until the forwarder listens; it runs until :meth:`heal` or the bed's close."""
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delay_proxy.py")
        proc = subprocess.Popen(
            self.argv([sys.executable, script, f"{self.address}:{listen_port}",
                       f"{self.address}:{target_port}", str(delay_ms)]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self._proxies.append(proc)
        assert proc.stdout is not None
        # The first line says it listens (or why it could not); bounded by ``timeout``.
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("listening"):
            self._stop_proxies()
            raise RuntimeError(f"the delay proxy on {self.name} did not start within {timeout:g} s: {line!r}")
        return f"{self.address}:{listen_port}"

    def _stop_proxies(self) -> None:
        for proc in self._proxies:
            proc.kill()
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
        self._proxies.clear()

    def heal(self) -> None:
        """Undo every fault: flush the filters, remove netem, stop delay proxies, bring the link up."""
        self._stop_proxies()
        self.exec("iptables", "-w", "-F", "INPUT")
        self.exec("iptables", "-w", "-F", "OUTPUT")
        self.exec("tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        self.exec("ip", "link", "set", "eth0", "up")


class NetBed:
    """A bridge in a hub namespace, hosts on it, and a link from the test's namespace.

    Use as a context manager, or call :meth:`close` (idempotent), also after a failure.
    """

    def __init__(self) -> None:
        self.prefix = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:4]}-"
        self.hub = f"{self.prefix}hub"
        self.subnet = self._free_subnet()
        self.control_address = f"10.213.{self.subnet}.254"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._control = f"rdzvt{os.getpid() % 100000}{uuid.uuid4().hex[:3]}"
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _free_subnet() -> int:
        used = _run("ip", "-4", "addr", "show", check=False).stdout
        for n in [os.getpid() % 250 + 1, *range(1, 251)]:
            if f"10.213.{n}." not in used:
                return n
        raise RuntimeError("no free 10.213.N.0/24 subnet for the test bed")

    def _setup(self) -> None:
        _run("ip", "netns", "add", self.hub)
        self._namespaces.append(self.hub)
        _run("ip", "-n", self.hub, "link", "set", "lo", "up")
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        # The test's own link to the bridge (removed with the hub namespace).
        _run("ip", "link", "add", self._control, "type", "veth", "peer", "name", "ctl", "netns", self.hub)
        _run("ip", "-n", self.hub, "link", "set", "ctl", "master", "br0", "up")
        _run("ip", "addr", "add", f"{self.control_address}/24", "dev", self._control)
        _run("ip", "link", "set", self._control, "up")

    def add_host(self, name: str) -> Host:
        """A new host ``name`` with the next address on the bridge."""
        index = len(self.hosts) + 1
        host = Host(self, name, f"10.213.{self.subnet}.{index}")
        _run("ip", "netns", "add", host.ns)
        self._namespaces.append(host.ns)
        _run("ip", "-n", host.ns, "link", "set", "lo", "up")
        port = f"p{index}"
        _run("ip", "-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        _run("ip", "-n", self.hub, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", host.ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _run("ip", "-n", host.ns, "link", "set", "eth0", "up")
        self.hosts[name] = host
        return host

    def close(self) -> None:
        for host in self.hosts.values():
            host._stop_proxies()
        for ns in reversed(self._namespaces):
            _delete_namespace(ns)
        self._namespaces.clear()
        _run("ip", "link", "del", self._control, check=False)

    def __enter__(self) -> NetBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- etcd on hosts


class _HostMember(EtcdMember):
    """An :class:`EtcdMember` listening on a host's address, run in the host's namespace."""

    def __init__(self, host: Host, **kwargs: object) -> None:
        self.host = host
        super().__init__(**kwargs)  # type: ignore[arg-type]

    @property
    def endpoint(self) -> str:
        return f"{self.host.address}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"http://{self.host.address}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host.address}:{self.peer_port}"

    def command(self) -> list[str]:
        return self.host.argv(super().command())


class NetEtcd:
    """An etcd cluster with one member per host (plain text, no auth).

    ``heartbeat_ms``/``election_timeout_ms`` default to 50/500 ms: a lost leader is replaced
    within about a second.
    """

    def __init__(
        self,
        hosts: Sequence[Host],
        *,
        binary: str | None = None,
        heartbeat_ms: int = 50,
        election_timeout_ms: int = 500,
    ) -> None:
        self.binary = find_etcd_binary(binary)
        self.work_dir = tempfile.mkdtemp(prefix="netetcd-")
        token = "netetcd-" + uuid.uuid4().hex[:8]
        self.members = [
            _HostMember(
                host,
                binary=self.binary,
                name=host.name,
                data_dir=os.path.join(self.work_dir, host.name),
                work_dir=self.work_dir,
                client_port=CLIENT_PORT,
                peer_port=PEER_PORT,
                tls=None,
                enable_v2=False,
                extra_args=(),
                die_with_parent=True,
                heartbeat_ms=heartbeat_ms,
                election_timeout_ms=election_timeout_ms,
            )
            for host in hosts
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial
            m.cluster_token = token

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout: float = 60) -> None:
        for m in self.members:
            m.launch()
        deadline = time.monotonic() + timeout
        for m in self.members:
            m.wait_ready(deadline)

    def leader(self, timeout: float = 10.0) -> int:
        """Index of the member that leads (asked over gRPC from the test's namespace)."""
        from etcd_store.client import EtcdClient

        deadline = time.monotonic() + timeout
        with EtcdClient(self.endpoints, timeout=2) as client:
            while True:
                for i in range(len(self.members)):
                    with contextlib.suppress(Exception):
                        status = client.status(i, timeout=1)
                        if status.leader and status.leader == status.member_id:
                            return i
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no etcd leader among {self.endpoints} within {timeout:g} s")
                time.sleep(0.1)  # polling the members' status

    def stop(self) -> None:
        for m in self.members:
            m.terminate(graceful=False, quiet=True)
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> NetEtcd:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
