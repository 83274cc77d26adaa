"""The seeded, randomized interleaving checker of the ``etcd-v3`` protocol (tests/helpers/v3_checker.py;
issue 20): in-process nodes against a real etcd, a single member and a 3-member cluster, under random
joins, leaves, kills, lease losses, closes, aborts, etcd outages, member faults and compactions; every
invariant checked after every step (tests/helpers/v3_model.py).

CI mode (default): a few seeds of a few hundred short steps. Long mode by hand::

    ETCD_RDZV_CHECK_SEED=1-20 ETCD_RDZV_CHECK_STEPS=500 ETCD_RDZV_TEST_ETCD=3.7 \\
        python -m pytest -q -n 0 -s tests/integration/test_v3_interleavings.py

``ETCD_RDZV_CHECK_SEED`` is one seed, a comma list or a range ``a-b``; a failure prints its seed, the step
and the history of the failing round, and the line to replay it.
"""

from __future__ import annotations

import os
import time

import pytest
from helpers.etcd_versions import FULL
from helpers.v3_checker import CheckConf, Checker, CheckFailed
from helpers.v3_world import Etcd

from etcd_server import EtcdCluster, EtcdServer

SEED_VAR, STEPS_VAR = "ETCD_RDZV_CHECK_SEED", "ETCD_RDZV_CHECK_STEPS"
CI_SINGLE = ((3, 60), (12, 60))  # (seed, steps) per run in CI mode
CI_CLUSTER = ((21, 50),)


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def plan(ci: tuple[tuple[int, int], ...], version: str = FULL[0]) -> list[tuple[int, int]]:
    """(seed, steps) of each run: from the environment (long mode, replay), else the CI set (half the
    steps on the subset versions of the matrix, which run it too: CI time)."""
    if os.environ.get(SEED_VAR):
        steps = int(os.environ.get(STEPS_VAR, "300"))
        return [(seed, steps) for seed in _seeds(os.environ[SEED_VAR])]
    if os.environ.get(STEPS_VAR):
        return [(seed, int(os.environ[STEPS_VAR])) for seed, _ in ci]
    full = any(version.startswith(f"{v}.") for v in FULL)
    return [(seed, steps if full else steps // 2) for seed, steps in ci]


def _timeout(ci: tuple[tuple[int, int], ...]) -> int:
    return 240 + int(sum(steps for _, steps in plan(ci)) * 1.5)


def check_all(etcd: Etcd, ci: tuple[tuple[int, int], ...]) -> None:
    """Every planned seed, each to its end or its first violation; fails with every failing seed."""
    failed: list[str] = []
    version = etcd.target.version
    for seed, steps in plan(ci, version):
        began = time.monotonic()
        checker = Checker(etcd, CheckConf(seed=seed, steps=steps))
        try:
            stats = checker.run()
        except Exception as e:  # a violation (CheckFailed), or the harness itself broke
            what = str(e) if isinstance(e, CheckFailed) else f"harness error at seed {seed}: {e!r}"
            failed.append(what)
            print(f"\n[v3-checker] FAILED seed={seed} at step {checker.step_no}:\n{what}")
            continue
        print(f"\n[v3-checker] {'cluster' if etcd.cluster else 'single'} seed={seed} steps={steps} "
              f"({checker.conf.describe()}) "
              f"episodes={checker.episode} rounds={checker.rounds} wall={time.monotonic() - began:.1f}s "
              f"{dict(sorted(stats.items()))}")
    assert not failed, "\n\n".join(failed)


@pytest.mark.etcd_matrix
@pytest.mark.timeout(_timeout(CI_SINGLE))
def test_interleavings_single_member(fresh_etcd: EtcdServer) -> None:
    """Random interleavings against one etcd member (outages: the member frozen; restarts)."""
    check_all(Etcd(fresh_etcd), CI_SINGLE)


@pytest.mark.etcd_matrix
@pytest.mark.timeout(_timeout(CI_CLUSTER))
def test_interleavings_three_member_cluster(etcd_binary: str) -> None:
    """Random interleavings against a 3-member cluster (also member kills, SIGSTOPs and restarts)."""
    with EtcdCluster(3, binary=etcd_binary) as cluster:
        check_all(Etcd(cluster), CI_CLUSTER)


@pytest.mark.etcd_matrix
@pytest.mark.timeout(60)
def test_a_wait_that_timed_out_late_does_not_depend_on_its_watch(etcd_server: EtcdServer) -> None:
    """Found by the checker (seed 431, a cluster with a SIGSTOPped member): node a waits in round 1 with a
    watch that delivers nothing (as on a frozen member, tests/integration/test_client_frozen_member.py);
    b seals round 1 with a; a's join_timeout then passes and its withdrawal is refused (sealed). a still
    ends, with its rank read from the members record, within join_timeout + read_timeout (+ 1 s); it
    used to wait for the sealed event without a deadline. a is deaf from outside: its client is a
    WatchTap whose watches keep their errors but hand on no event."""
    from helpers.nodes import ETCD_V3, nodes_of

    conf = {"join_timeout": "3", "last_call_timeout": "0.2", "close_timeout": "5", "heartbeat": "5",
            "read_timeout": "4"}
    with nodes_of(etcd_server.get_endpoint(), ETCD_V3, conf=conf, name="v3late") as nodes:
        a, tap = nodes.tapped(2, 2, keep=lambda ev: False)  # its own client, as the creator makes it
        b = nodes.new(2, 2)
        (fa,) = nodes.start(a)
        deadline = time.monotonic() + 10
        while nodes.client.get(nodes.keys.join_key(1, a.node_id)) is None:  # a joined round 1
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (fb,) = nodes.start(b)
        rb = fb.result(timeout=30)  # b fills round 1 and seals it
        assert (rb.round, rb.world_size) == (1, 2)
        ra = fa.result(timeout=3 + 4 + 1)  # a's join_timeout + read_timeout + a margin
        assert (ra.round, ra.rank) == (1, 1 - rb.rank)
        # a's watch did deliver the seal; a did not hear it (dropped by the tap), so it read its place.
        assert [ev.kv.key for ev in tap.events()] == [nodes.keys.sealed]
