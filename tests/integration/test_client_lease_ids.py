"""Lease ids the client draws at random (security issue 32: etcd's own ids are sequential, so any
etcd user could find a job's leases below its own and attach a key to one, after which every leased
write of the job failed with a permission error), and a grant resent after a lost reply that
leaves no second lease behind."""

from __future__ import annotations

import pytest

from etcd_store.client import EtcdClient
from etcd_store.errors import EtcdLeaseExists

pytestmark = pytest.mark.etcd_matrix("3.6")


def test_granted_lease_ids_are_random_not_sequential(etcd_endpoint: str) -> None:
    with EtcdClient(etcd_endpoint, timeout=10) as client:
        ids = [client.lease_grant(5) for _ in range(6)]
        try:
            assert len(set(ids)) == 6
            gaps = sorted(abs(b - a) for a, b in zip(ids, ids[1:], strict=False))
            assert gaps[0] > 1 << 20, f"sequential-looking ids {[hex(i) for i in ids]}"
            assert all(0 < i < 1 << 63 for i in ids)
        finally:
            for i in ids:
                client.lease_revoke(i)


def test_a_resent_grant_is_taken_as_ours_and_a_given_id_that_exists_is_refused(
        etcd_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with EtcdClient(etcd_endpoint, timeout=10) as client:
        fixed = 0x1234_5678_9ABC
        monkeypatch.setattr("etcd_store.client.calls.random_lease_id", lambda: fixed)
        assert client.lease_grant(5) == fixed
        try:
            assert client.lease_grant(5) == fixed  # etcd: "lease already exists"; alive: our earlier send
            with pytest.raises(EtcdLeaseExists):
                client.lease_grant(5, lease_id=fixed)
        finally:
            client.lease_revoke(fixed)
