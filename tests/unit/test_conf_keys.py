"""The warning about rdzv-conf keys a backend would ignore (etcd_rdzv/conf_keys.py). No etcd."""

from __future__ import annotations

import itertools
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.elastic.rendezvous as torch_rdzv
import torch.distributed.launcher.api as torch_launcher
from torch.distributed.elastic.rendezvous import RendezvousParameters

from etcd_rdzv import conf_keys
from etcd_rdzv.conf import LEGACY_ALIASES, parse_dynamic_settings, parse_v3_settings
from etcd_rdzv.conf_keys import LEGACY_KEYS, TORCH_KEYS, unknown_keys, warn_unknown_keys

_ids = itertools.count()


def _params(backend: str, **conf: Any) -> RendezvousParameters:
    return RendezvousParameters(
        backend=backend, endpoint="127.0.0.1:2379", run_id=f"keys-run-{next(_ids)}", min_nodes=1, max_nodes=2,
        **conf,
    )  # fmt: skip


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conf_keys, "_warned", set())


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "etcd_rdzv.conf_keys"]


def test_a_misspelt_key_is_named_once_with_a_suggestion(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # once per process per key set
            parse_v3_settings(_params("etcd-v3", join_timout="60", timeout="900"))
    assert _warnings(caplog) == [
        "etcd-rdzv: the etcd-v3 rendezvous ignores the rdzv-conf key 'join_timout' (did you mean "
        "'join_timeout'?); its keys are listed in docs/configuration.md."
    ]
    assert caplog.records[0].levelno == logging.WARNING
    with caplog.at_level(logging.WARNING):  # another set: warned again, every key named
        parse_dynamic_settings(_params("etcd-v2", join_timout="60", zzz="1"))
    assert "'join_timout' (did you mean 'join_timeout'?), 'zzz';" in _warnings(caplog)[-1]
    assert "etcd-v2 rendezvous ignores the rdzv-conf keys" in _warnings(caplog)[-1]


def test_keys_of_another_backend_say_which_one_reads_them(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        parse_dynamic_settings(_params("etcd-v2", renew_interval="1"))
        parse_v3_settings(_params("etcd-v3", cacert="/nonexistent/ca.pem"))
    assert "'renew_interval' (read by etcd-v3 only)" in _warnings(caplog)[0]
    assert "'cacert' (the legacy 'etcd' backend's name of 'ca_cert'" in _warnings(caplog)[1]


def test_no_warning_for_torch_keys_ours_or_legacy_names_on_etcd(caplog: pytest.LogCaptureFixture) -> None:
    v3 = {"join_timeout": "60", "last_call_timeout": "1", "close_timeout": "5", "heartbeat": "3",
          "heartbeat_timeout": "5", "keep_alive_interval": "1", "keep_alive_max_attempt": "3",
          "fast_recovery": "true", "read_timeout": "5", "state_ttl": "60", "key_prefix": "/k",
          "metrics_port": "9400", "metrics_addr": "127.0.0.1"}
    torch_only = {"timeout": "900", "rank": "0", "is_host": "1", "store_type": "tcp"}
    with caplog.at_level(logging.DEBUG):
        parse_v3_settings(_params("etcd-v3", **v3, **torch_only))
        parse_dynamic_settings(_params("etcd-v2", timeout="900", rank="0", heartbeat="5", join_timeout="60",
                                       metrics_port="9400"))
        parse_dynamic_settings(_params("etcd", timeout="900", etcd_prefix="/p"), legacy=True)
    assert _warnings(caplog) == []


def test_torchrun_own_conf_is_not_flagged() -> None:
    """What torchrun builds for a plain `--rdzv-conf=join_timeout=60` (it adds `timeout`)."""
    config = torch_launcher.LaunchConfig(min_nodes=1, max_nodes=2, nproc_per_node=1,
                                         rdzv_configs={"join_timeout": "60"})  # fmt: skip
    assert set(config.rdzv_configs) == {"join_timeout", "timeout"}
    for kind in ("etcd-v2", "etcd", "etcd-v3"):
        assert unknown_keys(kind, config.rdzv_configs) == []


def test_every_key_torch_reads_is_known() -> None:
    """Scan torch's rendezvous and launcher sources for the conf keys they read: none may be flagged."""
    roots = [Path(torch_rdzv.__file__).parent, Path(torch_launcher.__file__)]
    files = [p for r in roots for p in ([r] if r.is_file() else r.glob("*.py"))]
    text = "\n".join(p.read_text() for p in files)
    read = set(re.findall(r"params\.(?:config\.)?get(?:_as_bool|_as_int)?\(\s*\"([a-z_]+)\"", text))
    read |= {f"{k}_timeout" for k in re.findall(r"_get_timeout\(\s*params,\s*\"([a-z_]+)\"", text)}
    read |= set(re.findall(r"rdzv_configs\[\"([a-z_]+)\"\]", text))
    assert {"join_timeout", "keep_alive_interval", "is_host", "timeout", "read_timeout"} <= read  # the scan works
    assert read - TORCH_KEYS - LEGACY_KEYS == set()
    assert LEGACY_KEYS == set(LEGACY_ALIASES)


def test_warn_unknown_keys_returns_the_flagged_keys_even_when_quiet() -> None:
    assert warn_unknown_keys("etcd-v3", "etcd-v3", ["b", "a", "join_timeout"]) == ["a", "b"]
    assert warn_unknown_keys("etcd-v3", "etcd-v3", ["a", "b"]) == ["a", "b"]  # already warned
    assert warn_unknown_keys("etcd-v3", "etcd-v3", []) == []


_DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


@pytest.mark.parametrize(("section", "heading"), [
    ("connection", "## Connection keys (all backends)"), ("dynamic", "## `etcd-v2` and `etcd`"), ("v3", "## `etcd-v3`"),
])  # fmt: skip
def test_the_doc_tables_are_the_key_table(section: str, heading: str) -> None:
    """docs/configuration.md's key tables are rendered from conf_keys.KEYS: a key added, removed or
    re-defaulted in one and not the other fails here."""
    part = _DOC.read_text().split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = part.splitlines()
    start = lines.index("| key | default | meaning |")
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    assert "\n".join(lines[start:end]) == conf_keys.doc_table(section), (
        f"docs/configuration.md's {section} table differs from etcd_rdzv/conf_keys.py's KEYS; the table "
        f"the code declares:\n{conf_keys.doc_table(section)}")


def test_every_default_comes_from_the_key_table() -> None:
    """Parsing an empty rdzv-conf gives each key's table default, on both handlers' settings."""
    dynamic = parse_dynamic_settings(_params("etcd-v2"))
    v3, client = parse_v3_settings(_params("etcd-v3"))
    checked = 0
    for key in conf_keys.KEYS:
        if key.default is None or key.name.startswith("metrics_"):
            continue
        if key.backends == conf_keys.V3:
            holder: Any = v3
        elif key.backends == conf_keys.DYNAMIC:
            holder = dynamic
        else:
            holder = client if hasattr(client, key.name) else dynamic.config
            if hasattr(v3, key.name):  # a connection key etcd-v3's settings hold (state_ttl, key_prefix)
                assert getattr(v3, key.name) == key.default, key
                checked += 1
        if hasattr(holder, key.name):
            assert getattr(holder, key.name) == key.default, key
            checked += 1
    assert checked >= 20
    assert v3.lease_ttl == conf_keys.DEFAULT_LEASE_TTL == 15


def test_a_huge_integer_is_read_exactly_and_bounded_by_its_reader() -> None:
    """Integers are parsed as ints, never through a float: a 400-digit state_ttl gets the bound's
    ValueError naming the key (a float would raise OverflowError), a count above 2**53 keeps every digit."""
    with pytest.raises(ValueError, match="'state_ttl' must be at most"):
        parse_v3_settings(_params("etcd-v3", state_ttl="9" * 400))
    assert conf_keys.count("evict_misses", str(2**60 + 1)) == 2**60 + 1
    with pytest.raises(ValueError, match="'evict_misses' must be an integer of 0 or more"):
        conf_keys.count("evict_misses", "1e3")


def test_a_backend_reads_each_key_through_one_row() -> None:
    """One row per key and backend: a second would be a second default or parser for the same setting."""
    rows = [(k.name, backend) for k in conf_keys.KEYS for backend in k.backends]
    assert len(rows) == len(set(rows))
