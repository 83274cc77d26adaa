"""Which ``MASTER_ADDR``/``MASTER_PORT`` a sealer names for a round (:mod:`etcd_rdzv.native.start`).

Every join value carries a free port of the joiner's host and when it was probed. The sealer
names rank 0's address and port in the sealed record only while that probe is recent (torch
probes the port once the round is known); else rank 0 probes a port when it learns the round,
and the members read it from the round's store.
"""

from __future__ import annotations

import json

from etcd_rdzv.native import start

NOW = 1_700_000_000.0


def value(port: object = 29500, probed: object = NOW, addr: object = "10.0.0.7") -> bytes:
    return json.dumps({"addr": addr, "pid": 1, "port": port, "probed": probed}).encode()


def test_a_recent_probe_is_named() -> None:
    assert start.master_of(value(), NOW + 5, max_age=60) == ("10.0.0.7", 29500)


def test_an_old_probe_is_not_named() -> None:
    """A node that waited (a full group kept it out for hours) probed its port long ago."""
    assert start.master_of(value(), NOW + 61, max_age=60) is None


def test_a_probe_from_a_clock_far_ahead_is_not_named() -> None:
    assert start.master_of(value(probed=NOW + 600), NOW, max_age=60) is None
    assert start.master_of(value(probed=NOW + 5), NOW, max_age=60) == ("10.0.0.7", 29500)


def test_a_value_without_a_probe_time_or_a_port_is_not_named() -> None:
    legacy = json.dumps({"addr": "10.0.0.7", "pid": 1, "port": 29500}).encode()
    assert start.master_of(legacy, NOW, max_age=60) is None
    assert start.master_of(value(port=None), NOW, max_age=60) is None
    assert start.master_of(value(probed="soon"), NOW, max_age=60) is None
    assert start.master_of(b"not json", NOW, max_age=60) is None


def test_the_join_value_names_when_its_port_was_probed(monkeypatch: object) -> None:
    doc = json.loads(start.join_value("node-1"))
    assert doc["addr"] == "node-1" and isinstance(doc["port"], int) and isinstance(doc["probed"], float)
