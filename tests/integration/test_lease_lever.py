"""Leases as a cross-job lever (security issue 32, item 2): another etcd user attaches a key of its
own to one of our leases, after which etcd refuses every write of ours with that lease
(``PERMISSION_DENIED``: a put may attach a lease only if its user may write every key already on it,
etcd's ``checkLeasePuts``). Any user can find our lease ids (``LeaseLeases`` lists them all), so
random ids alone do not stop it.

Against a real etcd with auth on and two runs' users (``job1``, the victim; ``job2``, the other
job), made by ``etcd-rdzv grant``'s own permissions:

* an etcd-v2 backend's lease is anchored by a key of its run at once, so job2 cannot attach to it,
  even the lease of an agent whose state write another agent overwrote (before: the lease held
  no key, job2's put succeeded and the agent's next state write was refused);
* a lease refused all the same (a key attached between the grant and our first write) is taken as
  lost: the etcd-v2 backend's state write, an etcd-v3 join, an ``EtcdStore`` write go on with a new
  lease (:func:`~etcd_store.client.renewing_lease`), and a key the user may really not write is
  still refused after one new lease.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest

from etcd_rdzv.cli.grants import run_permissions
from etcd_rdzv.dynamic.backend import EtcdRendezvousBackend
from etcd_server import AuthConfig, EtcdServer
from etcd_store import EtcdStore
from etcd_store.client import EtcdClient, renewing_lease
from etcd_store.client.auth_admin import role_add, role_grant, user_add, user_grant_role
from etcd_store.errors import EtcdPermissionDenied

pytestmark = [pytest.mark.etcd_matrix("3.6"), pytest.mark.timeout(120)]

ROOT_PW = "r00t-lever-pw"
PREFIX = "/torch/elastic/rendezvous"


class Users:
    """Clients of one etcd with auth on: root, job1's user and job2's user."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.clients: list[EtcdClient] = []
        root = self.client("root", ROOT_PW)
        for run in ("job1", "job2"):
            role_add(root, f"rdzv-{run}")
            for perm in run_permissions(PREFIX, run):
                role_grant(root, f"rdzv-{run}", perm)
            user_add(root, f"rdzv-{run}", f"{run}-pw")
            user_grant_role(root, f"rdzv-{run}", f"rdzv-{run}")
        self.job1 = self.client("rdzv-job1", "job1-pw")
        self.job2 = self.client("rdzv-job2", "job2-pw")

    def client(self, user: str, password: str) -> EtcdClient:
        c = EtcdClient(self.endpoint, user=user, password=password, timeout=10, allow_insecure_auth=True)
        self.clients.append(c)
        return c

    def close(self) -> None:
        for c in self.clients:
            c.close()


@pytest.fixture
def users(etcd_binary: str) -> Iterator[Users]:
    server = EtcdServer(binary=etcd_binary, auth=AuthConfig(ROOT_PW))
    server.start(timeout=30)
    made: Users | None = None
    try:
        made = Users(server.get_endpoint())
        yield made
    finally:
        if made is not None:
            made.close()
        server.stop(graceful=False)


def lever(users: Users, lease: int) -> None:
    """job2 attaches a key of its own run to ``lease`` (allowed while the lease holds no key of job1)."""
    users.job2.put(f"{PREFIX}/job2/lever".encode(), b"x", lease=lease)


def test_an_etcd_v2_agents_lease_holds_a_key_of_its_run_so_no_other_job_can_attach(users: Users) -> None:
    a = EtcdRendezvousBackend(users.job1, "job1", key_prefix=PREFIX, ttl=60)
    b = EtcdRendezvousBackend(users.job1, "job1", key_prefix=PREFIX, ttl=60)
    _, token, ok = a.set_state(b"first")
    assert ok
    _, token, ok = b.set_state(b"second", token)  # a's lease now holds no state key: only its anchor
    assert ok
    for backend in (a, b):
        lease = backend._lease_id
        assert users.job1.get(backend.anchor_key(lease)) is not None
        with pytest.raises(EtcdPermissionDenied):
            lever(users, lease)  # job2 may not write the anchor, so etcd refuses the lease
    assert a.set_state(b"third", token)[2]  # a writes with its lease as before


def test_a_refused_lease_is_replaced_and_the_write_goes_on(users: Users) -> None:
    # etcd-v2: a lease refused between its grant and its anchor (job2 won that race)
    backend = EtcdRendezvousBackend(users.job1, "job1", key_prefix=PREFIX, ttl=60)
    assert backend.set_state(b"state")[2]
    poisoned = users.job1.lease_grant(60)
    lever(users, poisoned)
    backend._lease_id = poisoned  # as if this lease had been granted and job2 had attached first
    current = backend.get_state()
    assert current is not None
    token = current[1]
    assert backend.set_state(b"again", token)[2]
    assert backend._lease_id not in (0, poisoned)

    # etcd-v3's and every leased writer's loop: a write refused with one lease goes on with the next
    fresh = [poisoned, users.job1.lease_grant(60)]
    forgotten: list[int] = []
    key = f"{PREFIX}/job1/v3/join/1/n".encode()
    renewing_lease(lambda lease: users.job1.put(key, b"x", lease=lease), lambda: fresh.pop(0), forgotten.append)
    assert forgotten == [poisoned]
    kv = users.job1.get(key)
    assert kv is not None and kv.lease not in (0, poisoned)

    # a key the user may really not write: refused again after one new lease, and said so
    grants: list[int] = []

    def grant() -> int:
        grants.append(users.job1.lease_grant(60))
        return grants[-1]

    with pytest.raises(EtcdPermissionDenied):
        renewing_lease(lambda lease: users.job1.put(b"/elsewhere", b"x", lease=lease), grant, lambda _: None)
    assert len(grants) == 2


def test_an_etcd_store_write_goes_on_after_its_namespace_lease_was_refused(
        users: Users, monkeypatch: pytest.MonkeyPatch) -> None:
    from etcd_store._namespace import NamespaceLease

    poisoned = users.job1.lease_grant(60)
    lever(users, poisoned)  # job2 won the race between the store's grant and its record Txn
    real_grant = NamespaceLease._grant
    granted: list[int] = []

    def grant(self: NamespaceLease, timeout: float) -> int:
        granted.append(poisoned if not granted else real_grant(self, timeout))
        return granted[-1]

    monkeypatch.setattr(NamespaceLease, "_grant", grant)
    store = EtcdStore(users.job1, prefix=f"{PREFIX}/job1/store", timeout=timedelta(seconds=10), lease_ttl=60)
    try:
        store.set("a", "1")
        assert len(granted) == 2 and granted[0] == poisoned
        leases = {kv.lease for kv in users.job1.range(f"{PREFIX}/job1/store".encode(), prefix=True).kvs}
        assert leases == {granted[1]}  # every key of the namespace on the new lease
        # which holds the namespace's record key from its first write: job2 cannot attach to it
        with pytest.raises(EtcdPermissionDenied):
            lever(users, granted[1])
        assert store.get("a") == b"1"
    finally:
        store.close()
