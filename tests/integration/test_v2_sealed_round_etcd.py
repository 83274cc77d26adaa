"""Cases A, B and C of issue 22 through our etcd backend and a real etcd, torch's handler beside ours.

The timelines of ``tests/unit/test_v2_sealed_round.py`` (``tests/helpers/sealed_cases.py``),
each node with its own ``EtcdRendezvousBackend`` (one shared client) on a key of its
own run: the state is read and written by etcd's compare-and-set on the key's mod
revision, not by the in-memory cell. Clock and join polls are the test's, as there.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pytest
from helpers import sealed_cases as cases
from helpers.sealed_rounds import OURS, TORCH, Clock, install
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from etcd_rdzv import EtcdRendezvousBackend
from etcd_store.client import EtcdClient

_ids = itertools.count()


@pytest.fixture(scope="module")
def client(etcd_endpoint: str) -> Iterator[EtcdClient]:
    c = EtcdClient(etcd_endpoint, timeout=5)
    yield c
    c.close()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return install(monkeypatch)


@pytest.fixture
def etcd_run(client: EtcdClient) -> Callable[[], Callable[[], RendezvousBackend]]:
    """Backend factory of a new run on etcd (a new state key per call)."""

    def new_run() -> Callable[[], RendezvousBackend]:
        run_id = f"sealed-{next(_ids)}"
        return lambda: EtcdRendezvousBackend(client, run_id, key_prefix="/test/sealed")

    return new_run


def test_case_a_on_etcd(clock: Clock, etcd_run: cases.Backends) -> None:
    torch = cases.case_a(TORCH, clock, etcd_run)
    ours = cases.case_a(OURS, clock, etcd_run)
    assert torch.worlds == {"n0": (0, 2), "n1": (1, 3), "n2": (2, 3)}
    assert torch.stored == ["n0", "n1"]
    assert torch.waiting == {"n0": 0, "n1": 0, "n2": 0}
    assert ours.worlds == {"n0": (0, 3), "n1": (1, 3), "n2": (2, 3)}
    assert ours.stored == ["n0", "n1", "n2"]
    assert cases.problems(ours) == []


def test_case_b_on_etcd(clock: Clock, etcd_run: cases.Backends) -> None:
    torch = cases.case_b(TORCH, clock, etcd_run)
    ours = cases.case_b(OURS, clock, etcd_run)
    assert torch.rounds == {"n0": 1, "n1": 0, "n2": 0}
    assert (torch.stored_round, torch.stored) == (1, ["n0"])
    assert torch.waiting == {"n1": 0, "n2": 0}
    assert ours.worlds == {"n0": (0, 3), "n1": (1, 3), "n2": (2, 3)}
    assert (ours.stored_round, ours.stored) == (0, ["n0", "n1", "n2"])
    assert cases.problems(ours) == []


def test_case_c_on_etcd(clock: Clock, etcd_run: cases.Backends) -> None:
    torch = cases.case_c(TORCH, clock, etcd_run)
    ours = cases.case_c(OURS, clock, etcd_run)
    assert (torch.dead, torch.after) == ({"n0": 0, "n1": 0}, None)
    assert (ours.within_grace, ours.dead) == ({"n0": 0, "n1": 0}, {"n0": 1, "n1": 1})
    assert ours.after is not None
    assert ours.after.worlds == {"n0": (0, 2), "n1": (1, 2)}
    assert (ours.after.stored_round, ours.after.stored) == (1, ["n0", "n1"])


def test_case_c_replacement_on_etcd(clock: Clock, etcd_run: cases.Backends) -> None:
    for kind in (TORCH, OURS):
        outcome = cases.case_c_replacement(kind, clock, etcd_run)
        assert outcome.worlds == {"n0": (0, 3), "n1": (1, 3), "r": (2, 3)}, kind.__name__
        assert (outcome.stored_round, outcome.stored) == (1, ["n0", "n1", "r"]), kind.__name__


def test_the_first_exit_ends_a_sealed_round_on_etcd(clock: Clock, etcd_run: cases.Backends) -> None:
    ours = cases.case_first_exit(OURS, clock, etcd_run)
    assert (ours.round_after_exit, ours.waiting) == (1, {"n1": 1})
    assert ours.formed_at < 10
    assert ours.after.worlds == {"n0": (0, 2), "n1": (1, 2)}
    spare = cases.case_hot_spare(OURS, clock, etcd_run)
    assert spare.round_after_exit == 1
    assert spare.after.worlds == {"n0": (0, 2), "r": (1, 2)}
    late = cases.case_exit_before_a_member_read(OURS, clock, etcd_run)
    assert late.worlds == {"n0": (0, 3), "n1": (1, 3), "n2": (2, 3)}
    assert cases.problems(late) == []
