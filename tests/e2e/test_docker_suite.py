"""testcontainers suite: torchrun jobs against etcd running in Docker.

etcd runs from a local image per matrix version (tests/helpers/docker_etcd.py: ``docker
import`` of that version's etcd binary, e.g. the 3.7 one that .ci/build-etcd
builds), with host networking on 127.0.0.1. Two tests, one backend each (the
non-Docker scenarios cover both backends on every version)::

    a complete job whose etcd container restarts mid-training (scenario 4)  etcd-v2  every version
    5 3-container cluster, leader killed during a rendezvous                etcd-v3  3.5, 3.7

Skips only when no Docker daemon answers and .ci/start-docker cannot start one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Any

import pytest
from helpers.docker_etcd import (
    DockerUnavailable,
    EtcdContainer,
    build_image,
    ensure_docker,
    free_ports,
    leader_index,
    make_cluster,
    stop_docker,
    wait_ready,
)
from helpers.elastic import Job, group_with, job_factory, record_timing, steps_of
from helpers.matrix import ETCD_BINARIES, SELECTED, version_param

from etcd_server.binary import etcd_version

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(300)]

KEY_PREFIX = "/torch/elastic/rendezvous"


def _require(backend: str) -> None:
    if backend not in {ep.name for ep in entry_points(group="torchrun.handlers")}:
        pytest.skip(f"rendezvous backend {backend!r} is not installed (no torchrun.handlers entry point)")


@pytest.fixture(scope="module")
def docker_daemon() -> Iterator[None]:
    """A Docker daemon for the module; started (and stopped after) if none answers."""
    try:
        started = ensure_docker()
    except DockerUnavailable as e:
        pytest.skip(f"Docker cannot be started, skipping the testcontainers suite: {e}")
    try:
        yield
    finally:
        if started:
            stop_docker()


@pytest.fixture(scope="module", params=[version_param(v) for v in SELECTED])
def etcd_image(request: pytest.FixtureRequest, docker_daemon: None) -> str:
    """The local etcd image of the matrix version (built on first use from that version's binary)."""
    binary = ETCD_BINARIES[request.param]
    return build_image(binary, etcd_version(binary))


@pytest.fixture
def containers() -> Iterator[list[EtcdContainer]]:
    """Containers registered here are removed at teardown (also on failure)."""
    made: list[EtcdContainer] = []
    try:
        yield made
    finally:
        for c in made:
            c.remove()


@pytest.fixture
def jobs(tmp_path: Any) -> Iterator[Callable[..., Job]]:
    with job_factory(tmp_path) as make:
        yield make


def _single(image: str, containers: list[EtcdContainer]) -> EtcdContainer:
    client_port, peer_port = free_ports(2)
    c = EtcdContainer(image, "solo", client_port, peer_port)
    containers.append(c)
    c.start()
    try:
        wait_ready([c.endpoint])
    except TimeoutError as e:
        raise AssertionError(f"{e}\n{c.logs()}") from e
    return c


@pytest.mark.etcd_matrix("3.6")  # torchrun jobs: 3.7 and 3.6 (3.4/3.5: contract tests)
@pytest.mark.full_matrix("3.6")  # the gate restarts a 3.7 container
def test_complete_job_survives_etcd_container_restart(
    etcd_image: str, containers: list[EtcdContainer], jobs: Callable[..., Job]
) -> None:
    """A complete torchrun job (2 nodes x 1 worker, from the first rendezvous to
    the last step) against etcd in a container, which is stopped and started
    again (same container, same data dir) mid-training: scenario 4 in Docker."""
    backend = "etcd-v2"
    _require(backend)
    etcd = _single(etcd_image, containers)
    # etcd 3.6+ waits up to 5.2 s for open streams when stopped (docs/operations.md, "etcd versions"): the
    # agents' etcd calls get a deadline above the whole outage.
    job = jobs(backend=backend, endpoint=etcd.endpoint, nnodes="2", conf={"read_timeout": 15})
    started = time.time()
    for i in range(2):
        job.start(f"node{i}")
    job.wait_for("training under way", lambda rs: group_with(rs, world_size=2, min_steps_done=2), 180)
    down_at = time.time()
    etcd.restart(down_for=2.0)
    wait_ready([etcd.endpoint])
    up_at = time.time()
    job.wait_for("a step after etcd came back", lambda rs: [r for r in steps_of(rs) if r.t > up_at], 120)
    target = job.finish()
    codes = job.wait_exit(timeout=150)
    records = job.records()
    assert codes == {"node0": 0, "node1": 0}, job.diagnostics() + "\n" + etcd.logs()
    assert any(r.kind == "done" for r in records)
    rank0 = [r.step for r in steps_of(records) if r.rank == 0]
    assert set(rank0) == set(range(1, target + 1)), job.diagnostics()  # every step trained
    record_timing(
        f"docker_job_etcd_restart/{backend}/{etcd_image}",
        {
            "start_to_first_step_s": round(min(r.t for r in steps_of(records)) - started, 2),
            "etcd_down_s": round(up_at - down_at, 2),
        },
    )


def test_rendezvous_completes_when_leader_container_dies(
    etcd_image: str, containers: list[EtcdContainer], jobs: Callable[..., Job]
) -> None:
    """Scenario 5 in Docker: a 3-container cluster loses its leader during a rendezvous."""
    backend = "etcd-v3"
    _require(backend)
    members = make_cluster(etcd_image, 3)
    containers.extend(members)
    endpoints = [m.endpoint for m in members]
    wait_ready(endpoints)
    job = jobs(backend=backend, endpoint=",".join(endpoints), nnodes="2", steps=6)
    job.start("node0")

    from etcd_store.client import EtcdClient

    prefix = f"{KEY_PREFIX}/{job.run_id}".encode()
    deadline = time.monotonic() + 120
    with EtcdClient(endpoints, timeout=5) as client:
        while not client.range(prefix, prefix=True, keys_only=True).kvs:  # node0 is in the rendezvous
            assert job.nodes["node0"].running() and time.monotonic() < deadline, job.diagnostics()
            time.sleep(0.2)
    leader = leader_index(members)
    killed_at = time.time()
    members[leader].kill()
    job.start("node1")
    codes = job.wait_exit(timeout=180)
    records = job.records()
    assert codes == {"node0": 0, "node1": 0}, job.diagnostics()
    assert any(r.kind == "done" for r in records)
    record_timing(
        f"docker_leader_killed/{backend}/{etcd_image}",
        {"leader_kill_to_first_step_s": round(min(r.t for r in steps_of(records)) - killed_at, 2)},
    )
